"""The context-parallel passes of kda_lm.parallel.context in one process.

`parallel_context_checks.py` runs them with `jax.shard_map` on fake CPU
devices, in subprocesses (minutes a run). Here `maps.sharded` is replaced
by its emulation with nested `jax.vmap`s, one per mesh axis and named after
it (`_vmapped_sharded`): each input is cut into the blocks its
`PartitionSpec` gives every device, the function runs on the stacked
blocks with the collectives (`all_gather`, `ppermute`, `axis_index`) over
the vmapped axis names, and the outputs are put together by their specs.
The mesh is abstract (`jax.sharding.use_abstract_mesh`), so the passes
read their shard counts from it as on devices. Each pass is compared, in
float32, with the op on one device or a plain formula: the KDA op to 1e-5
relative (the subprocess checks' forward tolerance: the sharded pass
reorders the sums of the state's products), the halo and gather maps to
1e-6 (sums of a few products).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_lm import ops
from kda_lm.parallel import context as context_parallel
from kda_lm.parallel import maps as parallel_maps
from kda_lm.parallel import sharding
from testbed import kda_cases, numerics

pytestmark = pytest.mark.usefixtures("fast_compile")

P = jax.sharding.PartitionSpec
CONTEXT = sharding.CONTEXT_AXIS
FWD = 1e-5


def _axis_names(entry):
  """The mesh axes of one `PartitionSpec` entry, major first."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _block(x, spec, sizes, coords):
  """Device `coords`' block of the global array `x` under `spec`."""
  index = []
  for d, entry in enumerate(tuple(spec) + (None,) * (x.ndim - len(spec))):
    count, at = 1, 0
    for name in _axis_names(entry):  # The first one is the major one.
      count, at = count * sizes[name], at * sizes[name] + coords[name]
    assert x.shape[d] % count == 0, (x.shape, spec)
    size = x.shape[d] // count
    index.append(slice(at * size, (at + 1) * size))
  return x[tuple(index)]


def _assemble(y, spec, sizes):
  """The global array from the stacked per-device blocks `y` [*mesh,...]:
  blocks laid out by `spec`, one copy along the axes it does not name
  (every copy equal, when `y` is concrete)."""
  local_ndim = y.ndim - len(sizes)
  groups = [_axis_names(e) for e in
            tuple(spec) + (None,) * (local_ndim - len(spec))]
  named = [name for group in groups for name in group]
  kept = list(sizes)
  for axis in reversed(range(len(sizes))):
    name = kept[axis]
    if name in named:
      continue
    if not isinstance(y, jax.core.Tracer):
      first = np.take(np.asarray(y), [0], axis=axis)
      np.testing.assert_array_equal(
          np.asarray(y), np.broadcast_to(first, y.shape),
          err_msg=f"an output its spec does not name over {name} differs "
          f"along {name}")
    y = jnp.take(y, 0, axis=axis)
    kept.pop(axis)
  order = []
  for d, group in enumerate(groups):
    order += [kept.index(name) for name in group] + [len(kept) + d]
  local = y.shape[len(kept):]
  shape = [int(np.prod([sizes[n] for n in group])) * local[d]
           for d, group in enumerate(groups)]
  return jnp.transpose(y, order).reshape(shape)


def _vmapped_sharded(sizes, calls):
  """`maps.sharded` emulated on a mesh of `sizes` (axis -> size, in mesh
  order) by nested named `jax.vmap`s; records each call's `check_vma`."""

  def sharded(fn, in_specs, out_specs, check_vma=True):
    def run(*args):
      calls.append(check_vma)
      is_spec = lambda s: isinstance(s, P)
      grid = list(itertools.product(*(range(s) for s in sizes.values())))

      def stacked(spec, x):
        x = jnp.asarray(x)
        blocks = [_block(x, spec, sizes, dict(zip(sizes, c, strict=True)))
                  for c in grid]
        return jnp.stack(blocks).reshape(tuple(sizes.values()) +
                                         blocks[0].shape)

      stacked_args = jax.tree.map(stacked, in_specs, tuple(args),
                                  is_leaf=is_spec)
      body = fn
      for name in reversed(list(sizes)):
        body = jax.vmap(body, axis_name=name)
      out = jax.jit(body)(*stacked_args)
      return jax.tree.map(lambda s, y: _assemble(y, s, sizes), out_specs,
                          out, is_leaf=is_spec)
    return run

  return sharded


def _ppermute(x, axis_name, perm):
  """`jax.lax.ppermute` under `jax.vmap`, which takes only whole
  permutations: shard d receives `x` of the s of its pair (s, d), zeros
  without one. Refuses what `ppermute` refuses (an index out of range, a
  shard sending or receiving twice)."""
  n = jax.lax.axis_size(axis_name)
  sources, targets = [s for s, _ in perm], [d for _, d in perm]
  assert all(0 <= i < n and isinstance(i, int) for i in sources + targets), (
      perm)
  assert len(set(sources)) == len(sources), perm
  assert len(set(targets)) == len(targets), perm
  source = np.full(n, -1)
  source[targets] = sources
  whole = jax.lax.all_gather(x, axis_name)
  mine = jnp.asarray(source)[jax.lax.axis_index(axis_name)]
  return jnp.where(mine >= 0, whole[jnp.maximum(mine, 0)], 0)


class _Mesh:
  """Enters an abstract mesh whose `maps.sharded` is `_vmapped_sharded`.

  `jax.lax.ppermute` is `_ppermute`; `jax.lax.pcast` (which needs
  `shard_map`) passes its array through and is recorded in `pcasts`; each
  sharded call's `check_vma` in `check_vma`.
  """

  def __init__(self, monkeypatch):
    self.monkeypatch = monkeypatch
    self.check_vma, self.pcasts = [], []
    monkeypatch.setattr(jax.lax, "pcast", self._pcast)
    monkeypatch.setattr(jax.lax, "ppermute", _ppermute)

  def _pcast(self, x, axes, *, to):
    self.pcasts.append((tuple(axes), to))
    return x

  def __call__(self, context, data=1):
    sizes = dict(zip(sharding.AXES, (data, 1, 1, context), strict=True))
    self.monkeypatch.setattr(parallel_maps, "sharded",
                             _vmapped_sharded(sizes, self.check_vma))
    auto = jax.sharding.AxisType.Auto
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
        tuple(sizes.values()), tuple(sizes), axis_types=(auto,) * 4))


@pytest.fixture(name="mesh")
def fixture_mesh(monkeypatch):
  return _Mesh(monkeypatch)


def _ids():
  """[2,16] ids. Row 0: a document across the splits at 4 (n = 4) and 8,
  a new one starting at the split 8, padding, that id again, a split (12)
  inside it, a one-token document. Row 1: leading padding, a document
  across every split, trailing padding (the last of 4 shards is all
  padding)."""
  return np.array([[1] * 6 + [2] * 2 + [6] + [0] * 2 + [6] * 2 + [3] +
                   [4] * 2,
                   [0] * 3 + [5] * 9 + [0] * 4], np.int32)


# ---------------------------------------------------------------------------
# The halo and gather maps, with functions whose every output depends on
# the positions and ids they are given.

MAPS = 1e-6


def _window(width):
  """A causal window of `width` + 1 taps within a document, plus a bias:
  `fn(x_ext [B,width+t,D], ids_ext [B,width+t], taps [width+1,D], bias
  [D])`."""

  def fn(x_ext, ids_ext, taps, bias):
    t = x_ext.shape[1] - width
    out = jnp.broadcast_to(bias, x_ext[:, width:].shape)
    for j in range(width + 1):
      same = ids_ext[:, j:j + t] == ids_ext[:, width:]
      out = out + taps[j] * jnp.where(same[..., None], x_ext[:, j:j + t], 0)
    return out

  return fn


@pytest.mark.parametrize("n,width", [(2, 1), (2, 3), (2, 4), (4, 1), (4, 2)])
def test_left_halo_map_gives_each_shard_its_left_neighbours_last_tokens(
    mesh, n, width):
  """Each shard's `fn` sees the last `width` tokens and ids of the shard
  before it (zeros and id 0 on shard 0), up to a whole shard: the window
  over the whole row with `width` zeros in front."""
  rng = np.random.default_rng(n * 10 + width)
  x = rng.normal(size=(2, 8, 3)).astype(np.float32)
  ids = _ids()[:, ::2]
  taps = rng.normal(size=(width + 1, 3)).astype(np.float32)
  bias = rng.normal(size=(3,)).astype(np.float32)
  fn = _window(width)
  want = fn(np.pad(x, ((0, 0), (width, 0), (0, 0))),
            np.pad(ids, ((0, 0), (width, 0))), taps, bias)
  with mesh(n, 2):
    got = context_parallel.left_halo_map(fn, x, ids, width, taps, bias)
  assert got.shape == want.shape
  assert numerics.rel_err(got, want) <= MAPS


def test_left_halo_map_refuses_a_halo_longer_than_a_shard(mesh):
  with mesh(4), pytest.raises(ValueError) as info:
    context_parallel.left_halo_map(_window(3), np.zeros((1, 8, 2)),
                                   np.ones((1, 8), np.int32), 3)
  assert str(info.value) == (
      "The short convolution under context parallelism needs T/context = 2 "
      ">= kernel_size - 1 = 3 tokens per shard.")


def _attend(offset, local, gathered, replicated):
  """Causal attention-like sums over whole rows by global position:
  `local` [q (B,t,D), optional r (B,t,E)], `gathered` [kv (B,T,D),
  optional ids (B,T)], `replicated` [w (D,), u (E,) with r]."""
  q, kv, w = local[0], gathered[0], replicated[0]
  t, whole = q.shape[1], kv.shape[1]
  pos = offset + jnp.arange(t)
  mask = jnp.arange(whole)[None, None, :] <= pos[None, :, None]
  if len(gathered) > 1:
    ids = gathered[1]
    mask = mask & (ids[:, None, :] == jnp.take(ids, pos, axis=1)[..., None])
  scores = jnp.einsum("btd,bsd->bts", q * w, kv)
  total = jnp.sum(jnp.where(mask, scores, 0), -1)[..., None]
  if len(local) > 1:
    return total * local[1] * replicated[1]
  return total * q


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("two", [True, False], ids=["two_each", "one_each"])
def test_gather_map_gives_each_shard_the_whole_rows_and_its_offset(
    mesh, n, two):
  """Each shard's `fn` gets its slices of `local`, the whole rows of
  `gathered`, the `replicated` arrays and its first token's global
  position (int32): `fn` on the whole row at offset 0. Two arrays of each
  kind, or one (counts whose sum differs from their `|` and `^`)."""
  rng = np.random.default_rng(n)
  arrays = lambda *shape: rng.normal(size=shape).astype(np.float32)
  q, kv, w = arrays(2, 16, 3), arrays(2, 16, 3), arrays(3)
  if two:
    local, gathered = [q, arrays(2, 16, 5)], [kv, _ids()]
    replicated = [w, arrays(5)]
  else:
    local, gathered, replicated = [q], [kv], [w]
  offsets = []

  def fn(offset, *rest):
    offsets.append(offset.dtype)
    return _attend(offset, *rest)

  want = _attend(jnp.int32(0), local, gathered, replicated)
  with mesh(n, 2):
    got = context_parallel.gather_map(fn, local, gathered, replicated)
  assert got.shape == want.shape
  assert numerics.rel_err(got, want) <= MAPS
  assert offsets == [jnp.int32]


# ---------------------------------------------------------------------------
# KDA.

B, T, H, K, V = 2, 16, 2, 4, 3   # V != K: the widened pass's halves differ.
OP = dict(impl="xla", chunk_size=4)


def _kda_case(gate, with_ids, with_h0, final):
  """(inputs q, k, v, g, beta; keyword arguments) of a `chunk_kda` call."""
  p, static = kda_cases.kda_inputs(np.random.default_rng(0), B, T, H, K, V,
                                   gate=gate, h0=with_h0)
  args = [p.pop(name) for name in ("q", "k", "v", "g", "beta")]
  kwargs = dict(p, **static, **OP, output_final_state=final)
  if with_ids:
    kwargs["segment_ids"] = _ids()
  return args, kwargs


def _assert_matches_one_device(got, args, kwargs):
  o, final = ops.chunk_kda(*args, **kwargs)
  assert got[0].shape == o.shape and got[0].dtype == o.dtype
  assert numerics.rel_err(got[0], o) <= FWD
  if kwargs["output_final_state"]:
    assert got[1].shape == final.shape
    assert numerics.rel_err(got[1], final) <= FWD
  else:
    assert got[1] is None and final is None


@pytest.mark.parametrize("n,data,gate,with_ids,with_h0,final", [
    (2, 2, "softplus", True, True, True),
    (4, 1, "pre", False, False, False),
], ids=["n2_rows2_every_input", "n4_bare"])
def test_chunk_kda_split_along_t_equals_one_device(mesh, n, data, gate,
                                                   with_ids, with_h0, final):
  """`chunk_kda` with T split over 2 shards (and the rows over 2) or 4:
  the output and final state of the op on one device, with every optional
  input or none (ids, initial state, in-kernel gate parameters); one
  varying-axes cast of the widened initial state over the row axes, and
  the vma check on (impl "xla")."""
  args, kwargs = _kda_case(gate, with_ids, with_h0, final)
  with mesh(n, data):
    got = context_parallel.chunk_kda(*args, **kwargs)
  _assert_matches_one_device(got, args, kwargs)
  assert mesh.check_vma == [True]
  assert mesh.pcasts == [(sharding.AXES, "varying")]


@pytest.mark.parametrize("gate,with_ids,with_h0,final", [
    ("softplus", True, True, True),
    ("pre", False, False, False),
], ids=["every_input", "bare"])
def test_chunk_kda_without_context_runs_the_op_on_each_rows(
    mesh, gate, with_ids, with_h0, final):
  """A mesh without a `context` split (rows over 2 devices): the op on
  each device's rows, passed only the optional inputs given; no
  varying-axes check (the op's scans start from a constant state)."""
  args, kwargs = _kda_case(gate, with_ids, with_h0, final)
  with mesh(1, 2):
    got = context_parallel.chunk_kda(*args, **kwargs)
  _assert_matches_one_device(got, args, kwargs)
  assert mesh.check_vma == [False] and not mesh.pcasts


def test_chunk_kda_takes_the_ops_arguments_the_same_way():
  """As `ops.chunk_kda`: the five inputs by position or by name, the
  options by name only, no final state unless asked for (traced, not
  compiled)."""
  args, kwargs = _kda_case("pre", True, False, False)
  del kwargs["output_final_state"]
  by_name = dict(zip(("q", "k", "v", "g", "beta"), args, strict=True))
  got = jax.eval_shape(lambda: context_parallel.chunk_kda(**by_name,
                                                          **kwargs))
  assert got[0].shape == args[2].shape and got[1] is None
  ids = kwargs.pop("segment_ids")
  with pytest.raises(TypeError, match="positional argument"):
    context_parallel.chunk_kda(*args, ids, **kwargs)


def test_chunk_kda_without_a_mesh_is_the_op():
  """Outside a mesh: `ops.chunk_kda` itself, `cu_seqlens` included."""
  args, kwargs = _kda_case("softplus", False, True, True)
  args = [a[:1] for a in args]
  kwargs["initial_state"] = np.concatenate([kwargs["initial_state"]] * 2)[:3]
  kwargs["cu_seqlens"] = np.array([0, 5, 8, 16])
  got = context_parallel.chunk_kda(*args, **kwargs)
  want = ops.chunk_kda(*args, **kwargs)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])


def _trace_on(mesh, args, kwargs):
  """Traces `chunk_kda` on `mesh` without compiling it."""
  with mesh:
    jax.eval_shape(lambda: context_parallel.chunk_kda(*args, **kwargs))


def test_vma_check_and_impl_choice_follow_the_concrete_impl(mesh,
                                                            monkeypatch):
  """Traced only (no compile): a Pallas pass turns the vma check off and
  casts nothing (its outputs carry no varying-axes types), an XLA one
  keeps both; the impl is resolved knowing whether the gates are bounded
  (`lower_bound` given). The Pallas op is stood in for by the XLA path."""
  resolved, asked = [], []
  # pylint: disable-next=protected-access
  real_check, real_op = context_parallel._check_kda, ops.chunk_kda

  def check(B, T, cu_seqlens, impl, bounded):
    resolved.append(bounded)
    return real_check(B, T, cu_seqlens, impl, bounded)

  def op(*args, impl, **kwargs):
    asked.append(impl)
    kwargs.pop("pallas_options", None)
    return real_op(*args, impl="xla", **kwargs)

  monkeypatch.setattr(context_parallel, "_check_kda", check)
  monkeypatch.setattr(ops, "chunk_kda", op)
  args, kwargs = _kda_case("pre", True, True, True)
  # A name built at run time (as from a command line), not the literal.
  for impl in ("xla", "".join(["pal", "las"])):
    _trace_on(mesh(2), args, dict(kwargs, impl=impl))
  assert asked == ["xla", "pallas"] and resolved == [False, False]
  assert mesh.check_vma == [True, False]
  assert mesh.pcasts == [(sharding.AXES, "varying")]
  args, kwargs = _kda_case("safe", True, True, True)
  _trace_on(mesh(2), args, dict(kwargs, impl="xla"))
  assert resolved == [False, False, True]
