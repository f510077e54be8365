"""Devices and sharding: multi-host start-up, the (`data`, `fsdp`) mesh, and
the shardings of the train state and of the batches.

The batch is sharded over both mesh axes, parameters and optimizer state over
`fsdp` only (each array along its largest dimension that `fsdp` divides), so
`fsdp=1` is plain data parallelism.
"""

from typing import Any, Mapping

import jax
import numpy as np

PyTree = Any
P = jax.sharding.PartitionSpec
DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def make_mesh(mesh_config: Any, devices: list[Any] | None = None
              ) -> jax.sharding.Mesh:
  """A (`data`, `fsdp`) mesh over all devices.

  Args:
    mesh_config: `config.mesh` (ConfigDict or `kda_lm.config.MeshConfig`);
      `data = -1` takes the devices `fsdp` leaves.
    devices: default `jax.devices()` (all processes).

  Returns:
    The mesh.

  Raises:
    ValueError: the axis sizes do not multiply to the device count.
  """
  devices = list(jax.devices() if devices is None else devices)
  fsdp = int(mesh_config.fsdp)
  data = int(mesh_config.data)
  if fsdp < 1 or (data < 1 and data != -1):
    raise ValueError(f"config.mesh.fsdp must be >= 1 and config.mesh.data "
                     f">= 1 or -1, got {fsdp}, {data}.")
  if data == -1:
    data = len(devices) // fsdp
  if data * fsdp != len(devices):
    raise ValueError(f"config.mesh data={data} x fsdp={fsdp} does not match "
                     f"the {len(devices)} devices.")
  auto = jax.sharding.AxisType.Auto
  return jax.make_mesh((data, fsdp), (DATA_AXIS, FSDP_AXIS),
                       axis_types=(auto, auto), devices=devices)


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
  """NamedShardings for a state: FSDP over `fsdp`, replicated over `data`."""
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
  """Rows sharded over all devices (`data` and `fsdp` axes)."""
  return jax.sharding.NamedSharding(mesh, P((DATA_AXIS, FSDP_AXIS)))


def global_batch(batch: Mapping[str, np.ndarray],
                 sharding: jax.sharding.NamedSharding
                 ) -> dict[str, jax.Array]:
  """This process's rows of a host batch as global sharded arrays."""
  return {key: jax.make_array_from_process_local_data(sharding, batch[key])
          for key in BATCH_KEYS}
