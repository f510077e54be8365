"""Context parallelism: rows split along T over the `context` mesh axis.

Shape glossary: B batch rows, T tokens per row (global), H heads, K key dim,
V value dim, D channels; `n` shards on the `context` mesh axis, `T/n` tokens
per shard.

KDA (`chunk_kda`) runs inside `jax.shard_map` over the row axes and
`context` on every mesh (`kda_lm.parallel.maps` holds the per-device calls
and mesh queries); with a `context` axis of size n > 1 the sequence-mixing
cores also exchange what crosses a shard boundary:

* KDA: per head the recurrence over a shard is affine in the
  state entering it, `S_out = M S_in + C`. One local pass with values
  `[v, 0]` (width V + K) and initial state `[0, I]` gives the zero-state
  output `o0` and final state `C`, plus `P_t = scale q_t^T M_t` and `M`.
  The (M, C) of all shards are all-gathered over `context` and combined in
  order, which gives each shard its true incoming state `X`; its output is
  `o0 + P X`. No second pass.
* The short convolution (`left_halo_map`): the last `J - 1` inputs and ids
  of the left neighbour arrive by `ppermute`; shard 0 gets zeros.
* MLA (`gather_map`, `swap_with_mirror`): the latent and the RoPE key (and
  the ids) are all-gathered over `context`; shard i attends for its first
  half and for the second half of shard n - 1 - i (queries and outputs
  swapped by `ppermute`), which balances the causal work; the core masks
  by global positions.

`kda_lm/segments.py` stays the one definition of a segment start; the state
exchange applies its rule across shard boundaries (see `_keep_state`).
Outside `jax.set_mesh` every function here is the single-device code.
"""

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from kda_lm import ops
from kda_lm.ops.kda import api
from kda_lm.parallel import maps

P = jax.sharding.PartitionSpec
CONTEXT_AXIS = maps.CONTEXT_AXIS


# ---------------------------------------------------------------------------
# KDA.


def _keep_state(ids_BT):
  """[n,B] float32: 1 where shard j's local op must start from the state
  entering it (the global state after shard j - 1), 0 where it starts from
  zero.

  The state enters shard j's first local segment when that segment
  continues the previous token's (same nonzero id), or when no earlier
  shard holds a real token (the row's first segment starts from
  `initial_state`, passed through padding). A shard of padding only keeps
  the state unchanged (its M = I, C = 0).
  """
  first = jax.lax.all_gather(ids_BT[:, 0], CONTEXT_AXIS)       # [n,B]
  last = jax.lax.all_gather(ids_BT[:, -1], CONTEXT_AXIS)
  real = jax.lax.all_gather(jnp.any(ids_BT != 0, axis=1), CONTEXT_AXIS)
  prev_last = jnp.concatenate([jnp.zeros_like(last[:1]), last[:-1]])
  continues = (first != 0) & (first == prev_last)
  real_before = jnp.cumsum(real.astype(jnp.int32), axis=0) - real > 0
  return (~real | continues | ~real_before).astype(jnp.float32)


def _incoming_states(M_nBHKK, C_nBHKV, keep_nB, h0_BHKV):
  """The state entering every shard and the row's final state.

  Returns:
    ([n,B,H,K,V] states entering each shard's first local segment (keep
    applied), [B,H,K,V] the state after the last shard).
  """
  state, entering = h0_BHKV, []
  for j in range(M_nBHKK.shape[0]):
    x = keep_nB[j][:, None, None, None] * state
    entering.append(x)
    state = jnp.einsum("bhkj,bhjv->bhkv", M_nBHKK[j], x,
                       precision=jax.lax.Precision.HIGHEST) + C_nBHKV[j]
  return jnp.stack(entering), state


def _kda_local(q, k, v, g, beta, segment_ids, h0, A_log, dt_bias, *,
               op_kwargs, check_vma):
  """One shard of `chunk_kda`: the widened pass, the exchange, `o0 + P X`."""
  B, _, H, K = q.shape
  V = v.shape[-1]
  v_aug = jnp.concatenate([v, jnp.zeros(v.shape[:3] + (K,), v.dtype)], -1)
  eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, H, K, K))
  h0_aug = jnp.concatenate([jnp.zeros((B, H, K, V), jnp.float32), eye], -1)
  if check_vma:  # A constant carried next to varying arrays in scans.
    h0_aug = jax.lax.pcast(h0_aug, maps.row_axes(), to="varying")
  o_aug, st_aug = ops.chunk_kda(
      q, k, v_aug, g, beta, initial_state=h0_aug, output_final_state=True,
      segment_ids=segment_ids, A_log=A_log, dt_bias=dt_bias, **op_kwargs)
  o0_BTHV, p_BTHK = o_aug[..., :V], o_aug[..., V:]
  C_BHKV, M_BHKK = st_aug[..., :V], st_aug[..., V:]
  keep_nB = _keep_state(segment_ids)
  entering_nBHKV, final_BHKV = _incoming_states(
      jax.lax.all_gather(M_BHKK, CONTEXT_AXIS),
      jax.lax.all_gather(C_BHKV, CONTEXT_AXIS), keep_nB, h0)
  x_BHKV = entering_nBHKV[jax.lax.axis_index(CONTEXT_AXIS)]
  o_BTHV = o0_BTHV.astype(jnp.float32) + jnp.einsum(
      "bthk,bhkv->bthv", p_BTHK.astype(jnp.float32), x_BHKV,
      precision=jax.lax.Precision.HIGHEST)
  # Every shard holds the same final state; returned stacked [1,B,H,K,V]
  # per shard (all-gathered values are typed as varying over `context`).
  return o_BTHV.astype(q.dtype), final_BHKV[None]


def _check_kda(B, T, cu_seqlens, impl, bounded):
  """Refuses what the sharded op cannot do (`bounded`: the gates have a
  lower bound, which `api.resolve_impl` weighs).

  Returns:
    (n shards along T, the concrete impl).

  Raises:
    ValueError: `cu_seqlens` on a mesh, impl "reference" under context
      parallelism, or a [B,T] that `check_shape` refuses.
  """
  if cu_seqlens is not None:
    raise ValueError("chunk_kda on a device mesh takes segment_ids, not "
                     "cu_seqlens (rows are sharded over devices).")
  n = maps.check_shape(B, T, "chunk_kda")
  impl = api.resolve_impl(impl, bounded)
  if impl == "reference" and n > 1:
    raise ValueError("chunk_kda under context parallelism needs impl "
                     "'xla', 'pallas' or 'auto' (the local passes reuse "
                     "the chunked op), not 'reference'.")
  return n, impl


def _kda_rows(q, k, v, g, beta, optional, output_final_state, op_kwargs,
              check_vma):
  """`ops.chunk_kda` on each device's own rows (no `context` split).

  Args:
    q, k, v, g, beta: the op's [B,T,...] inputs (global).
    optional: the op's optional arrays that were given, by keyword
      (`segment_ids`, `initial_state`, `A_log`, `dt_bias`).
    output_final_state: also return the [B,H,K,V] final state.
    op_kwargs: the op's other keyword arguments.
    check_vma: shard_map's varying-axes check (off for Pallas calls).

  Returns:
    As `ops.chunk_kda`.
  """
  mesh = maps.ambient_mesh()
  rows, batch = maps.row_spec(mesh), P(maps.batch_axes(mesh) or None)
  specs = {"segment_ids": rows, "initial_state": batch, "A_log": P(),
           "dt_bias": P()}

  def local(q, k, v, g, beta, optional):
    o, final = ops.chunk_kda(q, k, v, g, beta, **optional,
                             output_final_state=output_final_state,
                             **op_kwargs)
    return (o, final) if output_final_state else o

  out_specs = (rows, batch) if output_final_state else rows
  out = maps.sharded(local, (rows,) * 5 + ({key: specs[key] for key in
                                          optional},),
                   out_specs, check_vma)(q, k, v, g, beta, optional)
  return out if output_final_state else (out, None)


def chunk_kda(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
              output_final_state=False, cu_seqlens=None, A_log=None,
              dt_bias=None, **op_kwargs):
  """`ops.chunk_kda` on the ambient device mesh.

  Same arguments and results as `kda_lm.ops.chunk_kda` (the other keyword
  arguments pass through). Outside `jax.set_mesh` it is that function; on
  a mesh each device runs the op on its rows inside `jax.shard_map`, and a
  `context` axis of size > 1 splits the rows along T, exactly.

  Raises:
    ValueError: on a mesh, `cu_seqlens` (use `segment_ids`), or a [B,T]
      that `check_shape` refuses; under context parallelism impl
      "reference"; the op's own checks otherwise.
  """
  if not maps.under_mesh():
    return ops.chunk_kda(
        q, k, v, g, beta, segment_ids=segment_ids,
        initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, **op_kwargs)
  B, T, H, K = q.shape
  n, impl = _check_kda(B, T, cu_seqlens, op_kwargs.get("impl", "auto"),
                       op_kwargs.get("lower_bound") is not None)
  if n == 1:
    # No vma check: the op's scans start from an unvarying zero state when
    # none is given (shard_map still sums the cotangents of replicated
    # inputs over the devices).
    optional = dict(segment_ids=segment_ids, initial_state=initial_state,
                    A_log=A_log, dt_bias=dt_bias)
    return _kda_rows(q, k, v, g, beta,
                     {k_: a for k_, a in optional.items() if a is not None},
                     output_final_state, op_kwargs, check_vma=False)
  # Pallas calls declare outputs without varying-axis types: no vma check
  # (shard_map then psums the cotangents of replicated inputs itself).
  check_vma = impl != "pallas"
  V = v.shape[-1]
  if segment_ids is None:
    segment_ids = jnp.ones((B, T), jnp.int32)
  h0 = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  mesh = maps.ambient_mesh()
  rows, batch = maps.row_spec(mesh), P(maps.batch_axes(mesh) or None)
  use_a, use_dt = A_log is not None, dt_bias is not None
  A_log = jnp.zeros((1,), jnp.float32) if A_log is None else A_log
  dt_bias = jnp.zeros((1,), jnp.float32) if dt_bias is None else dt_bias

  def local(q, k, v, g, beta, segment_ids, h0, A_log, dt_bias):
    return _kda_local(
        q, k, v, g, beta, segment_ids, h0,
        A_log if use_a else None,
        dt_bias if use_dt else None, op_kwargs=op_kwargs,
        check_vma=check_vma)

  stacked = P(CONTEXT_AXIS, maps.batch_axes(mesh) or None)
  o, final = maps.sharded(local, (rows,) * 6 + (batch, P(), P()),
                        (rows, stacked), check_vma)(
                            q, k, v, g, beta, segment_ids, h0, A_log, dt_bias)
  return o, (final[-1] if output_final_state else None)


# ---------------------------------------------------------------------------
# Short convolution and attention: generic halo and gather maps.


def left_halo_map(fn: Callable[..., jax.Array], x_BTD: jax.Array,
                  segment_ids: jax.Array, width: int,
                  *replicated: jax.Array) -> jax.Array:
  """Runs `fn` on each shard with `width` tokens of left context.

  Args:
    fn: `fn(x_ext [B,width+T/n,D], ids_ext [B,width+T/n], *replicated)`
      returning the shard's [B,T/n,D'] output; the first `width` tokens are
      the left neighbour's last ones (zeros with id 0 on shard 0).
    x_BTD: [B,T,D] inputs (global).
    segment_ids: [B,T] int ids (global).
    width: tokens of left context, <= T/n.
    *replicated: arrays every shard receives whole (parameters).

  Returns:
    [B,T,D'] (global).

  Raises:
    ValueError: the shapes `check_shape` refuses, or width > T/n.
  """
  B, T, _ = x_BTD.shape
  n = maps.check_shape(B, T, "The short convolution")
  if width > T // n:
    raise ValueError(f"The short convolution under context parallelism "
                     f"needs T/context = {T // n} >= kernel_size - 1 = "
                     f"{width} tokens per shard.")
  perm = [(i, i + 1) for i in range(n - 1)]

  def local(x, segment_ids, *params):
    halo = lambda a: jax.lax.ppermute(a[:, a.shape[1] - width:],
                                      CONTEXT_AXIS, perm)
    return fn(jnp.concatenate([halo(x), x], axis=1),
              jnp.concatenate([halo(segment_ids), segment_ids], axis=1),
              *params)

  rows = maps.row_spec(maps.ambient_mesh())
  return maps.sharded(local, (rows, rows) + (P(),) * len(replicated),
                    rows)(x_BTD, segment_ids, *replicated)


def gather_map(fn: Callable[..., jax.Array], local: Sequence[jax.Array],
               gathered: Sequence[jax.Array],
               replicated: Sequence[jax.Array]) -> jax.Array:
  """Runs `fn` on each shard with some [B,T,...] inputs gathered whole.

  Args:
    fn: `fn(offset, local, gathered, replicated)` returning the shard's
      [B,T/n,...] output; `offset` (int32 scalar) is the global position of
      the shard's first token, `local` the shard's slices, `gathered` the
      whole rows (all-gathered over `context`).
    local: [B,T,...] arrays (global) that stay sharded.
    gathered: [B,T,...] arrays (global) each shard reads whole.
    replicated: arrays every shard receives whole (parameters).

  Returns:
    [B,T,...] (global).
  """
  B, T = local[0].shape[:2]
  n = maps.check_shape(B, T, "Attention")
  rows = maps.row_spec(maps.ambient_mesh())
  nl, ng = len(local), len(gathered)

  def body(*args):
    mine, whole, params = args[:nl], args[nl:nl + ng], args[nl + ng:]
    whole = [jax.lax.all_gather(a, CONTEXT_AXIS, axis=1, tiled=True)
             for a in whole]
    offset = jax.lax.axis_index(CONTEXT_AXIS) * (T // n)
    return fn(offset.astype(jnp.int32), list(mine), whole, list(params))

  specs = (rows,) * (nl + ng) + (P(),) * len(replicated)
  return maps.sharded(body, specs, rows)(*local, *gathered, *replicated)


def swap_with_mirror(x: jax.Array, n: int) -> jax.Array:
  """Inside `gather_map`'s `fn`: shard i's `x` goes to shard n - 1 - i and
  comes back from it (the middle shard of an odd n keeps its own).

  Args:
    x: any per-shard array.
    n: the `context` size.

  Returns:
    The mirror shard's `x`.
  """
  return jax.lax.ppermute(x, CONTEXT_AXIS,
                          [(s, n - 1 - s) for s in range(n)])
