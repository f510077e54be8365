"""Tests of kda_lm/parallel/maps.py: the mesh queries, the batch-shape
check and the per-device maps, in one process.

The maps are traced under abstract meshes of any size (no devices are
needed to trace `jax.shard_map`): the shard shapes a function receives,
the global shapes it returns and the refusals. Their values are checked
on a one-device mesh, and the expert exchange's under `jax.vmap` with the
`expert` axis name (one shard per vmapped index). The values on several
devices are the model's tests' (`mesh_test.py`, `layers_moe_test.py`:
fake CPU devices in a subprocess, minutes of compiling).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_lm.parallel import maps, sharding

AUTO = jax.sharding.AxisType.Auto
P = jax.sharding.PartitionSpec
F32 = jnp.float32


def mesh_of(**sizes):
  """An abstract mesh with these axes, in this order."""
  return jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes),
                                   axis_types=(AUTO,) * len(sizes))


def full_mesh(data=2, fsdp=3, expert=5, context=2):
  return mesh_of(data=data, fsdp=fsdp, expert=expert, context=context)


def spec(*shape):
  return jax.ShapeDtypeStruct(shape, F32)


def test_outside_a_mesh_nothing_is_sharded():
  assert maps.ambient_mesh() is None
  assert not maps.under_mesh()
  assert maps.context_size() == 1
  assert maps.expert_size() == 1
  assert maps.check_shape(3, 7, "x") == 1
  x, w = np.arange(6.0).reshape(1, 2, 3), np.array([1.0, 2.0, 4.0])
  calls = []

  def fn(*args):
    calls.append(len(args))
    return args[0] * args[1] - args[2]

  got = maps.token_map(fn, [x, w], [np.float32(1.0)])
  np.testing.assert_array_equal(got, x * w - 1.0)

  def summed(*args):
    calls.append(len(args))
    return args[0].sum() - args[1], args[0] * 2

  total, per_token = maps.row_sum_map(summed, [x], [np.float32(1.0)])
  assert total == 14.0
  np.testing.assert_array_equal(per_token, x * 2)
  assert calls == [3, 2]


def test_mesh_queries_under_an_abstract_mesh():
  mesh = full_mesh()
  with jax.sharding.use_abstract_mesh(mesh):
    assert maps.ambient_mesh() == mesh
    assert maps.under_mesh()
    assert maps.context_size() == 2
    assert maps.expert_size() == 5
    assert maps.row_axes() == ("data", "fsdp", "expert", "context")
  assert maps.batch_axes(mesh) == ("data", "fsdp", "expert")
  assert maps.token_axes(mesh) == ("context",)
  assert maps.row_spec(mesh) == P(("data", "fsdp", "expert"), "context")


def test_mesh_queries_on_meshes_without_some_axes():
  """The row axes in their fixed order whatever the mesh's; a missing
  `context` or `expert` axis counts as size 1."""
  no_tokens = mesh_of(expert=4, data=3)
  with jax.sharding.use_abstract_mesh(no_tokens):
    assert maps.context_size() == 1
    assert maps.expert_size() == 4
    assert maps.row_axes() == ("data", "expert")
  assert maps.token_axes(no_tokens) == ()
  assert maps.row_spec(no_tokens) == P(("data", "expert"), None)
  only_tokens = mesh_of(context=3)
  with jax.sharding.use_abstract_mesh(only_tokens):
    assert maps.context_size() == 3
    assert maps.expert_size() == 1
    assert maps.row_axes() == ("context",)
  assert maps.batch_axes(only_tokens) == ()
  assert maps.row_spec(only_tokens) == P(None, "context")
  with jax.sharding.use_abstract_mesh(mesh_of(fsdp=2)):
    assert maps.context_size() == 1 and maps.expert_size() == 1


def test_under_a_concrete_mesh_the_mesh_is_ambient():
  mesh = jax.make_mesh((1, 1), ("data", "context"), axis_types=(AUTO,) * 2)
  with jax.set_mesh(mesh):
    assert maps.under_mesh()
    assert maps.ambient_mesh() == mesh.abstract_mesh
    assert maps.context_size() == 1
  assert not maps.under_mesh()


def test_check_shape_accepts_multiples_and_returns_the_context_size():
  with jax.sharding.use_abstract_mesh(full_mesh()):
    # Rows over data x fsdp x expert = 30 devices, tokens over 2.
    for B, T in ((30, 2), (60, 8)):
      assert maps.check_shape(B, T, "x") == 2
  with jax.sharding.use_abstract_mesh(full_mesh(context=3)):
    assert maps.check_shape(30, 9, "x") == 3
  with jax.sharding.use_abstract_mesh(mesh_of(context=4)):
    assert maps.check_shape(1, 4, "x") == 4


@pytest.mark.parametrize("mesh,B,T,message", [
    (full_mesh(), 10, 2,
     "Op on the device mesh: B = 10 rows is not a multiple of the 30 data "
     "x fsdp x expert devices."),
    (full_mesh(), 15, 4,
     "Op on the device mesh: B = 15 rows is not a multiple of the 30 data "
     "x fsdp x expert devices."),
    (full_mesh(), 30, 3,
     "Op under context parallelism: T = 3 tokens per row is not a "
     "multiple of mesh.context = 2."),
    (mesh_of(context=4), 1, 6,
     "Op under context parallelism: T = 6 tokens per row is not a "
     "multiple of mesh.context = 4."),
    (mesh_of(fsdp=4, context=1), 6, 5,
     "Op on the device mesh: B = 6 rows is not a multiple of the 4 data x "
     "fsdp x expert devices."),
])
def test_check_shape_refuses_what_does_not_divide(mesh, B, T, message):
  with jax.sharding.use_abstract_mesh(mesh):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
      maps.check_shape(B, T, "Op")


def test_check_shape_refuses_unknown_axes_and_other_axis_types():
  unknown = mesh_of(pipe=2, data=1, stage=2)
  with jax.sharding.use_abstract_mesh(unknown):
    with pytest.raises(ValueError, match=re.escape(
        "Op: the mesh axis 'pipe' is none of ('data', 'fsdp', 'expert', "
        "'context'); the model cannot shard over it.")):
      maps.check_shape(4, 4, "Op")
  explicit = jax.sharding.AxisType.Explicit
  mixed = jax.sharding.AbstractMesh((2, 2), ("data", "fsdp"),
                                    axis_types=(AUTO, explicit))
  with jax.sharding.use_abstract_mesh(mixed):
    with pytest.raises(ValueError, match=r"^Op on a device mesh needs Auto "
                       r"axes \(`sharding.make_mesh`\), got "):
      maps.check_shape(4, 4, "Op")


def _trace(f, *args, mesh):
  """f's global output shapes under `mesh`."""
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.eval_shape(f, *args)


def test_token_map_gives_each_shard_its_rows_and_tokens():
  """Rows over data x fsdp x expert, tokens over context, parameters whole;
  the shards' outputs put back in place."""
  seen = []

  def fn(x, y, w):
    seen.append((x.shape, y.shape, w.shape))
    return x * w + y[..., :1]

  out = _trace(lambda x, y, w: maps.token_map(fn, [x, y], [w]),
               spec(60, 8, 3), spec(60, 8, 2), spec(3),
               mesh=full_mesh())
  assert seen == [((2, 4, 3), (2, 4, 2), (3,))]
  assert out.shape == (60, 8, 3)
  seen.clear()
  _trace(lambda x, w: maps.token_map(fn, [x, x], [w]), spec(4, 6, 3),
         spec(3), mesh=mesh_of(fsdp=2, context=3))
  assert seen == [((2, 2, 3), (2, 2, 3), (3,))]


def test_token_map_refuses_rows_that_do_not_divide():
  with pytest.raises(ValueError, match="^A token-wise layer on the device "
                     "mesh: B = 10 rows"):
    _trace(lambda x: maps.token_map(lambda a: a, [x], []), spec(10, 2, 4),
           mesh=full_mesh())
  with pytest.raises(ValueError, match="^A token-wise layer under context "
                     "parallelism: T = 3 tokens"):
    _trace(lambda x: maps.token_map(lambda a: a, [x], []), spec(30, 3, 4),
           mesh=full_mesh())


def _varying(x):
  """The mesh axes a traced value varies over inside `shard_map` (none
  where the varying-axes check is off)."""
  return set(jax.typeof(x).manual_axis_type.varying)


def test_maps_check_varying_axes_unless_told_not_to():
  """`shard_map`'s varying-axes check (its types), on by default, off for
  Pallas calls: the shard's rows are typed as varying over the row axes
  only where it is on."""
  x, w, experts = spec(4, 2, 3), spec(3), spec(4, 3)
  mesh = mesh_of(data=2, expert=2)
  seen = []

  def fn(a, b):
    seen.append((_varying(a), _varying(b)))
    return a

  rows = {"data", "expert"}
  for check_vma in (True, False):
    kwargs = {} if check_vma else {"check_vma": check_vma}
    _trace(lambda a, b, kw=kwargs: maps.token_map(fn, [a], [b], **kw), x, w,
           mesh=mesh)
    _trace(lambda a, b, kw=kwargs: maps.sharded(
        fn, (P(("data", "expert")), P()), P(("data", "expert")), **kw)(
            a, b), x, w, mesh=mesh)
    _trace(lambda a, e, kw=kwargs: maps.expert_map(fn, [a], [e], **kw), x,
           experts, mesh=mesh)
    if check_vma:
      assert seen == [(rows, set()), (rows, set()), (rows, {"expert"})]
    else:
      assert seen == [(set(), set())] * 3
    seen.clear()


def test_row_sum_map_sums_over_devices_and_keeps_tokens_in_place():
  """Each shard's `summed` (a tree, here also a constant: the varying-axes
  check is off) comes back added over the devices in its own shape."""
  seen = []

  def fn(x, w):
    seen.append((x.shape, w.shape))
    summed = {"dot": (x * w).sum((0, 1)), "count": jnp.float32(1.0),
              "grid": jnp.ones((2, 5))}
    return summed, x[..., 0]

  summed, per_token = _trace(
      lambda x, w: maps.row_sum_map(fn, [x], [w]), spec(60, 8, 3),
      spec(3), mesh=full_mesh())
  assert seen == [((2, 4, 3), (3,))]
  assert summed["dot"].shape == (3,)
  assert summed["count"].shape == ()
  assert summed["grid"].shape == (2, 5)
  assert per_token.shape == (60, 8)


def test_row_sum_map_takes_accumulators_that_start_as_constants():
  """`fn` may sum its rows in a loop whose carry starts as zeros (the
  chunked LM head does): `shard_map`'s varying-axes check, which would
  refuse that carry, is off."""
  seen = []

  def fn(x, w):
    seen.append(_varying(x))

    def chunk(i, total):
      return total + (x[:, i] @ w).sum(0)

    return jax.lax.fori_loop(0, x.shape[1], chunk, jnp.zeros(w.shape[1])), x

  summed, per_token = _trace(
      lambda x, w: maps.row_sum_map(fn, [x], [w]), spec(60, 8, 3),
      spec(3, 5), mesh=full_mesh())
  assert summed.shape == (5,) and per_token.shape == (60, 8, 3)
  assert seen == [set()]


def test_row_sum_map_refuses_rows_that_do_not_divide():
  def fn(x):
    return x.sum(), x

  with pytest.raises(ValueError, match="^The LM head and loss on the "
                     "device mesh: B = 15 rows"):
    _trace(lambda x: maps.row_sum_map(fn, [x], []), spec(15, 4, 1),
           mesh=full_mesh())


def test_maps_on_a_one_device_mesh_give_the_plain_values():
  mesh = jax.make_mesh((1,) * 4, sharding.AXES, axis_types=(AUTO,) * 4)
  x = jnp.arange(24.0).reshape(2, 4, 3)
  w = jnp.array([1.0, -2.0, 0.5])
  experts = jnp.arange(12.0).reshape(2, 2, 3)

  def summed_fn(a, b):
    return {"dot": (a * b).sum((0, 1)), "count": jnp.float32(1.0)}, a - b

  def expert_fn(a, e):
    return a * e.sum((0, 1))

  with jax.set_mesh(mesh):
    token = jax.jit(lambda a, b: maps.token_map(
        lambda u, v, c: u * c - v, [a, a + 1], [b]))(x, w)
    summed, per_token = jax.jit(lambda a, b: maps.row_sum_map(
        summed_fn, [a], [b]))(x, w)
    routed = jax.jit(lambda a, e: maps.expert_map(expert_fn, [a], [e]))(
        x, experts)
  np.testing.assert_array_equal(token, x * w - (x + 1))
  np.testing.assert_array_equal(summed["dot"], (x * w).sum((0, 1)))
  assert summed["count"] == 1.0
  np.testing.assert_array_equal(per_token, x - w)
  np.testing.assert_array_equal(routed, x * experts.sum((0, 1)))


def test_expert_map_splits_the_experts_over_the_expert_axis():
  """Each shard: its rows and tokens, E/n of each expert array (whatever
  their other dimensions), the same output shape back."""
  seen = []

  def fn(x, e, f):
    seen.append((x.shape, e.shape, f.shape))
    return x * e.sum() + f.sum()

  mesh = mesh_of(data=2, expert=2, context=2)
  out = _trace(lambda x, e, f: maps.expert_map(fn, [x], [e, f]),
               spec(8, 6, 3), spec(4, 3, 5), spec(4, 7), mesh=mesh)
  assert seen == [((2, 3, 3), (2, 3, 5), (2, 7))]
  assert out.shape == (8, 6, 3)
  seen.clear()
  _trace(lambda x, e: maps.expert_map(lambda a, b: a * b.sum(), [x], [e]),
         spec(6, 6, 3), spec(6, 4), mesh=mesh_of(expert=3))

  def two_and_two(x, y, e, f):
    seen.append((x.shape, y.shape, e.shape, f.shape))
    return x + y

  _trace(lambda x, e: maps.expert_map(two_and_two, [x, x], [e, e]),
         spec(4, 2, 3), spec(2, 5, 4), mesh=mesh_of(expert=2))
  assert seen == [((2, 2, 3), (2, 2, 3), (1, 5, 4), (1, 5, 4))]


def test_expert_map_refuses_experts_or_rows_that_do_not_divide():
  def fn(x, e):
    return x

  with pytest.raises(ValueError, match="num_experts = 5 is not a multiple "
                     "of config.mesh.expert = 2"):
    _trace(lambda x, e: maps.expert_map(fn, [x], [e]), spec(4, 2, 3),
           spec(5, 4, 4), mesh=mesh_of(expert=2))
  with pytest.raises(ValueError, match="^The expert-parallel MoE on the "
                     "device mesh: B = 3 rows"):
    _trace(lambda x, e: maps.expert_map(fn, [x], [e]), spec(3, 2, 3),
           spec(4, 4, 4), mesh=mesh_of(expert=2))


def test_expert_exchange_sends_slice_j_to_shard_j():
  """Under vmap over the `expert` axis: shard s receives from shard j its
  slice s, and a second exchange sends every slice back."""
  n, k = 3, 2
  x = jnp.arange(n * n * k, dtype=F32).reshape(n, n, k)   # [shard, j, k]
  exchange = jax.vmap(maps.expert_exchange, axis_name=maps.EXPERT_AXIS)
  got = np.asarray(exchange(x))
  np.testing.assert_array_equal(got, np.asarray(x).transpose(1, 0, 2))
  np.testing.assert_array_equal(exchange(exchange(x)), x)


def test_ragged_exchange_only_where_the_backend_runs_it(monkeypatch):
  assert not maps.ragged_exchange_supported()
  for name in ("tpu", "gpu", "cpu"):
    fresh = "".join(name)   # A string built at run time, not interned.
    monkeypatch.setattr(jax, "default_backend", lambda s=fresh: s)
    assert maps.ragged_exchange_supported() == (name != "cpu"), name
