"""Sharded calls: kernels and sorts per device, and context parallelism.

Shape glossary: B batch rows, T tokens per row (global), H heads, K key dim,
V value dim, D channels; `n` shards on the `context` mesh axis, `T/n` tokens
per shard.

The model runs under `jit` (GSPMD) with the batch sharded
`P((data, fsdp), context)` and the mesh ambient (`jax.set_mesh`). GSPMD
partitions token-wise XLA work by itself, but it cannot partition a Pallas
call (Mosaic refuses; a Triton call is replicated) nor a sort of all tokens
(it replicates it). So, on every mesh, whatever its sizes:

* KDA (`chunk_kda`) runs inside `jax.shard_map` over the row axes (`data`,
  `fsdp`) and `context`; each device calls the op on its own rows.
* The MoE dispatch (`token_map`) sorts and multiplies each device's own
  tokens; with an `expert` axis of size > 1 (`expert_map`) each device
  holds E/n of the routed experts, and the (token, expert) pairs travel
  to the devices that own their experts and back (`expert_exchange`,
  `all_to_all` over `expert`).

With a `context` axis of size n > 1 (context parallelism) the
sequence-mixing cores also exchange what crosses a shard boundary:

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

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from kda_lm import ops
from kda_lm.ops import gmm
from kda_lm.ops.kda import api
from kda_lm.parallel import sharding

P = jax.sharding.PartitionSpec
CONTEXT_AXIS = sharding.CONTEXT_AXIS
EXPERT_AXIS = sharding.EXPERT_AXIS


def _mesh() -> Optional[Any]:
  """The ambient (abstract) mesh, or None outside `jax.set_mesh`."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def under_mesh() -> bool:
  """Whether a device mesh is ambient (the sharded calls are needed)."""
  return _mesh() is not None


def context_size() -> int:
  """Shards along T: the ambient mesh's `context` size (1 without one)."""
  mesh = _mesh()
  if mesh is None or CONTEXT_AXIS not in mesh.axis_names:
    return 1
  return int(mesh.shape[CONTEXT_AXIS])


def expert_size() -> int:
  """Devices the routed experts are split over: the ambient mesh's
  `expert` size (1 without one)."""
  mesh = _mesh()
  if mesh is None or EXPERT_AXIS not in mesh.axis_names:
    return 1
  return int(mesh.shape[EXPERT_AXIS])


def _batch_axes(mesh) -> tuple[str, ...]:
  """The mesh axes that shard rows (`data`, `fsdp`, `expert`, those
  present)."""
  return tuple(a for a in sharding.ROW_AXES if a in mesh.axis_names)


def check_shape(B: int, T: int, what: str) -> int:
  """Checks that [B,T] rows can be sharded over the ambient mesh.

  Returns:
    The shard count n along T (1 without a mesh or a `context` axis).

  Raises:
    ValueError: a mesh with axes other than Auto, or with an axis this
      module does not know, T not a multiple of the `context` size, or B
      of the devices the rows are sharded over (`data` x `fsdp` x
      `expert`).
  """
  mesh = _mesh()
  if mesh is None:
    return 1
  auto = jax.sharding.AxisType.Auto
  if any(t != auto for t in mesh.axis_types):
    raise ValueError(f"{what} on a device mesh needs Auto axes "
                     f"(`sharding.make_mesh`), got {mesh.axis_types}.")
  unknown = [a for a in mesh.axis_names if a not in sharding.AXES]
  if unknown:
    raise ValueError(f"{what}: the mesh axis {unknown[0]!r} is none of "
                     f"{sharding.AXES}; the model cannot shard over it.")
  n = context_size()
  rows = 1
  for axis in _batch_axes(mesh):
    rows *= int(mesh.shape[axis])
  if T % n:
    raise ValueError(f"{what} under context parallelism: T = {T} tokens "
                     f"per row is not a multiple of mesh.context = {n}.")
  if B % rows:
    raise ValueError(f"{what} on the device mesh: B = {B} rows is not a "
                     f"multiple of the {rows} data x fsdp x expert devices.")
  return n


def _token_axes(mesh) -> tuple[str, ...]:
  return (CONTEXT_AXIS,) if CONTEXT_AXIS in mesh.axis_names else ()


def _row_axes() -> tuple[str, ...]:
  """The mesh axes a [B,T,...] row array varies over inside `shard_map`."""
  mesh = _mesh()
  return _batch_axes(mesh) + _token_axes(mesh)


def _row_spec(mesh) -> P:
  """[B,T,...] arrays: rows over (data, fsdp), tokens over context."""
  return P(_batch_axes(mesh) or None, _token_axes(mesh) or None)


def _shard_map(fn, in_specs, out_specs, check_vma=True):
  return jax.shard_map(fn, mesh=_mesh(), in_specs=in_specs,
                       out_specs=out_specs, check_vma=check_vma)


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
    h0_aug = jax.lax.pcast(h0_aug, _row_axes(), to="varying")
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
  n = check_shape(B, T, "chunk_kda")
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
  mesh = _mesh()
  rows, batch = _row_spec(mesh), P(_batch_axes(mesh) or None)
  specs = {"segment_ids": rows, "initial_state": batch, "A_log": P(),
           "dt_bias": P()}

  def local(q, k, v, g, beta, optional):
    o, final = ops.chunk_kda(q, k, v, g, beta, **optional,
                             output_final_state=output_final_state,
                             **op_kwargs)
    return (o, final) if output_final_state else o

  out_specs = (rows, batch) if output_final_state else rows
  out = _shard_map(local, (rows,) * 5 + ({key: specs[key] for key in
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
  if not under_mesh():
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
  mesh = _mesh()
  rows, batch = _row_spec(mesh), P(_batch_axes(mesh) or None)
  use_a, use_dt = A_log is not None, dt_bias is not None
  A_log = jnp.zeros((1,), jnp.float32) if A_log is None else A_log
  dt_bias = jnp.zeros((1,), jnp.float32) if dt_bias is None else dt_bias

  def local(q, k, v, g, beta, segment_ids, h0, A_log, dt_bias):
    return _kda_local(
        q, k, v, g, beta, segment_ids, h0,
        A_log if use_a else None,
        dt_bias if use_dt else None, op_kwargs=op_kwargs,
        check_vma=check_vma)

  stacked = P(CONTEXT_AXIS, _batch_axes(mesh) or None)
  o, final = _shard_map(local, (rows,) * 6 + (batch, P(), P()),
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
  n = check_shape(B, T, "The short convolution")
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

  rows = _row_spec(_mesh())
  return _shard_map(local, (rows, rows) + (P(),) * len(replicated),
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
  n = check_shape(B, T, "Attention")
  rows = _row_spec(_mesh())
  nl, ng = len(local), len(gathered)

  def body(*args):
    mine, whole, params = args[:nl], args[nl:nl + ng], args[nl + ng:]
    whole = [jax.lax.all_gather(a, CONTEXT_AXIS, axis=1, tiled=True)
             for a in whole]
    offset = jax.lax.axis_index(CONTEXT_AXIS) * (T // n)
    return fn(offset.astype(jnp.int32), list(mine), whole, list(params))

  specs = (rows,) * (nl + ng) + (P(),) * len(replicated)
  return _shard_map(body, specs, rows)(*local, *gathered, *replicated)


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


def token_map(fn: Callable[..., jax.Array], tokens: Sequence[jax.Array],
              replicated: Sequence[jax.Array], check_vma: bool = True
              ) -> jax.Array:
  """Runs a token-wise `fn` on each device's tokens (`fn` itself outside
  a mesh).

  For computations GSPMD would not partition (a sort of all the tokens and
  the grouped-matmul kernels of the MoE dispatch), so that each device
  works on its own rows and its own slice of T.

  Args:
    fn: `fn(*tokens, *replicated)` on the shard's [B,T/n,...] slices,
      returning [B,T/n,...].
    tokens: [B,T,...] arrays (global).
    replicated: arrays every shard receives whole (parameters).
    check_vma: shard_map's varying-axes check; False when `fn` makes a
      Pallas call (its outputs carry no varying-axes type).

  Returns:
    [B,T,...] (global).
  """
  if not under_mesh():
    return fn(*tokens, *replicated)
  B, T = tokens[0].shape[:2]
  check_shape(B, T, "A token-wise layer")
  rows = _row_spec(_mesh())
  specs = (rows,) * len(tokens) + (P(),) * len(replicated)
  return _shard_map(fn, specs, rows, check_vma)(*tokens, *replicated)


def row_sum_map(fn: Callable[..., tuple[Any, Any]],
                tokens: Sequence[jax.Array],
                replicated: Sequence[jax.Array]) -> tuple[Any, Any]:
  """Runs `fn` on each device's rows; sums its `summed` outputs over them.

  For the LM head and the loss: each device multiplies its own rows'
  hidden states by the whole head (GSPMD, left alone, may instead gather
  the whole batch's logits onto every device when the head's vocabulary
  and the rows are split over the same axis).

  Args:
    fn: `fn(*tokens, *replicated) -> (summed, per_token)` on the shard's
      [B,T/n,...] slices and the whole `replicated` arrays: `summed` a
      pytree of arrays to add up over the devices (sums, a parameter's
      gradient), `per_token` one of [B,T/n,...] arrays.
    tokens: [B,T,...] arrays (global).
    replicated: arrays every device receives whole (parameters).

  Returns:
    (`summed` added over every device's rows, `per_token` [B,T,...]
    global). Outside a mesh, `fn(*tokens, *replicated)`.
  """
  if not under_mesh():
    return fn(*tokens, *replicated)
  B, T = tokens[0].shape[:2]
  check_shape(B, T, "The LM head and loss")
  rows, axes = _row_spec(_mesh()), _row_axes()

  def body(*args):
    summed, per_token = fn(*args)
    return jax.tree.map(lambda x: x[None], summed), per_token

  # One slice per device along a new leading axis, added up outside:
  # GSPMD then reduces (or reduce-scatters) into the caller's layout. No
  # varying-axes check: `fn`'s accumulators start as constants, and
  # nothing differentiates through this map (the loss's custom_vjp
  # calls it for its gradient).
  specs = (rows,) * len(tokens) + (P(),) * len(replicated)
  summed, per_token = _shard_map(body, specs, (P(axes), rows), False)(
      *tokens, *replicated)
  return jax.tree.map(lambda x: x.sum(0), summed), per_token


def expert_map(fn: Callable[..., jax.Array], tokens: Sequence[jax.Array],
               experts: Sequence[jax.Array], check_vma: bool = True
               ) -> jax.Array:
  """`token_map` with the routed experts split over the `expert` axis.

  Args:
    fn: `fn(*tokens, *experts)` on the shard's [B,T/n,...] slices and its
      E/n experts ([E/n,...] slices of each expert array), returning
      [B,T/n,...]; it exchanges tokens with `expert_exchange`.
    tokens: [B,T,...] arrays (global).
    experts: [E,...] arrays (global), split along E over `expert`.
    check_vma: shard_map's varying-axes check (False for Pallas calls).

  Returns:
    [B,T,...] (global).

  Raises:
    ValueError: the shapes `check_shape` refuses, or E not a multiple of
      the `expert` size.
  """
  B, T = tokens[0].shape[:2]
  check_shape(B, T, "The expert-parallel MoE")
  sharding.check_expert_axis(expert_size(), experts[0].shape[0])
  rows = _row_spec(_mesh())
  specs = (rows,) * len(tokens) + (P(EXPERT_AXIS),) * len(experts)
  return _shard_map(fn, specs, rows, check_vma)(*tokens, *experts)


def ragged_exchange_supported() -> bool:
  """Whether the backend runs `ragged_all_to_all` (TPU and GPU; XLA:CPU
  has no implementation, so CPU runs exchange padded buffers)."""
  return jax.default_backend() != "cpu"


def expert_ragged_exchange(operand: jax.Array, output: jax.Array,
                           input_offsets: jax.Array, send_sizes: jax.Array,
                           output_offsets: jax.Array, recv_sizes: jax.Array
                           ) -> jax.Array:
  """Inside `expert_map`'s `fn`: `jax.lax.ragged_all_to_all` over
  `expert`. Rows `operand[input_offsets[j]:][:send_sizes[j]]` go to shard
  j, which writes them at its row `output_offsets[j]`; returns `output`
  with the `recv_sizes[s]` rows from each shard s written in."""
  output = gmm.varying_like(output, operand)
  return jax.lax.ragged_all_to_all(operand, output, input_offsets,
                                   send_sizes, output_offsets, recv_sizes,
                                   axis_name=EXPERT_AXIS)


def expert_exchange(x: jax.Array) -> jax.Array:
  """Inside `expert_map`'s `fn`: `x[j]` ([n,...], one slice per `expert`
  shard) goes to shard j; returns [n,...] whose slice s came from shard s
  (its `x[me]`). Its own inverse: a second call sends replies back."""
  return jax.lax.all_to_all(x, EXPERT_AXIS, 0, 0)
