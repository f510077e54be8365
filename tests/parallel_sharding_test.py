"""Tests of kda_lm/parallel/sharding.py: the mesh and the FSDP shardings."""

import collections

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
                              "expert": 1, "context": 1}
  assert sharding.batch_sharding(mesh).spec == jax.sharding.PartitionSpec(
      ("data", "fsdp", "expert"), "context")
  with pytest.raises(ValueError, match="does not match"):
    sharding.make_mesh(ml_collections.ConfigDict(
        dict(data=jax.device_count() + 1, fsdp=1)))
  with pytest.raises(ValueError, match="does not match"):
    sharding.make_mesh(ml_collections.ConfigDict(
        dict(data=1, fsdp=1, context=jax.device_count() + 1)))
  with pytest.raises(ValueError, match="expert=2 x context=1 does not "
                     "match"):
    sharding.make_mesh(ml_collections.ConfigDict(
        dict(data=jax.device_count(), fsdp=1, expert=2)))
  for bad in (dict(fsdp=0), dict(fsdp=1, context=0), dict(fsdp=1, expert=0)):
    with pytest.raises(ValueError, match="must be >= 1"):
      sharding.make_mesh(ml_collections.ConfigDict(dict(data=-1, **bad)))


def _abstract_mesh(fsdp, expert, context=1, data=1):
  return jax.sharding.AbstractMesh(
      (data, fsdp, expert, context), sharding.AXES,
      axis_types=(jax.sharding.AxisType.Auto,) * 4)


def test_routed_experts_split_over_the_expert_axis():
  """E over `expert` for the routed experts' weights and their optimizer
  moments (also under a leading stacked axis); fsdp on their largest other
  dimension; every other parameter by `leaf_spec` alone."""
  P = jax.sharding.PartitionSpec
  params = {"layer_1/moe": {"gate_proj": np.zeros((8, 4, 6)),
                            "down_proj": np.zeros((8, 6, 4)),
                            "router": np.zeros((4, 8))},
            "layer_1/moe/shared_experts/gate_proj": {"w": np.zeros((4, 6))},
            "stack/moe": {"up_proj": np.zeros((3, 8, 4, 6))},
            "layer_0/mlp/gate_proj": {"w": np.zeros((8, 4, 6))}}
  state = {"params": params, "mu": params}
  abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, np.float32), state)
  specs = jax.tree.map(lambda s: s.spec, sharding.state_shardings(
      abstract, _abstract_mesh(2, 4)))
  fsdp_expert = ("fsdp", "expert")
  for tree in (specs["params"], specs["mu"]):
    assert tree["layer_1/moe"]["gate_proj"] == P("expert", None, "fsdp")
    assert tree["layer_1/moe"]["down_proj"] == P("expert", "fsdp", None)
    assert tree["stack/moe"]["up_proj"] == P(None, "expert", None, "fsdp")
    # Every other leaf over fsdp and expert together (8 devices) ...
    assert tree["layer_1/moe"]["router"] == P(None, fsdp_expert)
    assert tree["layer_0/mlp/gate_proj"]["w"] == P(fsdp_expert, None, None)
    # ... or over fsdp alone where no dimension divides by 8.
    assert tree["layer_1/moe/shared_experts/gate_proj"]["w"] == P(
        None, "fsdp")
  # expert = 1: the FSDP rule alone, as before the expert axis existed.
  specs = sharding.state_shardings(abstract, _abstract_mesh(2, 1))
  assert specs["params"]["layer_1/moe"]["gate_proj"].spec == P(
      "fsdp", None, None)
  assert sharding.expert_leaf_spec((8, 4, 6), 1, 2) == P(
      "expert", None, None)


def test_state_splits_over_fsdp_expert_and_context():
  """No device but a `data` replica holds a duplicate of the state: each
  leaf's sharded dimension spans fsdp, expert and context, falling back
  to fewer axes (in that order) where the dimension does not divide."""
  P = jax.sharding.PartitionSpec
  params = {"layer_1/moe": {"gate_proj": np.zeros((8, 16, 6))},
            "embed": {"embeddings": np.zeros((32, 4))},
            "norm": {"scale": np.zeros((6,))},
            "odd": {"w": np.zeros((5, 3))}}
  abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, np.float32), params)
  mesh = _abstract_mesh(2, 2, context=4)
  specs = jax.tree.map(lambda s: s.spec,
                       sharding.state_shardings(abstract, mesh))
  assert sharding.state_axes(mesh) == [
      (("fsdp", "expert", "context"), 16), (("fsdp", "expert"), 4),
      (("fsdp",), 2)]
  assert specs["embed"]["embeddings"] == P(("fsdp", "expert", "context"),
                                           None)
  assert specs["layer_1/moe"]["gate_proj"] == P("expert",
                                                ("fsdp", "context"), None)
  assert specs["norm"]["scale"] == P("fsdp")
  assert specs["odd"]["w"] == P()
  # Context parallelism alone: the state splits over context.
  specs = sharding.state_shardings(abstract, _abstract_mesh(1, 1, 4))
  assert specs["embed"]["embeddings"].spec == P("context", None)
  assert sharding.state_axes(_abstract_mesh(1, 1)) == []


def test_check_expert_axis():
  sharding.check_expert_axis(1, 0)
  sharding.check_expert_axis(4, 8)
  sharding.check_expert_axis(2, 8)
  with pytest.raises(ValueError, match="num_experts = 8 is not a multiple "
                     "of config.mesh.expert = 3"):
    sharding.check_expert_axis(3, 8)
  with pytest.raises(ValueError, match="the model has none"):
    sharding.check_expert_axis(2, 0)


def _mesh_config(**sizes):
  return ml_collections.ConfigDict(sizes)


def test_mesh_shape_fills_data_with_the_devices_left():
  shape = sharding.mesh_shape
  assert shape(_mesh_config(data=-1, fsdp=2, expert=3, context=5), 60) == (
      2, 2, 3, 5)
  assert shape(_mesh_config(data=-1, fsdp=4), 8) == (2, 4, 1, 1)
  assert shape(_mesh_config(data=4, fsdp=2), 8) == (4, 2, 1, 1)
  assert shape(_mesh_config(data=1, fsdp=1, expert=2, context=4), 8) == (
      1, 1, 2, 4)
  assert shape(_mesh_config(data=-1, fsdp=2), 1024) == (512, 2, 1, 1)
  for sizes, n in ((dict(data=3, fsdp=2), 8), (dict(data=-1, fsdp=3), 8),
                   (dict(data=2, fsdp=2, context=3), 8)):
    with pytest.raises(ValueError, match=f"does not match the {n} devices"):
      shape(_mesh_config(**sizes), n)
  for sizes in (dict(data=0, fsdp=1), dict(data=-2, fsdp=1),
                dict(data=-1, fsdp=1, expert=0)):
    with pytest.raises(ValueError, match="must be >= 1"):
      shape(_mesh_config(**sizes), 8)


def test_batch_checked_against_the_mesh_before_tracing():
  """Rows over data x fsdp x expert (times the micro-batches), tokens over
  context, each row's loss pieces over context: multiples pass, anything
  else is refused naming the numbers."""
  check = sharding.check_batch_shape
  rows = _abstract_mesh(fsdp=2, expert=2, data=2)   # 8 row devices
  for batch_size, micro_batches in ((8, 1), (16, 2), (24, 3), (40, 5)):
    check(rows, batch_size, 128, micro_batches=micro_batches)
  with pytest.raises(ValueError, match="config.data.batch_size 12 is not a "
                     "multiple of the 8 data x fsdp x expert devices "
                     r"\(config.mesh\)\.$"):
    check(rows, 12, 128)
  for batch_size in (8, 20):
    with pytest.raises(ValueError, match=f"batch_size {batch_size} is not a "
                       "multiple of the 8 data x fsdp x expert devices "
                       r"\(config.mesh\) times the 2 micro-batches"):
      check(rows, batch_size, 128, micro_batches=2)
  tokens = _abstract_mesh(fsdp=1, expert=1, context=4)
  check(tokens, 4, 128)
  check(tokens, 4, 12)                 # One loss piece by default.
  check(tokens, 4, 128, loss_chunks=8)
  check(tokens, 4, 96, loss_chunks=3)
  check(tokens, 4, 24, loss_chunks=3)
  with pytest.raises(ValueError, match="config.data.seq_len 18 is not a "
                     "multiple of config.mesh.context = 4"):
    check(tokens, 4, 18)
  for seq_len, loss_chunks in ((128, 64), (136, 4)):
    with pytest.raises(ValueError, match=f"seq_len {seq_len} is not a "
                       f"multiple of config.train.loss_chunks = "
                       f"{loss_chunks} times config.mesh.context = 4"):
      check(tokens, 4, seq_len, loss_chunks=loss_chunks)


def _keys(*names):
  return tuple(jax.tree_util.DictKey(name) for name in names)


def test_routed_expert_weights_are_named_by_their_module_and_rank():
  """A `gate_proj`, `up_proj` or `down_proj` array of rank >= 3 directly
  in a module whose last name part is `moe`; nothing else."""
  is_expert = sharding.is_expert_weight
  assert is_expert(_keys("layer_1/moe", "gate_proj"), (8, 4, 6))
  assert is_expert(_keys("group/layer_1/moe", "down_proj"), (2, 8, 6, 4))
  assert not is_expert(_keys("layer_1/moe", "gate_proj"), (4, 6))
  assert not is_expert(_keys("gate_proj"), (8, 4, 6))
  for module in ("layer_1/router", "layer_1/mlp", "moe/layer_1"):
    assert not is_expert(_keys(module, "up_proj"), (8, 4, 6)), module


def test_meshes_without_some_axes_and_stacked_named_tuples():
  """A mesh lacking `expert` (or `context`) counts it as 1; a NamedTuple
  state's stacked leaves keep their leading axis whole; an expert weight
  on an expert-only mesh shards E alone."""
  P = jax.sharding.PartitionSpec
  two_axes = jax.sharding.AbstractMesh(
      (2, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  assert sharding.row_devices(two_axes) == 4
  state = collections.namedtuple("State", "params step")(
      {"stack/layer/moe": {"gate_proj": jax.ShapeDtypeStruct((8, 4, 6, 2),
                                                            np.float32)},
       "layer_1/moe": {"up_proj": jax.ShapeDtypeStruct((8, 4, 6),
                                                       np.float32)}},
      jax.ShapeDtypeStruct((), np.int32))
  specs = jax.tree.map(lambda s: s.spec, sharding.state_shardings(
      state, two_axes, stacked_prefix="stack/"))
  assert specs.params["stack/layer/moe"]["gate_proj"] == P(
      None, None, "fsdp", None)
  assert specs.params["layer_1/moe"]["up_proj"] == P("fsdp", None, None)
  assert specs.step == P()
  specs = jax.tree.map(lambda s: s.spec, sharding.state_shardings(
      state, _abstract_mesh(fsdp=1, expert=2)))
  assert specs.params["layer_1/moe"]["up_proj"] == P("expert", None, None)
  # E over expert; the largest other dimension, the leading one unless
  # it is skipped, over fsdp.
  assert sharding.expert_leaf_spec((6, 8, 4, 2), 2, 2) == P(
      "fsdp", "expert", None, None)
  assert sharding.expert_leaf_spec((6, 8, 4, 2), 2, 2, skip=1) == P(
      None, "expert", "fsdp", None)
