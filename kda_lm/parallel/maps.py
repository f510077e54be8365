"""Calls per device: `jax.shard_map` over the row axes, the mesh queries
the layers ask, and the expert exchange.

Shape glossary: B batch rows, T tokens per row (global), D channels; `n`
shards on a mesh axis.

The model runs under `jit` (GSPMD) with the batch sharded
`P((data, fsdp, expert), context)` and the mesh ambient (`jax.set_mesh`).
GSPMD partitions token-wise XLA work by itself, but it cannot partition a
Pallas call (Mosaic refuses; a Triton call is replicated) nor a sort of all
tokens (it replicates it), and it may place a computation where the
layouts of its operands disagree (the LM head's vocabulary and the rows
both split over `fsdp`: it gathered the whole batch's logits). So, on every
mesh, whatever its sizes, each device works on its own rows:

* `token_map`: a token-wise function on each device's tokens (the MoE
  dispatch's sort and grouped matmuls);
* `expert_map`: the same with the routed experts split over `expert`; the
  (token, expert) pairs travel to the devices that own their experts and
  back (`expert_exchange`, `all_to_all`; `expert_ragged_exchange`,
  `ragged_all_to_all`, where the backend runs it);
* `row_sum_map`: per-row work whose results add up over the devices (the
  LM head and the loss, and their gradients).

Context parallelism (the KDA, convolution and MLA maps across `context`
shards) lives in `kda_lm.parallel.context`. Outside `jax.set_mesh` every
function here is the single-device code.
"""

from typing import Any, Callable, Optional, Sequence

import jax

from kda_lm.ops import gmm
from kda_lm.parallel import sharding

P = jax.sharding.PartitionSpec
CONTEXT_AXIS = sharding.CONTEXT_AXIS
EXPERT_AXIS = sharding.EXPERT_AXIS


def ambient_mesh() -> Optional[Any]:
  """The ambient (abstract) mesh, or None outside `jax.set_mesh`."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def under_mesh() -> bool:
  """Whether a device mesh is ambient (the sharded calls are needed)."""
  return ambient_mesh() is not None


def context_size() -> int:
  """Shards along T: the ambient mesh's `context` size (1 without one)."""
  mesh = ambient_mesh()
  if mesh is None or CONTEXT_AXIS not in mesh.axis_names:
    return 1
  return int(mesh.shape[CONTEXT_AXIS])


def expert_size() -> int:
  """Devices the routed experts are split over: the ambient mesh's
  `expert` size (1 without one)."""
  mesh = ambient_mesh()
  if mesh is None or EXPERT_AXIS not in mesh.axis_names:
    return 1
  return int(mesh.shape[EXPERT_AXIS])


def batch_axes(mesh) -> tuple[str, ...]:
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
  mesh = ambient_mesh()
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
  for axis in batch_axes(mesh):
    rows *= int(mesh.shape[axis])
  if T % n:
    raise ValueError(f"{what} under context parallelism: T = {T} tokens "
                     f"per row is not a multiple of mesh.context = {n}.")
  if B % rows:
    raise ValueError(f"{what} on the device mesh: B = {B} rows is not a "
                     f"multiple of the {rows} data x fsdp x expert devices.")
  return n


def token_axes(mesh) -> tuple[str, ...]:
  """The mesh axes that shard tokens (`context`, if present)."""
  return (CONTEXT_AXIS,) if CONTEXT_AXIS in mesh.axis_names else ()


def row_axes() -> tuple[str, ...]:
  """The mesh axes a [B,T,...] row array varies over inside `shard_map`."""
  mesh = ambient_mesh()
  return batch_axes(mesh) + token_axes(mesh)


def row_spec(mesh) -> P:
  """[B,T,...] arrays: rows over (data, fsdp, expert), tokens over
  context."""
  return P(batch_axes(mesh) or None, token_axes(mesh) or None)


def sharded(fn, in_specs, out_specs, check_vma=True):
  """`jax.shard_map` of `fn` over the ambient mesh."""
  return jax.shard_map(fn, mesh=ambient_mesh(), in_specs=in_specs,
                       out_specs=out_specs, check_vma=check_vma)


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
  rows = row_spec(ambient_mesh())
  specs = (rows,) * len(tokens) + (P(),) * len(replicated)
  return sharded(fn, specs, rows, check_vma)(*tokens, *replicated)


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
  rows, axes = row_spec(ambient_mesh()), row_axes()

  def body(*args):
    summed, per_token = fn(*args)
    return jax.tree.map(lambda x: x[None], summed), per_token

  # One slice per device along a new leading axis, added up outside:
  # GSPMD then reduces (or reduce-scatters) into the caller's layout. No
  # varying-axes check: `fn`'s accumulators start as constants, and
  # nothing differentiates through this map (the loss's custom_vjp
  # calls it for its gradient).
  specs = (rows,) * len(tokens) + (P(),) * len(replicated)
  summed, per_token = sharded(body, specs, (P(axes), rows), False)(
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
  rows = row_spec(ambient_mesh())
  specs = (rows,) * len(tokens) + (P(EXPERT_AXIS),) * len(experts)
  return sharded(fn, specs, rows, check_vma)(*tokens, *experts)


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
