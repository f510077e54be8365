"""Devices and sharding: the (`data`, `fsdp`, `context`) mesh, and the
shardings of the train state and of the batches.

The batch rows are sharded over `data` and `fsdp`, its tokens over `context`
(context parallelism, `kda_lm.parallel.context`); parameters and optimizer
state over `fsdp` only (each array along its largest dimension that `fsdp`
divides), so `fsdp=1` and `context=1` is plain data parallelism.
"""

from typing import Any, Mapping

import jax
import numpy as np

PyTree = Any
P = jax.sharding.PartitionSpec
DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
CONTEXT_AXIS = "context"
AXES = (DATA_AXIS, FSDP_AXIS, CONTEXT_AXIS)


def make_mesh(mesh_config: Any, devices: list[Any] | None = None
              ) -> jax.sharding.Mesh:
  """A (`data`, `fsdp`, `context`) mesh over all devices.

  Args:
    mesh_config: `config.mesh` (ConfigDict or `kda_lm.config.MeshConfig`);
      `data = -1` takes the devices `fsdp` and `context` leave; a config
      without `context` means 1.
    devices: default `jax.devices()` (all processes).

  Returns:
    The mesh.

  Raises:
    ValueError: the axis sizes do not multiply to the device count.
  """
  devices = list(jax.devices() if devices is None else devices)
  fsdp = int(mesh_config.fsdp)
  data = int(mesh_config.data)
  context = int(getattr(mesh_config, "context", 1))
  if fsdp < 1 or context < 1 or (data < 1 and data != -1):
    raise ValueError(f"config.mesh.fsdp and config.mesh.context must be >= 1 "
                     f"and config.mesh.data >= 1 or -1, got {fsdp}, "
                     f"{context}, {data}.")
  if data == -1:
    data = len(devices) // (fsdp * context)
  if data * fsdp * context != len(devices):
    raise ValueError(f"config.mesh data={data} x fsdp={fsdp} x "
                     f"context={context} does not match the {len(devices)} "
                     "devices.")
  auto = jax.sharding.AxisType.Auto
  return jax.make_mesh((data, fsdp, context),
                       (DATA_AXIS, FSDP_AXIS, CONTEXT_AXIS),
                       axis_types=(auto,) * 3, devices=devices)


def leaf_spec(shape: tuple[int, ...], fsdp: int, skip: int = 0) -> P:
  """Shards the largest dimension that `fsdp` divides; else replicates.

  The first `skip` dimensions (a scanned layer group's leading repeat
  axis) are never sharded.
  """
  if fsdp == 1 or not shape:
    return P()
  dims = sorted(range(skip, len(shape)), key=lambda d: -shape[d])
  for d in dims:
    if shape[d] % fsdp == 0 and shape[d] >= fsdp:
      spec = [None] * len(shape)
      spec[d] = FSDP_AXIS
      return P(*spec)
  return P()


def _stacked(path: tuple[Any, ...], prefix: str | None) -> bool:
  return prefix is not None and any(
      isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)
      and k.key.startswith(prefix) for k in path)


def state_shardings(abstract_state: PyTree, mesh: jax.sharding.Mesh,
                    stacked_prefix: str | None = None) -> PyTree:
  """NamedShardings for a state: FSDP over `fsdp`, replicated over `data`
  and `context`.

  Args:
    abstract_state: the state's arrays or `ShapeDtypeStruct`s.
    mesh: the mesh.
    stacked_prefix: module paths starting with it hold arrays stacked on a
      leading layer axis (`kda_lm.stack.SCAN_NAME + "/"`), which is never
      sharded: the scan slices it.
  """
  fsdp = mesh.shape[FSDP_AXIS]
  return jax.tree_util.tree_map_with_path(
      lambda path, a: jax.sharding.NamedSharding(
          mesh, leaf_spec(tuple(a.shape), fsdp,
                          int(_stacked(path, stacked_prefix)))),
      abstract_state)


def with_shardings(abstract_state: PyTree, shardings: PyTree) -> PyTree:
  """`jax.ShapeDtypeStruct`s of `abstract_state` carrying `shardings`."""
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract_state, shardings)


def replicated(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(mesh, P())


def batch_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """[B,T] arrays: rows over `data` and `fsdp`, tokens over `context`."""
  return jax.sharding.NamedSharding(mesh, P((DATA_AXIS, FSDP_AXIS),
                                            CONTEXT_AXIS))


def row_devices(mesh: Any) -> int:
  """Devices the batch rows are split over (`data` x `fsdp`)."""
  return int(mesh.shape[DATA_AXIS] * mesh.shape[FSDP_AXIS])


def check_batch_shape(mesh: Any, batch_size: int, seq_len: int,
                      micro_batches: int = 1) -> None:
  """Checks, before anything is traced, that batches of `batch_size` rows
  of `seq_len` tokens can be sharded over `mesh`, in `micro_batches`
  slices (`config.train.grad_accum_steps`).

  Raises:
    ValueError: the rows (of each micro-batch) do not divide over `data` x
      `fsdp`, or the tokens over `context`.
  """
  rows = row_devices(mesh)
  if batch_size % (rows * micro_batches):
    what = (f"{rows} data x fsdp devices (config.mesh)" if micro_batches == 1
            else f"{rows} data x fsdp devices (config.mesh) times the "
            f"{micro_batches} micro-batches (config.train.grad_accum_steps)")
    raise ValueError(f"config.data.batch_size {batch_size} is not a "
                     f"multiple of the {what}.")
  context = int(mesh.shape[CONTEXT_AXIS])
  if seq_len % context:
    raise ValueError(f"config.data.seq_len {seq_len} is not a multiple of "
                     f"config.mesh.context = {context}.")


def global_batch(batch: Mapping[str, np.ndarray],
                 sharding: jax.sharding.NamedSharding
                 ) -> dict[str, jax.Array]:
  """This process's rows of a host batch as global sharded arrays (every
  feature of the batch; their names are `data.packing.FEATURES`)."""
  return {key: jax.make_array_from_process_local_data(sharding, value)
          for key, value in batch.items()}
