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


def leaf_spec(shape: tuple[int, ...], fsdp: int) -> P:
  """Shards the largest dimension that `fsdp` divides; else replicates."""
  if fsdp == 1 or not shape:
    return P()
  dims = sorted(range(len(shape)), key=lambda d: -shape[d])
  for d in dims:
    if shape[d] % fsdp == 0 and shape[d] >= fsdp:
      spec = [None] * len(shape)
      spec[d] = FSDP_AXIS
      return P(*spec)
  return P()


def state_shardings(abstract_state: PyTree, mesh: jax.sharding.Mesh
                    ) -> PyTree:
  """NamedShardings for a state: FSDP over `fsdp`, replicated over `data`
  and `context`."""
  fsdp = mesh.shape[FSDP_AXIS]
  return jax.tree.map(
      lambda a: jax.sharding.NamedSharding(
          mesh, leaf_spec(tuple(a.shape), fsdp)),
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


def check_batch_shape(mesh: Any, batch_size: int, seq_len: int) -> None:
  """Checks, before anything is traced, that batches of `batch_size` rows
  of `seq_len` tokens can be sharded over `mesh`.

  Raises:
    ValueError: the rows do not divide over `data` x `fsdp`, or the tokens
      over `context`.
  """
  rows = row_devices(mesh)
  if batch_size % rows:
    raise ValueError(f"config.data.batch_size {batch_size} is not a "
                     f"multiple of the {rows} data x fsdp devices "
                     f"(config.mesh).")
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
