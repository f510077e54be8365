"""Tests of kda_lm/parallel/sharding.py: the mesh and the FSDP shardings."""

import jax
import ml_collections
import numpy as np
import pytest

from kda_lm.parallel import sharding


def test_fsdp_shardings():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1),
                           ("data", "fsdp"))
  abstract = {"w": jax.ShapeDtypeStruct((8, 6), np.float32),
              "s": jax.ShapeDtypeStruct((), np.int32)}
  shardings = sharding.state_shardings(abstract, mesh)
  assert shardings["w"].spec == jax.sharding.PartitionSpec()
  assert sharding.leaf_spec((8, 6), 2) == jax.sharding.PartitionSpec(
      "fsdp", None)
  assert sharding.leaf_spec((3, 6), 2) == jax.sharding.PartitionSpec(
      None, "fsdp")
  assert sharding.leaf_spec((3, 5), 2) == jax.sharding.PartitionSpec()


def test_make_mesh_sizes_and_errors():
  mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(data=-1, fsdp=1)))
  assert dict(mesh.shape) == {"data": jax.device_count(), "fsdp": 1,
                              "context": 1}
  assert sharding.batch_sharding(mesh).spec == jax.sharding.PartitionSpec(
      ("data", "fsdp"), "context")
  with pytest.raises(ValueError, match="does not match"):
    sharding.make_mesh(ml_collections.ConfigDict(
        dict(data=jax.device_count() + 1, fsdp=1)))
  with pytest.raises(ValueError, match="does not match"):
    sharding.make_mesh(ml_collections.ConfigDict(
        dict(data=1, fsdp=1, context=jax.device_count() + 1)))
  for bad in (dict(fsdp=0), dict(fsdp=1, context=0)):
    with pytest.raises(ValueError, match="must be >= 1"):
      sharding.make_mesh(ml_collections.ConfigDict(dict(data=-1, **bad)))
