"""Tests of kda_lm/layers/moe.py's dispatch on tiny arrays, without a
model or devices: `dispatch_swiglu` against a loop over each token's
experts (outputs and gradients), the permutations' custom gradients
against autodiff's, the expert-parallel exchange on shards vmapped over
the `expert` axis name, `_dispatch`'s path on and off a mesh (abstract
meshes and one device), and the `MoE` module's parameters and output.
`layers_moe_test.py` runs the layer in a model and on fake devices.

Tolerance: float32 results that differ only in the order of their sums
(the sort, the grouped matmul's tiles, the exchange) agree within
`TOL` = 1e-6 relative (`numerics.rel_err`); measured at most 2.5e-7 here.
"""

# The tests call the dispatch's private pieces directly.
# pylint: disable=protected-access

import functools
from unittest import mock

import haiku as hk
import jax
import jax.numpy as jnp
import moe_support
import numpy as np
import pytest

from kda_lm.layers import moe
from kda_lm.parallel import maps as parallel_maps
from kda_lm.parallel import sharding
from testbed import numerics

# Tiny arrays: compiling dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

D, E, F = 8, 4, 6   # Distinct: a size read from the wrong axis fails.
TOL = 1e-6
AUTO = jax.sharding.AxisType.Auto


def _weights(rng, experts=E):
  return [jnp.asarray(rng.normal(size=s), jnp.float32)
          for s in ((experts, D, F), (experts, D, F), (experts, F, D))]


def _swiglu(x, wg, wu, wd, limit=0.0):
  """One expert on one token, clamped as `mlp.swiglu` states it."""
  g, u = x @ wg, x @ wu
  h = jax.nn.silu(g)
  if limit:
    h, u = jnp.minimum(h, limit), jnp.clip(u, -limit, limit)
  return (h * u) @ wd


def _loop(x, idx, w, wg, wu, wd, limit=0.0):
  """`sum_j w[n,j] SwiGLU_{idx[n,j]}(x[n])`, token by token (`idx` a numpy
  array: the experts are picked in Python)."""
  return jnp.stack([
      sum(w[n, j] * _swiglu(x[n], wg[e], wu[e], wd[e], limit)
          for j, e in enumerate(idx[n]))
      for n in range(x.shape[0])])


def _jit_loop(idx, limit=0.0):
  """`_loop` for these experts, jitted: `fn(x, w, *weights)`."""
  return jax.jit(lambda x, w, *ws: _loop(x, idx, w, *ws, limit=limit))


def _value_and_grads(fn, x, w, weights, cot):
  """fn's output and the gradients of `sum(fn * cot)` with respect to x,
  w and the expert weights."""
  loss = lambda x, w, ws: jnp.sum(fn(x, w, *ws) * cot)
  return fn(x, w, *weights), jax.grad(loss, argnums=(0, 1, 2))(x, w,
                                                                weights)


def _assert_close(got, want, tol=TOL):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert numerics.rel_err(a, b) <= tol, (numerics.rel_err(a, b), tol)


# name: (expert ids [M,A], limit). Unsorted ids, expert 2 empty; every
# token on expert 3 alone; every token on all four experts in its own
# order; a clamp that binds.
ROUTINGS = {
    "unsorted": ([[3, 1], [3, 0], [1, 3], [0, 1], [3, 0]], 0.0),
    "one_expert": ([[3]] * 3, 0.0),
    "all_experts": ([[2, 0, 3, 1], [1, 3, 2, 0], [0, 1, 2, 3]], 0.0),
    "clamped": ([[2, 1], [0, 2], [1, 3], [3, 2]], 0.5),
}


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_dispatch_swiglu_equals_a_loop_over_each_tokens_experts(name):
  """`dispatch_swiglu` (the default grouped matmul) against the per-token
  loop: the output and the gradients of the tokens, the combine weights
  and every expert weight."""
  ids, limit = ROUTINGS[name]
  rng = np.random.default_rng(len(name))
  idx = np.asarray(ids, np.int32)
  M, A = idx.shape
  x = jnp.asarray(3 * rng.normal(size=(M, D)), jnp.float32)
  w = jnp.asarray(rng.uniform(size=(M, A)), jnp.float32)
  weights = _weights(rng)
  cot = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
  clamp = {"limit": limit} if limit else {}     # By default, no clamp.
  got = jax.jit(lambda x, w, ws, i: _value_and_grads(
      lambda x, w, *ws: moe.dispatch_swiglu(x, i, w, *ws, **clamp),
      x, w, ws, cot))(x, w, weights, jnp.asarray(idx))
  want = jax.jit(lambda x, w, ws: _value_and_grads(
      lambda x, w, *ws: _loop(x, idx, w, *ws, limit=limit), x, w, ws,
      cot))(x, w, weights)
  _assert_close(got, want)
  if limit:
    plain = _jit_loop(idx)(x, w, *weights)
    assert numerics.rel_err(plain, want[0]) > 0.05


def test_dispatch_swiglu_keeps_the_tokens_dtype_and_keyword_options():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(3, D)), jnp.bfloat16)
  idx = jnp.asarray([[1, 0], [2, 1], [0, 3]], jnp.int32)
  w = jnp.asarray(rng.uniform(size=(3, 2)), jnp.float32)
  weights = _weights(rng)
  y = jax.eval_shape(moe.dispatch_swiglu, x, idx, w, *weights)
  assert y.dtype == jnp.bfloat16 and y.shape == (3, D)
  with pytest.raises(TypeError, match="positional"):
    moe.dispatch_swiglu(x, idx, w, *weights, "xla")


def _routing(rng, M, A):
  order = jnp.argsort(jnp.asarray(rng.integers(0, E, M * A)), stable=True)
  return order.astype(jnp.int32), moe._inverse(order).astype(jnp.int32)


def test_dispatch_swiglu_permutation_gradients_equal_autodiffs():
  """The sort's and the unsort's gradients (gathers by the inverse
  permutation) equal autodiff's of the plain gathers (scatter-adds)."""
  rng = np.random.default_rng(2)
  M, A = 5, 3
  order, inverse = _routing(rng, M, A)
  x = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
  pairs = jnp.asarray(rng.normal(size=(M * A, D)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(M * A, D)), jnp.float32)
  copies = lambda x: moe._sorted_copies(x, order, inverse, A)
  out, vjp = jax.vjp(copies, x)
  want, vjp_want = jax.vjp(lambda x: x[order // A], x)
  np.testing.assert_array_equal(out, want)
  _assert_close(vjp(g), vjp_want(g))
  permute = lambda p: moe._permute(p, order, inverse)
  out, vjp = jax.vjp(permute, pairs)
  want, vjp_want = jax.vjp(lambda p: p[order], pairs)
  np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(vjp(g)[0], vjp_want(g)[0])
  unpermute = lambda p: moe._permute(p, inverse, order)
  _, vjp = jax.vjp(unpermute, pairs)
  np.testing.assert_array_equal(vjp(g)[0], jax.vjp(
      lambda p: p[inverse], pairs)[1](g)[0])


def test_dispatch_swiglu_copies_gradient_sums_each_token_in_float32():
  """A token's A copies' cotangents (bfloat16) are summed in float32 and
  rounded once: 1 + 2^-8 + 2^-8 is 1 + 2^-7, where bfloat16 sums would
  round each step back to 1."""
  M, A = 2, 3
  order = jnp.arange(M * A, dtype=jnp.int32)
  g = jnp.full((M * A, D), 2.0 ** -8, jnp.bfloat16).at[::A].set(1.0)
  x = jnp.zeros((M, D), jnp.bfloat16)
  _, vjp = jax.vjp(lambda x: moe._sorted_copies(x, order, order, A), x)
  (dx,) = vjp(g)
  assert dx.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(dx, np.float32),
                                np.full((M, D), 1 + 2.0 ** -7))


def test_dispatch_swiglu_combine_sums_in_float32_and_casts():
  out = jnp.full((1, 3, 2), 1.0, jnp.bfloat16)
  w = jnp.asarray([[1.0, 2.0 ** -8, 2.0 ** -8]], jnp.bfloat16)
  y = moe._combine(out, w, jnp.bfloat16)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.full((1, 2), 1 + 2.0 ** -7))


def _ep_case(seed, n, M, A, routing, experts=E):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(n, M, D)), jnp.float32)
  if routing == "one_shard":        # every pair on the last shard's experts
    idx = np.tile([experts - 1, experts - 2][:A], (n * M, 1))
  else:
    idx = np.stack([rng.permutation(experts)[:A] for _ in range(n * M)])
  idx = idx.reshape(n, M, A).astype(np.int32)
  w = jnp.asarray(rng.uniform(size=(n, M, A)), jnp.float32)
  cot = jnp.asarray(rng.normal(size=(n, M, D)), jnp.float32)
  return x, idx, w, _weights(rng, experts), cot


def test_expert_parallel_exchange_is_ragged_where_supported():
  """`ragged=None` exchanges ragged where the backend runs it, padded
  elsewhere; True or False is followed whatever the backend. The options
  are keyword-only."""
  n, M, A = 2, 3, 2
  x, idx, w, weights, _ = _ep_case(7, n, M, A, "random")
  with pytest.raises(TypeError, match="positional"):
    moe.expert_parallel_swiglu(x[0], jnp.asarray(idx[0]), w[0], *weights, n)
  called = []

  def spy(kind, real, *args):
    called.append(kind)
    return real(*args)

  spies = {f"_{kind}_exchange": functools.partial(
      spy, kind, getattr(moe, f"_{kind}_exchange"))
           for kind in ("ragged", "padded")}
  for ragged, supported, want in ((None, True, "ragged"),
                                  (None, False, "padded"),
                                  (True, False, "ragged"),
                                  (False, True, "padded")):
    called.clear()
    with mock.patch.multiple(moe, **spies), mock.patch.object(
        parallel_maps, "ragged_exchange_supported", lambda s=supported: s):
      jax.eval_shape(functools.partial(
          moe_support.expert_parallel_vmapped, impl="ragged_dot",
          ragged=ragged), x, jnp.asarray(idx), w, weights)
    assert called == [want], (ragged, supported, called)


def test_expert_parallel_states_the_mean_rows_received():
  """The grouped matmuls of the local experts are told the rows a device
  receives on average, M*A or the n*cap its buffer holds if fewer; the
  ragged exchange states the same of its buffer in its name scope."""
  n, M, A = 2, 4, 2
  x, idx, w, weights, _ = _ep_case(6, n, M, A, "random")
  seen = []
  real_gmm = moe.gmm.gmm

  def gmm(*args, rows=None, **kwargs):
    seen.append(rows)
    return real_gmm(*args, rows=rows, **kwargs)

  for c, rows in ((None, M * A), (0.75, n * 3)):
    seen.clear()
    with mock.patch.object(moe.gmm, "gmm", gmm):
      text = jax.jit(functools.partial(
          moe_support.expert_parallel_vmapped, ragged=True,
          capacity_factor=c)).lower(x, jnp.asarray(idx), w, weights).as_text(
              debug_info=True)
    cap = moe.exchange_capacity(M, A, E // n, n, c)
    assert seen == [rows, rows], (c, seen)
    assert moe.gmm.ROWS_SCOPE.format(rows, n * cap) in text, c


@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "ragged"])
@pytest.mark.parametrize("n,experts", [(2, 4), (4, 4), (2, 6), (2, 8)])
def test_expert_parallel_output_equals_the_loop(n, experts, ragged):
  """The output alone (a quick first check): n shards of 3 tokens, each
  with experts/n of the experts (with 4 shards, fewer than a token's
  A = 2; with 8 experts, more than one (source, expert) segment after
  n + E), against the per-token loop over all tokens."""
  M, A = 3, 2
  x, idx, w, weights, _ = _ep_case(4, n, M, A, "random", experts)
  y = jax.jit(functools.partial(moe_support.expert_parallel_vmapped,
                                impl="ragged_dot", ragged=ragged))(
                                    x, jnp.asarray(idx), w, weights)
  flat = lambda a: a.reshape(n * M, -1)
  want = _jit_loop(flat(idx))(flat(x), flat(w), *weights)
  _assert_close(y.reshape(n * M, D), want)


@functools.partial(jax.jit, static_argnames=("ragged", "limit"))
def _ep(x, idx, w, weights, cot, ragged, limit):
  fn = lambda x, w, *ws: moe_support.expert_parallel_vmapped(
      x, idx, w, ws, impl="ragged_dot", ragged=ragged, limit=limit)
  return _value_and_grads(fn, x, w, weights, cot)


@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "ragged"])
@pytest.mark.parametrize("routing", ["random", "one_shard"])
def test_expert_parallel_equals_the_loop(routing, ragged):
  """2 shards of 3 tokens, 2 experts each (vmapped), padded or ragged
  exchange: the output and the gradients of the tokens, the combine
  weights and the expert weights against the per-token loop over all
  tokens; with every pair on one shard's experts the other receives
  nothing and that one the most its buffer holds."""
  n, M, A, limit = 2, 3, 2, 1.0
  x, idx, w, weights, cot = _ep_case(4, n, M, A, routing)
  got = _ep(x, jnp.asarray(idx), w, weights, cot, ragged=ragged,
            limit=limit)
  flat = lambda a: a.reshape(n * M, -1)
  want = jax.jit(lambda x, w, ws: _value_and_grads(
      lambda x, w, *ws: _loop(flat(x), flat(idx), flat(w), *ws,
                              limit=limit).reshape(n, M, D),
      x, w, ws, cot))(x, w, weights)
  _assert_close(got, want)


def _kept_pairs(idx_nMA, cap, n):
  """[n,M,A] 1.0 where a pair stays within the exchange capacity: of the
  pairs one shard sends to one shard, the first `cap` in expert order."""
  keep = np.zeros(idx_nMA.shape)
  for s in range(n):
    flat = idx_nMA[s].reshape(-1)
    sent = [0] * n
    for p in np.argsort(flat, kind="stable"):
      target = flat[p] // (E // n)
      keep[s].reshape(-1)[p] = sent[target] < cap
      sent[target] += 1
  return keep


# Expert ids [n=2, M=4, A=2] and the pairs kept with 3 from each shard to
# each. "partly": shard 0 sends 5 pairs to shard 0 (2 to expert 0, then
# 3 to expert 1) and keeps 3; shard 1 sends 5 to shard 1 and keeps 3.
# "whole_expert": shard 0 sends 4 pairs to expert 0, so none of its 2
# pairs for expert 1 is kept.
CAPACITY_CASES = {
    "partly": ([[[0, 1], [1, 2], [0, 3], [2, 1]],
                [[3, 2], [1, 3], [2, 0], [3, 1]]], 12),
    "whole_expert": ([[[0, 1], [0, 2], [0, 3], [1, 0]],
                      [[3, 2], [1, 3], [2, 0], [3, 1]]], 11),
}


@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "ragged"])
@pytest.mark.parametrize("case", sorted(CAPACITY_CASES))
def test_expert_parallel_drops_the_pairs_past_capacity(case, ragged):
  """Capacity factor 0.75 over 2 shards of 4 tokens (top-2): 3 pairs from
  each shard to each; the result is the loop's without the pairs past
  that (their weights zeroed), which are the last in expert order."""
  n, M, A = 2, 4, 2
  x, _, w, weights, _ = _ep_case(5, n, M, A, "random")
  ids, kept = CAPACITY_CASES[case]
  idx = np.asarray(ids, np.int32)
  assert moe.exchange_capacity(M, A, E // n, n, 0.75) == 3
  keep = _kept_pairs(idx, 3, n)
  assert keep.sum() == kept, keep
  y = jax.jit(functools.partial(moe_support.expert_parallel_vmapped,
                                impl="ragged_dot", ragged=ragged,
                                capacity_factor=0.75))(
                                    x, jnp.asarray(idx), w, weights)
  flat = lambda a: a.reshape(n * M, -1)
  want = _jit_loop(flat(idx))(flat(x), flat(w * keep), *weights)
  _assert_close(y.reshape(n * M, D), want)


def test_expert_parallel_local_experts_run_each_row_through_its_own():
  """The received rows, in any order, through their local experts; a row
  marked E (an empty slot) comes back zero."""
  rng = np.random.default_rng(3)
  local = np.asarray([1, 2, 0, 1, 0, 2, 0, 1])       # E = 2 local experts
  rows = jnp.asarray(rng.normal(size=(len(local), D)), jnp.float32)
  weights = _weights(rng, 2)
  # Per source (2) and expert: 3 rows for expert 0, 3 for expert 1 (the
  # sums over the sources; those over the experts differ).
  got_counts = jnp.asarray([[2, 0], [1, 3]], jnp.int32)
  out = jax.jit(lambda rows, ws: moe._local_experts(
      rows, jnp.asarray(local), got_counts, ws, "xla", 0.0, None))(
          rows, weights)
  want = jax.jit(lambda rows, ws: jnp.stack([
      _swiglu(rows[r], *(a[e] for a in ws)) if e < 2 else jnp.zeros(D)
      for r, e in enumerate(local)]))(rows, weights)
  _assert_close(out, want)
  assert not np.any(np.asarray(out)[local == 2])


def _traced_dispatch(mesh, impl, capacity_factor=None, B=4, T=6):
  """`_dispatch` traced under an abstract mesh with `token_map`,
  `expert_map`, `expert_parallel_swiglu`, `dispatch_swiglu` and the log
  recorded. Returns ({what: [its arguments]}, output shape)."""
  seen = {"token_map": [], "expert_map": [], "expert_parallel": [],
          "dispatch": [], "log": []}
  real = {"token_map": parallel_maps.token_map,
          "expert_map": parallel_maps.expert_map}

  def map_spy(name):
    def spy(fn, tokens, others, check_vma):
      seen[name].append(check_vma)
      return real[name](fn, tokens, others, True)
    return spy

  def expert_parallel(x, idx, w, *weights, **kwargs):
    seen["expert_parallel"].append((x.shape, weights[0].shape, kwargs))
    return x

  def dispatch(x, idx, w, *weights, **kwargs):
    seen["dispatch"].append((x.shape, weights[0].shape, kwargs))
    return x

  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  args = (spec(B, T, D), jax.ShapeDtypeStruct((B, T, 2), jnp.int32),
          spec(B, T, 2), (spec(E, D, F), spec(E, D, F), spec(E, F, D)))
  with mock.patch.multiple(
      parallel_maps, token_map=map_spy("token_map"),
      expert_map=map_spy("expert_map")), mock.patch.multiple(
          moe, expert_parallel_swiglu=expert_parallel,
          dispatch_swiglu=dispatch), mock.patch.object(
              moe.logging, "info",
              lambda *a: seen["log"].append(a[0] % a[1:])), \
      jax.sharding.use_abstract_mesh(mesh):
    out = jax.eval_shape(
        lambda *a: moe._dispatch(*a, impl, capacity_factor, 0.5), *args)
  return seen, out.shape


def _mesh(**sizes):
  return jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes),
                                   axis_types=(AUTO,) * len(sizes))


def test_dispatch_path_under_a_mesh_is_the_token_or_expert_map():
  """An `expert` axis of 2: `expert_map`, each device's 2 of the 4 experts
  and its 2 x 3 tokens through `expert_parallel_swiglu`, its capacity
  logged; of 1: `token_map` and `dispatch_swiglu` on the device's tokens.
  The maps check varying axes unless the kernels are megablox's."""
  seen, shape = _traced_dispatch(_mesh(data=1, expert=2, context=2),
                                 "xla", 0.5)
  assert shape == (4, 6, D)
  kwargs = dict(shards=2, impl="xla", capacity_factor=0.5, limit=0.5)
  assert seen["expert_parallel"] == [((6, D), (2, D, F), kwargs)]
  assert seen["expert_map"] == [True] and not seen["token_map"]
  assert not seen["dispatch"]
  assert seen["log"] == [
      "Expert-parallel MoE: 2 experts per device of 4, 6 tokens per "
      "device, capacity factor 0.5: 3 pairs from each device."]
  # An impl named at run time (as from a config), not the interned
  # literal.
  megablox = "".join(["mega", "blox"])
  seen, _ = _traced_dispatch(_mesh(data=2, expert=1, context=3), megablox)
  assert seen["dispatch"] == [((4, D), (E, D, F), dict(impl="megablox",
                                                       limit=0.5))]
  assert seen["token_map"] == [False] and not seen["expert_map"]
  assert not seen["expert_parallel"] and not seen["log"]
  seen, _ = _traced_dispatch(_mesh(expert=2), megablox, None, B=2, T=5)
  assert seen["expert_map"] == [False]
  assert seen["log"] == [
      "Expert-parallel MoE: 2 experts per device of 4, 5 tokens per "
      "device, capacity factor None: 10 pairs from each device."]
  # Fewer local experts than A = 2: a token sends each device at most 1.
  seen, _ = _traced_dispatch(_mesh(expert=4), "xla", None, B=4, T=2)
  assert seen["expert_parallel"][0][2]["shards"] == 4
  assert seen["log"] == [
      "Expert-parallel MoE: 1 experts per device of 4, 2 tokens per "
      "device, capacity factor None: 2 pairs from each device."]


def _path_case(seed):
  """[2,3,D] tokens, their picks and weights, the experts' weights, and
  the loop's output for them (limit 0.5)."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(2, 3, D)), jnp.float32)
  idx = jnp.asarray(rng.integers(0, E, (2, 3, 2)), jnp.int32)
  w = jnp.asarray(rng.uniform(size=(2, 3, 2)), jnp.float32)
  weights = tuple(_weights(rng))
  want = _jit_loop(np.asarray(idx).reshape(6, 2), 0.5)(
      x.reshape(6, D), w.reshape(6, 2), *weights).reshape(2, 3, D)
  return x, idx, w, weights, want


def test_dispatch_path_off_a_mesh_is_dispatch_swiglu():
  """[B,T,D] or [M,D] tokens without a mesh, and [M,D] tokens under one:
  `dispatch_swiglu` of the flat tokens, in the tokens' shape."""
  x, idx, w, weights, want = _path_case(7)
  dispatch = jax.jit(moe._dispatch, static_argnums=(4, 5, 6))
  _assert_close(dispatch(x, idx, w, weights, "xla", None, 0.5), want)
  flat = dispatch(x.reshape(6, D), idx.reshape(6, 2), w.reshape(6, 2),
                  weights, "xla", None, 0.5)
  _assert_close(flat, want.reshape(6, D))
  mesh = jax.make_mesh((1,) * 4, sharding.AXES, axis_types=(AUTO,) * 4)
  with jax.set_mesh(mesh), mock.patch.object(
      parallel_maps, "token_map", side_effect=AssertionError):
    flat = jax.jit(moe._dispatch, static_argnums=(4, 5, 6))(
        x.reshape(6, D), idx.reshape(6, 2), w.reshape(6, 2), weights,
        "xla", None, 0.5)
  _assert_close(flat, want.reshape(6, D))


def test_dispatch_path_on_a_one_device_mesh_maps_the_tokens():
  """Under a mesh without an `expert` axis of several devices each device
  runs `dispatch_swiglu` on its tokens (`token_map`): on one device, the
  value without a mesh."""
  x, idx, w, weights, want = _path_case(8)
  mesh = jax.make_mesh((1,) * 4, sharding.AXES, axis_types=(AUTO,) * 4)
  calls = []
  token_map = parallel_maps.token_map

  def spy(*args):
    calls.append(args[-1])
    return token_map(*args)

  with jax.set_mesh(mesh), mock.patch.object(parallel_maps, "token_map",
                                             spy):
    got = jax.jit(moe._dispatch, static_argnums=(4, 5, 6))(
        x, idx, w, weights, "xla", None, 0.5)
  assert calls == [True]
  _assert_close(got, want)


# The layer: 4 experts in 2 groups (1 kept), top-2, scaled weights.
LAYER = dict(num_experts=E, num_experts_per_tok=2, intermediate_size=F,
             routed_scaling_factor=2.5, n_group=2, topk_group=1)


def _layer(defaults=False, **kwargs):
  """`LAYER` with `kwargs`, or with `defaults` only E, A and F."""
  def fn(x, valid=None):
    if defaults:
      return moe.MoE(E, 2, F, name="moe")(x, valid)
    return moe.MoE(**LAYER, name="moe", **kwargs)(x, valid)
  return hk.without_apply_rng(hk.transform(fn))


def test_moe_layer_parameters():
  """The router and its bias in float32 (the bias zero), the experts in
  `param_dtype`, the shared experts one SwiGLU of their summed width;
  each drawn with the scale of its input width (D for the router and the
  input projections, F for the output ones)."""
  x = jnp.zeros((2, 3, D), jnp.float32)
  params = jax.jit(_layer(num_shared_experts=2,
                          param_dtype=jnp.bfloat16).init)(
                              jax.random.key(0), x)
  shapes = {k: {n: (v.shape, v.dtype) for n, v in p.items()}
            for k, p in params.items()}
  bf16, f32 = jnp.bfloat16, jnp.float32
  assert shapes == {
      "moe": {"router": ((D, E), f32), moe.BIAS_NAME: ((E,), f32),
              "gate_proj": ((E, D, F), bf16), "up_proj": ((E, D, F), bf16),
              "down_proj": ((E, F, D), bf16)},
      "moe/shared_experts/gate_proj": {"w": ((D, 2 * F), bf16)},
      "moe/shared_experts/up_proj": {"w": ((D, 2 * F), bf16)},
      "moe/shared_experts/down_proj": {"w": ((2 * F, D), bf16)}}
  p = params["moe"]
  assert not np.any(np.asarray(p[moe.BIAS_NAME]))
  std = lambda *a: np.std(np.concatenate(
      [np.asarray(v, np.float32).ravel() for v in a]))
  # 32 to 256 draws: the sample std within 30% of the stated one.
  for got, want in ((std(p["router"]), D ** -0.5),
                    (std(p["gate_proj"], p["up_proj"]), D ** -0.5),
                    (std(p["down_proj"]), F ** -0.5)):
    assert 0.7 < got / want < 1.3, (got, want)
  none = jax.eval_shape(_layer(num_shared_experts=0).init,
                        jax.random.key(0), x)
  assert sorted(none) == ["moe"]


def _reference_layer(params, x, valid, limits, shared, grouped=True):
  """The layer by its definition: `route`'s experts and weights for the
  sigmoid scores (`LAYER`'s groups and scale, or with `grouped` False
  `route`'s defaults), the loop over each token's experts, plus the shared
  SwiGLU; and `expert_load` of the routing."""
  p = params["moe"]
  x_MD = x.reshape(-1, D)
  idx, w = _route(x_MD, p["router"], p[moe.BIAS_NAME], grouped)
  y = _jit_loop(np.asarray(idx), limits[0])(
      x_MD, w, p["gate_proj"], p["up_proj"], p["down_proj"])
  if shared:
    sh = [params[f"moe/shared_experts/{n}"]["w"]
          for n in ("gate_proj", "up_proj", "down_proj")]
    y = y + _shared(x_MD, *sh, limits[1])
  load = moe.expert_load(idx.reshape(x.shape[:-1] + (2,)), E, valid)
  return y.reshape(x.shape), load


@functools.partial(jax.jit, static_argnums=3)
def _route(x_MD, router, bias, grouped):
  scores = jax.nn.sigmoid(x_MD @ router)
  if not grouped:
    return moe.route(scores, bias, 2)
  return moe.route(scores, bias, 2, n_group=2, topk_group=1,
                   routed_scaling_factor=2.5)


_shared = jax.jit(_swiglu, static_argnums=4)


# name: (shared experts, the routed and shared clamps; None: every
# option at the module's default: one shared expert, no clamp, no groups,
# renormalised weights, no scale).
LAYERS = {"clamped": (1, (0.5, 0.25)), "defaults": (1, None),
          "routed_only": (0, (0.5, 0.25))}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_moe_layer_equals_its_definition(name):
  """Output and load against `_reference_layer`: the routed and shared
  experts with their own clamps (each binding here) or none by default,
  padding tokens left out of the load."""
  shared, limits = LAYERS[name]
  rng = np.random.default_rng(9)
  x = jnp.asarray(3 * rng.normal(size=(2, 3, D)), jnp.float32)
  valid = jnp.asarray([[True, True, False], [True, False, True]])
  if limits is None:
    layer, limits, grouped = _layer(defaults=True), (0.0, 0.0), False
  else:
    layer, grouped = _layer(num_shared_experts=shared,
                            swiglu_limit=limits[0],
                            shared_swiglu_limit=limits[1]), True
  params = jax.jit(layer.init)(jax.random.key(1), x)
  widths = {k: v["w"].shape for k, v in params.items() if "shared" in k}
  assert widths == ({} if not shared else {
      "moe/shared_experts/gate_proj": (D, F),
      "moe/shared_experts/up_proj": (D, F),
      "moe/shared_experts/down_proj": (F, D)}), widths
  params["moe"][moe.BIAS_NAME] = jnp.asarray([0.3, -0.2, 0.1, 0.0])
  y, load = jax.jit(layer.apply)(params, x, valid)
  want_y, want_load = _reference_layer(params, x, valid, limits, shared,
                                       grouped)
  _assert_close(y, want_y)
  np.testing.assert_array_equal(load, want_load)
  assert float(want_load.sum()) == 2 * 4
  # Each clamp binds: without it the reference differs.
  for other in ((0.0, limits[1]), (limits[0], 0.0))[:1 + shared]:
    if other != limits:
      plain, _ = _reference_layer(params, x, valid, other, shared,
                                  grouped)
      assert numerics.rel_err(plain, want_y) > 0.01, other
