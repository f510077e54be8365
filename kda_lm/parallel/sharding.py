"""Devices and sharding: the (`data`, `fsdp`, `expert`, `context`) mesh,
and the shardings of the train state and of the batches.

The batch rows are sharded over `data`, `fsdp` and `expert`, its tokens
over `context` (context parallelism, `kda_lm.parallel.context`).
Parameters and optimizer state are split over `fsdp`, `expert` and
`context` together (each array along its largest dimension that they
divide, `state_axes`): no device but a `data` replica holds a duplicate,
so `fsdp=1`, `expert=1` and `context=1` is plain data parallelism. The
routed experts' weights `[E,D,F]` / `[E,F,D]` (and their optimizer
moments) are split along E over `expert` (`expert_leaf_spec`, expert
parallelism) and along their largest other dimension over `fsdp` and
`context`: every other layer sees `expert` as more data parallelism.
"""

from typing import Any, Mapping

import jax
import numpy as np

PyTree = Any
P = jax.sharding.PartitionSpec
DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
EXPERT_AXIS = "expert"
CONTEXT_AXIS = "context"
AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS, CONTEXT_AXIS)
# The axes batch rows are split over.
ROW_AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS)
# The routed experts' weights: parameter names inside a `.../moe` module.
EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def mesh_shape(mesh_config: Any, num_devices: int
               ) -> tuple[int, int, int, int]:
  """The (`data`, `fsdp`, `expert`, `context`) sizes of `config.mesh` over
  `num_devices` devices.

  Args:
    mesh_config: `config.mesh` (ConfigDict or `kda_lm.config.MeshConfig`);
      `data = -1` takes the devices `fsdp`, `expert` and `context` leave; a
      config without `expert` or `context` means 1.
    num_devices: the devices of the mesh.

  Raises:
    ValueError: an axis size below 1, or sizes that do not multiply to
      `num_devices`.
  """
  fsdp = int(mesh_config.fsdp)
  data = int(mesh_config.data)
  expert = int(getattr(mesh_config, "expert", 1))
  context = int(getattr(mesh_config, "context", 1))
  if min(fsdp, expert, context) < 1 or (data < 1 and data != -1):
    raise ValueError(f"config.mesh.fsdp, expert and context must be >= 1 "
                     f"and config.mesh.data >= 1 or -1, got {fsdp}, "
                     f"{expert}, {context}, {data}.")
  if data == -1:
    data = num_devices // (fsdp * expert * context)
  if data * fsdp * expert * context != num_devices:
    raise ValueError(f"config.mesh data={data} x fsdp={fsdp} x "
                     f"expert={expert} x context={context} does not match "
                     f"the {num_devices} devices.")
  return data, fsdp, expert, context


def make_mesh(mesh_config: Any, devices: list[Any] | None = None
              ) -> jax.sharding.Mesh:
  """A (`data`, `fsdp`, `expert`, `context`) mesh over all devices, of
  `mesh_shape(mesh_config, len(devices))`.

  Args:
    mesh_config: `config.mesh` (see `mesh_shape`).
    devices: default `jax.devices()` (all processes).

  Raises:
    ValueError: as `mesh_shape`.
  """
  devices = list(jax.devices() if devices is None else devices)
  auto = jax.sharding.AxisType.Auto
  return jax.make_mesh(mesh_shape(mesh_config, len(devices)), AXES,
                       axis_types=(auto,) * len(AXES), devices=devices)


def check_expert_axis(expert: int, num_experts: int) -> None:
  """Checks, before anything is traced, that the routed experts divide
  over `config.mesh.expert` devices.

  Raises:
    ValueError: `expert > 1` with a dense model (`num_experts == 0`), or
      `num_experts` not a multiple of `expert`.
  """
  if expert > 1 and not num_experts:
    raise ValueError(f"config.mesh.expert = {expert} shards routed experts, "
                     "but the model has none (config.model.num_experts = "
                     "0); use config.mesh.expert = 1.")
  if num_experts and num_experts % expert:
    raise ValueError(f"config.model.num_experts = {num_experts} is not a "
                     f"multiple of config.mesh.expert = {expert}.")


def leaf_spec(shape: tuple[int, ...], fsdp: int, skip: int = 0,
              axes: str | tuple[str, ...] = FSDP_AXIS) -> P:
  """Shards the largest dimension that `fsdp` divides; else replicates.

  Args:
    shape: the array's shape.
    fsdp: the devices the dimension is split over (the product of the
      sizes of `axes`).
    skip: the first `skip` dimensions (a scanned layer group's leading
      repeat axis) are never sharded.
    axes: the mesh axis, or axes, that split the dimension.
  """
  if fsdp == 1 or not shape:
    return P()
  if not isinstance(axes, str) and len(axes) == 1:
    axes = axes[0]
  dims = sorted(range(skip, len(shape)), key=lambda d: -shape[d])
  for d in dims:
    if shape[d] % fsdp == 0 and shape[d] >= fsdp:
      spec = [None] * len(shape)
      spec[d] = axes
      return P(*spec)
  return P()


def state_axes(mesh: Any, expert_weight: bool = False
               ) -> list[tuple[tuple[str, ...], int]]:
  """The axis groups a state leaf's one sharded dimension may span, best
  first: `fsdp`, `expert` and `context` together (`expert` only for a leaf
  that is not a routed expert weight, whose E takes it), then the group
  without its last axis, and so on; each as (axes, device count), axes of
  size 1 left out. Every device of the group holds a different slice, so
  `context` and `expert` devices hold no duplicate state (as MaxText
  shards its weights over its sequence and expert axes)."""
  sizes = dict(mesh.shape)
  names = [a for a in (FSDP_AXIS, EXPERT_AXIS, CONTEXT_AXIS)
           if sizes.get(a, 1) > 1 and not (expert_weight and a == EXPERT_AXIS)]
  return [(tuple(names[:n]), int(np.prod([sizes[a] for a in names[:n]])))
          for n in range(len(names), 0, -1)]


def _grouped_spec(make_spec, groups, unsharded: P) -> P:
  """The first `make_spec(axes, devices)` over `groups` that shards more
  than `unsharded` does; else `unsharded`."""
  for axes, n in groups:
    spec = make_spec(axes, n)
    if spec != unsharded:
      return spec
  return unsharded


def _stacked(path: tuple[Any, ...], prefix: str | None) -> bool:
  return prefix is not None and any(
      isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)
      and k.key.startswith(prefix) for k in path)


def is_expert_weight(path: tuple[Any, ...], shape: tuple[int, ...]
                     ) -> bool:
  """Whether a state leaf is a routed expert weight (or a moment of one):
  a `gate_proj`, `up_proj` or `down_proj` of a `.../moe` module, whose E
  dimension is the third from last (leading stacked axes allowed)."""
  keys = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
  return (len(shape) >= 3 and len(keys) >= 2 and keys[-1] in EXPERT_WEIGHTS
          and keys[-2].split("/")[-1] == "moe")


def expert_leaf_spec(shape: tuple[int, ...], fsdp: int, expert: int,
                     skip: int = 0,
                     axes: str | tuple[str, ...] = FSDP_AXIS) -> P:
  """A routed expert weight: E (third from last) over `expert`, and the
  largest other dimension that `fsdp` divides over `axes` (`leaf_spec`'s
  rule alone when `expert` is 1; the first `skip` dimensions never)."""
  if expert == 1:
    return leaf_spec(shape, fsdp, skip, axes)
  e_dim = len(shape) - 3
  rest = tuple(1 if d == e_dim else n for d, n in enumerate(shape))
  spec = list(leaf_spec(rest, fsdp, skip, axes)) + [None] * len(shape)
  spec[e_dim] = EXPERT_AXIS
  return P(*spec[:len(shape)])


def state_shardings(abstract_state: PyTree, mesh: jax.sharding.Mesh,
                    stacked_prefix: str | None = None) -> PyTree:
  """NamedShardings for a state: each array along its largest dimension
  that the group of `state_axes` divides (FSDP over `fsdp`, `expert` and
  `context`), routed experts' E over `expert` (`expert_leaf_spec`);
  replicated over `data`.

  Args:
    abstract_state: the state's arrays or `ShapeDtypeStruct`s.
    mesh: the mesh.
    stacked_prefix: module paths starting with it hold arrays stacked on a
      leading layer axis (`kda_lm.stack.SCAN_NAME + "/"`), which is never
      sharded: the scan slices it.
  """
  expert = dict(mesh.shape).get(EXPERT_AXIS, 1)
  dense_groups, expert_groups = state_axes(mesh), state_axes(mesh, True)

  def spec(path, a):
    shape, skip = tuple(a.shape), int(_stacked(path, stacked_prefix))
    if is_expert_weight(path, shape):
      return _grouped_spec(
          lambda axes, n: expert_leaf_spec(shape, n, expert, skip, axes),
          expert_groups, expert_leaf_spec(shape, 1, expert, skip))
    return _grouped_spec(lambda axes, n: leaf_spec(shape, n, skip, axes),
                         dense_groups, P())

  return jax.tree_util.tree_map_with_path(
      lambda path, a: jax.sharding.NamedSharding(mesh, spec(path, a)),
      abstract_state)


def with_shardings(abstract_state: PyTree, shardings: PyTree) -> PyTree:
  """`jax.ShapeDtypeStruct`s of `abstract_state` carrying `shardings`."""
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract_state, shardings)


def replicated(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(mesh, P())


def batch_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """[B,T] arrays: rows over `data`, `fsdp` and `expert`, tokens over
  `context`."""
  return jax.sharding.NamedSharding(mesh, P(ROW_AXES, CONTEXT_AXIS))


def row_devices(mesh: Any) -> int:
  """Devices the batch rows are split over (`data` x `fsdp` x `expert`)."""
  shape = dict(mesh.shape)
  return int(np.prod([shape.get(a, 1) for a in ROW_AXES]))


def check_batch_shape(mesh: Any, batch_size: int, seq_len: int,
                      micro_batches: int = 1, loss_chunks: int = 1) -> None:
  """Checks, before anything is traced, that batches of `batch_size` rows
  of `seq_len` tokens can be sharded over `mesh`, in `micro_batches`
  slices (`config.train.grad_accum_steps`), the loss in `loss_chunks`
  pieces of each row (`config.train.loss_chunks`).

  Raises:
    ValueError: the rows (of each micro-batch) do not divide over `data` x
      `fsdp` x `expert`, the tokens over `context`, or a row's tokens into
      `loss_chunks` pieces that divide over `context`.
  """
  rows = row_devices(mesh)
  if batch_size % (rows * micro_batches):
    what = f"{rows} data x fsdp x expert devices (config.mesh)"
    if micro_batches > 1:
      what += (f" times the {micro_batches} micro-batches "
               "(config.train.grad_accum_steps)")
    raise ValueError(f"config.data.batch_size {batch_size} is not a "
                     f"multiple of the {what}.")
  context = int(mesh.shape[CONTEXT_AXIS])
  if seq_len % context:
    raise ValueError(f"config.data.seq_len {seq_len} is not a multiple of "
                     f"config.mesh.context = {context}.")
  if seq_len % (loss_chunks * context):
    raise ValueError(f"config.data.seq_len {seq_len} is not a multiple of "
                     f"config.train.loss_chunks = {loss_chunks} times "
                     f"config.mesh.context = {context}.")


def global_batch(batch: Mapping[str, np.ndarray],
                 sharding: jax.sharding.NamedSharding
                 ) -> dict[str, jax.Array]:
  """This process's rows of a host batch as global sharded arrays (every
  feature of the batch; their names are `data.packing.FEATURES`)."""
  return {key: jax.make_array_from_process_local_data(sharding, value)
          for key, value in batch.items()}
