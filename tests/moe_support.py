"""Shared by the MoE tests: the expert-parallel exchange on shards vmapped
over the `expert` axis name (no devices needed), with `ragged_all_to_all`
emulated from `all_to_all` (XLA:CPU has no ragged exchange)."""

import functools
from unittest import mock

import jax
import jax.numpy as jnp

from kda_lm.layers import moe
from kda_lm.parallel import maps as parallel_maps


def emulated_ragged_exchange(operand, output, input_offsets, send_sizes,
                             output_offsets, recv_sizes):
  """`ragged_all_to_all` over `expert` as its documentation states it,
  built from `all_to_all` (XLA:CPU has no ragged exchange, and JAX cannot
  vmap one over its own axis): shard s's rows
  `operand[input_offsets[j]:][:send_sizes[j]]` land on shard j at row
  `output_offsets[j]` (shard s's value); shard j writes `recv_sizes[s]`
  rows from each shard s."""
  axis = parallel_maps.EXPERT_AXIS
  N, i = operand.shape[0], jnp.arange(operand.shape[0])
  rows = operand[jnp.minimum(input_offsets[:, None] + i, N - 1)]
  buf = jnp.where((i < send_sizes[:, None])[..., None], rows, 0)
  got = jax.lax.all_to_all(buf, axis, 0, 0)          # [n,N,D] by source
  at = jax.lax.all_to_all(output_offsets, axis, 0, 0)
  pos = jnp.where(i < recv_sizes[:, None], at[:, None] + i, output.shape[0])
  return output.at[pos.reshape(-1)].set(got.reshape(-1, *got.shape[2:]),
                                        mode="drop")


def expert_parallel_vmapped(x_nMD, idx_nMA, w_nMA, weights, impl="xla",
                            capacity_factor=None, ragged=False, limit=None):
  """`moe.expert_parallel_swiglu` on n shards as a `jax.vmap` over the
  `expert` axis name (its all_to_all then needs no devices); `ragged`
  exchanges through `emulated_ragged_exchange`. `weights`: the global
  (gate [E,D,F], up [E,D,F], down [E,F,D]), split into n shards here.
  `limit`: the experts' clamp, None for the function's default."""
  n = x_nMD.shape[0]
  local = [a.reshape(n, a.shape[0] // n, *a.shape[1:]) for a in weights]
  clamp = {} if limit is None else {"limit": limit}
  fn = functools.partial(moe.expert_parallel_swiglu, shards=n, impl=impl,
                         capacity_factor=capacity_factor, ragged=ragged,
                         **clamp)
  with mock.patch.object(parallel_maps, "expert_ragged_exchange",
                         emulated_ragged_exchange):
    return jax.vmap(fn, axis_name=parallel_maps.EXPERT_AXIS)(
        x_nMD, idx_nMA, w_nMA, *local)
