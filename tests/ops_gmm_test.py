"""Tests of kda_lm/ops/gmm.py: the grouped matmul against `ragged_dot`.

Both fast paths ("xla", the tile loop; "megablox", JAX's TPU kernels in
interpret mode) are held to `jax.lax.ragged_dot` (float32): outputs and
both gradients within 1e-6 relative, on groups that are empty, that hold
every row, that end inside a tile, and with rows past the last group.
"""

import re

import helpers
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from kda_lm.ops import gmm
from testbed import numerics

pytestmark = pytest.mark.usefixtures("fast_compile")
TOL = 1e-6


def _case(sizes, K=16, N=24, M=None, seed=0):
  rng = np.random.default_rng(seed)
  sizes = np.asarray(sizes, np.int32)
  M = int(sizes.sum()) if M is None else M
  lhs = rng.standard_normal((M, K)).astype(np.float32)
  rhs = rng.standard_normal((len(sizes), K, N)).astype(np.float32)
  dout = rng.standard_normal((M, N)).astype(np.float32)
  return jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), dout


CASES = {
    "uneven": ([5, 0, 17, 1, 9, 0, 32], None, 8),   # empty groups, tm 8
    "one_group": ([0, 0, 40, 0], None, 16),          # every row in one
    "past_groups": ([3, 4, 5], 20, 8),               # 8 rows past them
    "single_tile": ([2, 3, 1], None, None),          # default tile
    "odd_tile": ([7, 20, 5], None, 12),              # tm not a power of 2
}


def test_megablox_tiles_interpret_mode_and_stated_rows(monkeypatch):
  """The megablox call's tiles: rows `MEGABLOX_TILE_M`, or M rounded up
  to 16 when fewer, or `tile_m`; K and N up to 512. Interpret mode on CPU
  alone; the rows stated (`ROWS_SCOPE`) default to M."""
  calls = []

  def call(lhs, rhs, group_sizes, tiling, interpret, rows):
    calls.append((tiling, interpret, rows, group_sizes.dtype))
    return jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype)

  monkeypatch.setattr(gmm, "_megablox_call", call)

  def run(M, K, N, tile_m=None, rows=None):
    gmm.gmm(jnp.zeros((M, K)), jnp.zeros((2, K, N)),
            jnp.zeros((2,), jnp.int16), impl="megablox", tile_m=tile_m,
            rows=rows)

  run(20, 16, 24)
  run(1000, 600, 700, rows=300)
  run(40, 8, 8, tile_m=8)
  run(512, 513, 512)
  monkeypatch.setattr(jax, "default_backend", lambda: "".join("tpu"))
  run(16, 8, 8)
  i32 = jnp.int32
  assert calls == [((32, 16, 24), True, 20, i32),
                   ((512, 512, 512), True, 300, i32),
                   ((8, 8, 8), True, 40, i32),
                   ((512, 512, 512), True, 512, i32),
                   ((16, 8, 8), False, 16, i32)]


def test_megablox_states_its_rows_forward_and_backward():
  """Every op of the megablox forward and gradient carries the rows
  stated: M by default, else `rows`."""
  lhs, rhs, sizes, _ = _case([3, 5], M=12)
  for rows, want in ((None, 12), (8, 8)):
    loss = lambda a, b, r=rows: jnp.sum(gmm.gmm(a, b, sizes,
                                                impl="megablox", rows=r))
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(lhs, rhs).as_text(
        debug_info=True)
    stated = set(re.findall(gmm.ROWS_SCOPE.format(r"(\d+)", r"(\d+)"),
                            text))
    assert stated == {(str(want), "12")}, (rows, stated)


def test_megablox_kernels_get_the_rows_padded_to_whole_tiles_only(
    monkeypatch):
  """The kernels see M rows rounded up to a whole tile, no more, in the
  forward (`gmm`) and both gradients (`gmm` of the output's gradient,
  `tgmm` of the inputs by it)."""
  # pylint: disable-next=protected-access
  kernels, seen = gmm._megablox_kernels(), []

  class Spy:
    @staticmethod
    def gmm(lhs, *args, **kwargs):
      seen.append(("gmm", lhs.shape[0]))
      return kernels.gmm(lhs, *args, **kwargs)

    @staticmethod
    def tgmm(lhs, rhs, *args, **kwargs):
      seen.append(("tgmm", lhs.shape[1], rhs.shape[0]))
      return kernels.tgmm(lhs, rhs, *args, **kwargs)

  monkeypatch.setattr(gmm, "_megablox_kernels", lambda: Spy)
  for M, padded in ((40, 48), (32, 32)):            # tiles of 16 rows
    seen.clear()
    lhs, rhs, sizes, _ = _case([7, 20, 5], M=M)
    loss = lambda a, b, s=sizes: jnp.sum(gmm.gmm(a, b, s, impl="megablox",
                                                 tile_m=16))
    jax.grad(loss, argnums=(0, 1))(lhs, rhs)
    assert sorted(seen) == [("gmm", padded), ("gmm", padded),
                            ("tgmm", padded, padded)], (M, seen)


def test_options_are_keyword_only():
  """`impl`, `tile_m` and `rows` by name only: a positional fourth
  argument is refused, not read as the implementation."""
  lhs, rhs, sizes, _ = _case([3, 5], M=8)
  with pytest.raises(TypeError, match="positional"):
    gmm.gmm(lhs, rhs, sizes, "xla")


def test_xla_path_tiles_by_the_group_count(monkeypatch):
  """Without `tile_m`, the xla path's tile is `default_tile_m(M, G)`, G
  the groups (the weights' first axis), not another width."""
  seen = []

  def xla_gmm(lhs, rhs, group_sizes, tm):
    seen.append(tm)
    return jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype)

  monkeypatch.setattr(gmm, "_xla_gmm", xla_gmm)
  lhs, rhs, sizes, _ = _case([30, 34], N=24)      # M 64, G 2
  gmm.gmm(lhs, rhs, sizes, impl="xla")
  assert seen == [gmm.default_tile_m(64, 2)] == [16]


@pytest.mark.parametrize("impl,primitive", [
    ("megablox", "pallas_call"), ("ragged_dot", "ragged_dot_general"),
    ("xla", "while")])
def test_each_impl_runs_its_own_path(impl, primitive):
  """Each name runs its own path (every path equals `ragged_dot`, so only
  the program tells them apart), a name built at run time as a config's
  is: the kernels, `lax.ragged_dot`, or the tile loop, and no other."""
  lhs, rhs, sizes, _ = _case([3, 5], M=8)
  jaxpr = jax.make_jaxpr(lambda a, b: gmm.gmm(
      a, b, sizes, impl="".join(impl)))(lhs, rhs)
  names = {e.primitive.name for e in helpers.jaxpr_eqns(jaxpr.jaxpr)}
  paths = {"pallas_call", "ragged_dot_general", "while"}
  assert names & paths == {primitive}, names & paths


@pytest.mark.parametrize("impl", ["xla", "megablox"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_ragged_dot(impl, name):
  """Each path equals `ragged_dot`; the names are built at run time, as a
  config's are (no test may pass by a literal's identity)."""
  impl, ragged_dot = "".join(impl), "".join("ragged_dot")
  sizes, M, tm = CASES[name]
  lhs, rhs, group_sizes, dout = _case(sizes, M=M)

  def loss(impl):
    return jax.jit(jax.value_and_grad(
        lambda a, b: jnp.sum(gmm.gmm(a, b, group_sizes, impl=impl,
                                     tile_m=tm) * dout), argnums=(0, 1)))

  (want, (dlhs_want, drhs_want)) = loss(ragged_dot)(lhs, rhs)
  out = gmm.gmm(lhs, rhs, group_sizes, impl=impl, tile_m=tm)
  ref = jax.lax.ragged_dot(lhs, rhs, group_sizes)
  assert numerics.rel_err(out, ref) <= TOL
  value, (dlhs, drhs) = loss(impl)(lhs, rhs)
  assert numerics.rel_err(value, want) <= TOL
  assert numerics.rel_err(dlhs, dlhs_want) <= TOL
  assert numerics.rel_err(drhs, drhs_want) <= TOL
  # Rows past the groups: output and gradient exactly zero.
  used = int(np.sum(sizes))
  assert not np.any(np.asarray(out[used:]))
  assert not np.any(np.asarray(dlhs[used:]))


def test_xla_costs_the_rows_not_the_groups():
  """The XLA path's temporaries do not grow with the group count, while
  `ragged_dot`'s do (it compiles dense over the groups on CPU)."""
  K = N = 64
  M = 1024

  def temp_bytes(impl, E):
    args = (jax.ShapeDtypeStruct((M, K), jnp.float32),
            jax.ShapeDtypeStruct((E, K, N), jnp.float32),
            jax.ShapeDtypeStruct((E,), jnp.int32))
    fn = jax.jit(jax.grad(lambda a, b, c: jnp.sum(gmm.gmm(a, b, c,
                                                          impl=impl)),
                          argnums=(0, 1)))
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes

  weights = lambda E: E * K * N * 4          # the weight gradient itself
  xla = [temp_bytes("xla", E) - weights(E) for E in (4, 64)]
  dense = [temp_bytes("ragged_dot", E) - weights(E) for E in (4, 64)]
  assert xla[1] <= 1.1 * xla[0] + (1 << 16), xla
  assert dense[1] >= 8 * dense[0], dense


def test_loops_are_bounded_by_the_padded_rows_tiles_and_groups():
  """Each loop of the XLA path (forward, both gradients) declares its
  largest trip count, tiles of the rows padded to `tm` plus G - 1, in its
  name scope, which the FLOP count of a compiled step reads."""
  K, N, G, tm = 4, 6, 3, 8
  for M in (20, 24):                    # 3 tiles of 8 rows: 5 items.
    args = (jax.ShapeDtypeStruct((M, K), jnp.float32),
            jax.ShapeDtypeStruct((G, K, N), jnp.float32),
            jax.ShapeDtypeStruct((G,), jnp.int32))
    loss = lambda a, b, c: jnp.sum(gmm.gmm(a, b, c, impl="xla", tile_m=tm))
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).as_text(
        debug_info=True)
    bounds = re.findall(gmm.MAX_TRIPS_SCOPE.format(r"(\d+)"), text)
    assert bounds and set(bounds) == {"5"}, (M, sorted(set(bounds)))


@pytest.mark.parametrize("sizes, tm", [([5, 0, 17, 1, 9, 0, 32], 8),
                                       ([9, 30, 7, 18], 8),
                                       ([7, 20, 5, 28], 12)])
def test_work_items_cover_each_group_once(sizes, tm):
  M = sum(sizes)                         # A multiple of tm.
  sizes = jnp.asarray(sizes, jnp.int32)
  items = gmm._work_items(sizes, M // tm, tm)  # pylint: disable=W0212
  tile, group, valid, starts, ends = (np.asarray(a) for a in items)
  covered = np.zeros(M, int)
  for t, g, ok in zip(tile, group, valid, strict=True):
    if ok:
      rows = np.arange(t * tm, t * tm + tm)
      covered[rows[(rows >= starts[g]) & (rows < ends[g])]] += 1
  assert covered[:M].tolist() == [1] * M
  assert len(tile) == M // tm + len(sizes) - 1
  # Exactly the (tile, group) pairs that share rows, in row order: none
  # for an empty group (group 1 starts mid-tile) nor past a group that
  # ends on a tile boundary (group 4 ends at row 32).
  expected = [(t, g) for g, (s, e) in enumerate(zip(starts, ends, strict=True))
              if e > s for t in range(s // tm, (e - 1) // tm + 1)]
  assert [(int(t), int(g)) for t, g, ok in zip(tile, group, valid,
                                               strict=True) if ok] == expected
  assert int(gmm._item_count(items)) == len(expected)  # pylint: disable=W0212
  # Each item's tile keeps exactly its group's rows (row r holds r + 1).
  x = jnp.arange(1, M + 1, dtype=jnp.float32)[:, None]
  for i, (t, g) in enumerate(expected):
    x_t, _, r0 = gmm._tile_rows(x, items, i, tm)  # pylint: disable=W0212
    kept = [int(v) - 1 for v in np.asarray(x_t)[:, 0] if v]
    assert int(r0) == t * tm and kept == [
        r for r in range(t * tm, t * tm + tm) if starts[g] <= r < ends[g]]


@pytest.mark.parametrize("args, match", [
    (((4, 3), (2, 3, 5), (2,)), None),
    (((4, 3), (2, 4, 5), (2,)), "disagree"),
    (((4, 4), (2, 3, 5), (2,)), "disagree"),
    (((4, 3), (3, 3, 5), (2,)), "disagree"),
    (((4, 3), (1, 3, 5), (2,)), "disagree"),
    (((4,), (2, 3, 5), (2,)), "^gmm takes lhs"),
    (((4, 3, 1), (2, 3, 5), (2,)), "^gmm takes lhs"),
    (((4, 3), (2, 3), (2,)), "^gmm takes lhs"),
    (((4, 3), (2, 3, 5, 1), (2,)), "^gmm takes lhs"),
    (((4, 3), (2, 3, 5), ()), "^gmm takes lhs"),
    (((4, 3), (2, 3, 5), (2, 1)), "^gmm takes lhs"),
    # Equal sizes past CPython's shared small ints.
    (((4, 300), (257, 300, 5), (257,)), None),
])
def test_shape_checks(args, match):
  # Each size its own int object (as sizes read at run time are).
  lhs, rhs, sizes = (jnp.zeros(tuple(int(str(d)) for d in s)) for s in args)
  sizes = sizes.astype(jnp.int32)
  if match is None:
    assert gmm.gmm(lhs, rhs, sizes, impl="xla").shape == (4, 5)
    return
  with pytest.raises(ValueError, match=match):
    gmm.gmm(lhs, rhs, sizes)


def test_bad_impl_and_float_sizes():
  lhs, rhs = jnp.zeros((4, 3)), jnp.zeros((2, 3, 5))
  with pytest.raises(ValueError, match="Unknown grouped-matmul impl"):
    gmm.gmm(lhs, rhs, jnp.zeros((2,), jnp.int32), impl="dense")
  with pytest.raises(ValueError, match="integers"):
    gmm.gmm(lhs, rhs, jnp.zeros((2,)))
  assert gmm.resolve_impl("auto", 16) == "xla"      # CPU


@pytest.mark.parametrize("backend,few,many", [
    ("tpu", "ragged_dot", "megablox"), ("gpu", "xla", "xla"),
    ("cpu", "xla", "xla")], ids=["tpu", "gpu", "cpu"])
def test_auto_picks_by_backend_and_groups(monkeypatch, backend, few, many):
  """On a TPU `ragged_dot` up to `RAGGED_DOT_MAX_GROUPS` groups, the
  megablox kernels above; xla on any other backend."""
  # The backend's name as JAX returns it: a string made at run time.
  monkeypatch.setattr(jax, "default_backend", lambda: "".join(backend))
  limit = gmm.RAGGED_DOT_MAX_GROUPS
  assert limit == 8
  for groups in (1, limit):
    assert gmm.resolve_impl("auto", groups) == few
  assert gmm.resolve_impl("auto", limit + 1) == many
  # A name built at run time (as from a command line), not the literal.
  assert gmm.resolve_impl("".join(["au", "to"]), limit + 1) == many
  for impl in ("xla", "megablox", "ragged_dot"):
    assert gmm.resolve_impl(impl, 1) == impl
    assert gmm.resolve_impl(impl, 64) == impl


def test_stated_rows_reads_the_innermost_scope():
  scopes = "/".join(gmm.ROWS_SCOPE.format(r, 64) for r in (8, 16, 32))
  assert gmm.stated_rows(f"jit(f)/{scopes}/dot_general") == (32, 64)
  assert gmm.stated_rows("jit(f)/gmm_rows_8_of_64/dot") == (8, 64)
  assert gmm.stated_rows("jit(f)/dot_general") is None


def _varying(x):
  kind = getattr(jax.typeof(x), "manual_axis_type", None)
  return set(kind.varying) if kind is not None else set()


def test_varying_like_types_a_value_as_its_references():
  """Inside `shard_map`, a constant takes the mesh axes its references
  vary over (a loop carry must); outside, it is returned as it is."""
  mesh = jax.make_mesh((1,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  seen = {}

  def body(ref):
    zero = jnp.zeros((), ref.dtype)
    seen["ref"], seen["zero"] = _varying(ref), _varying(zero)
    seen["typed"] = _varying(gmm.varying_like(zero, ref))
    seen["itself"] = _varying(gmm.varying_like(ref, ref))
    return ref

  jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(
      jnp.zeros((1,)))
  assert seen == {"ref": {"data"}, "zero": set(), "typed": {"data"},
                  "itself": {"data"}}
  plain = jnp.zeros(())
  assert gmm.varying_like(plain, jnp.ones(())) is plain


def test_varying_like_adds_only_the_missing_axes():
  """A value varying over one axis, typed like a reference varying over
  another, varies over both."""
  mesh = jax.make_mesh((1, 1), ("a", "b"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  seen = {}

  def body(x, ref):
    seen["typed"] = _varying(gmm.varying_like(x, ref))
    return x

  jax.shard_map(body, mesh=mesh, in_specs=(P("a"), P("b")),
                out_specs=P("a"))(jnp.zeros((1,)), jnp.zeros((1,)))
  assert seen == {"typed": {"a", "b"}}


def _tile_by_its_rule(M: int, G: int) -> int:
  """`default_tile_m`'s rule as its docstring states it."""
  fits = [t for t in (8, 16, 32, 64, 128) if (G - 1) * t <= M // 4]
  return min(max(fits, default=8), -(-M // 8) * 8)


def test_default_tile_m_follows_its_rule():
  """The largest power of two in [8, 128] whose G - 1 partial tiles add at
  most M / 4 rows, capped at M rounded up to 8."""
  assert [gmm.default_tile_m(M, G) for M, G in (
      (32768, 16), (4096, 9), (4096, 33), (1024, 64), (20, 3), (5, 1),
      (100, 1), (129, 2))] == [128, 128, 32, 8, 8, 8, 104, 32]
  for M in [*range(1, 700), 1024, 4096, 32768]:
    for G in (1, 2, 3, 8, 16, 64, 128, 257):
      assert gmm.default_tile_m(M, G) == _tile_by_its_rule(M, G), (M, G)
