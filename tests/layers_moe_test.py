"""Tests of kda_lm/layers/moe.py's layer, its dispatch and expert
parallelism, and the MoE decoder/training integration; the routing and its
bookkeeping are tested without a model in `layers_moe_routing_test.py`."""

import collections
import functools
import json
import os
import subprocess
import sys

import haiku as hk
import helpers
import jax
import jax.numpy as jnp
import moe_support
import numpy as np
import process_support
import pytest

from kda_lm import model
from kda_lm.layers import moe
from kda_lm.ops import gmm
from kda_lm.parallel import maps as parallel_maps
from testbed import numerics

D, E, K, F = 8, 8, 3, 4
N_GROUP, TOPK_GROUP, SCALE = 4, 2, 2.5


# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


def _layer(**kwargs):
  def fn(x, valid=None):
    return moe.MoE(E, K, F, num_shared_experts=1, routed_scaling_factor=SCALE,
                   n_group=N_GROUP, topk_group=TOPK_GROUP, name="moe",
                   **kwargs)(x, valid)
  return hk.without_apply_rng(hk.transform(fn))


def _setup(seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(2, 4, D)), jnp.float32)
  layer = _layer()
  params = layer.init(jax.random.key(seed), x)
  # A non-zero selection bias, so that it matters for routing.
  params["moe"][moe.BIAS_NAME] = jnp.asarray(rng.normal(size=E) * 0.3,
                                             jnp.float32)
  return layer, params, x


def _naive_select(scores, bias):
  """Explicit group-limited top-k for one token (numpy)."""
  sel = scores + bias
  per = E // N_GROUP
  group_score = [np.sort(sel[g * per:(g + 1) * per])[-2:].sum()
                 for g in range(N_GROUP)]
  groups = np.argsort(group_score)[::-1][:TOPK_GROUP]
  allowed = np.full(E, -np.inf)
  for g in groups:
    allowed[g * per:(g + 1) * per] = sel[g * per:(g + 1) * per]
  return np.argsort(allowed)[::-1][:K]


def _swiglu(x, wg, wu, wd):
  return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def _naive(params, x, chosen):
  """Per-token loop with the experts in `chosen` ([N] lists of ids)."""
  p = params["moe"]
  sh = [params[f"moe/shared_experts/{n}"]["w"]
        for n in ("gate_proj", "up_proj", "down_proj")]
  x_ND = x.reshape(-1, D)
  out = []
  for n in range(x_ND.shape[0]):
    s = jax.nn.sigmoid(x_ND[n] @ p["router"])
    ids = chosen[n]
    w = jnp.stack([s[e] for e in ids])
    w = w / w.sum() * SCALE
    y = _swiglu(x_ND[n], *sh)
    for j, e in enumerate(ids):
      y = y + w[j] * _swiglu(x_ND[n], p["gate_proj"][e], p["up_proj"][e],
                             p["down_proj"][e])
    out.append(y)
  return jnp.stack(out).reshape(x.shape)


def _chosen(params, x):
  p = params["moe"]
  scores = np.asarray(jax.nn.sigmoid(x.reshape(-1, D) @ p["router"]))
  bias = np.asarray(p[moe.BIAS_NAME])
  return [list(_naive_select(s, bias)) for s in scores]


def test_forward_and_gradients_match_naive_reference():
  layer, params, x = _setup()
  chosen = _chosen(params, x)
  y, load = layer.apply(params, x)
  ref = _naive(params, x, chosen)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  counts = np.bincount(np.concatenate(chosen), minlength=E)
  np.testing.assert_array_equal(load, counts)

  cot = jnp.asarray(np.random.default_rng(1).normal(size=x.shape),
                    jnp.float32)
  g = jax.jit(jax.grad(lambda p, x: (layer.apply(p, x)[0] * cot).sum(),
                       argnums=(0, 1)))(params, x)
  g_ref = jax.jit(jax.grad(lambda p, x: (_naive(p, x, chosen) * cot).sum(),
                           argnums=(0, 1)))(params, x)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert np.all(np.asarray(g[0]["moe"][moe.BIAS_NAME]) == 0)
  assert np.any(np.asarray(g[0]["moe"]["router"]) != 0)


def test_valid_mask_excludes_padding_from_load():
  layer, params, x = _setup()
  valid = jnp.arange(8).reshape(2, 4) < 6
  _, load = layer.apply(params, x, valid)
  chosen = _chosen(params, x)[:6]
  np.testing.assert_array_equal(
      load, np.bincount(np.concatenate(chosen), minlength=E))


def test_dispatch_matches_dense_loop_unsorted_and_empty_experts():
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(6, D)), jnp.float32)
  idx = jnp.asarray([[3, 1], [3, 0], [1, 3], [0, 1], [3, 0], [1, 0]])
  w = jnp.asarray(rng.uniform(size=(6, 2)), jnp.float32)
  wg, wu = (jnp.asarray(rng.normal(size=(E, D, F)), jnp.float32)
            for _ in range(2))
  wd = jnp.asarray(rng.normal(size=(E, F, D)), jnp.float32)
  y = moe.dispatch_swiglu(x, idx, w, wg, wu, wd)
  ref = jnp.stack([sum(w[n, j] * _swiglu(x[n], wg[e], wu[e], wd[e])
                       for j, e in enumerate(np.asarray(idx[n])))
                   for n in range(6)])
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "megablox"])
def test_grouped_matmuls_equal_the_ragged_dot_layer(impl):
  """The layer with each grouped matmul against the one before it
  (`ragged_dot`): outputs, loads and every gradient within 1e-6."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(3, 40, D)), jnp.float32)
  valid = jnp.asarray(rng.uniform(size=(3, 40)) > 0.2)
  cot = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
  params = _layer().init(jax.random.key(3), x)

  def run(impl):
    layer = _layer(impl=impl)
    loss = lambda p, x: jnp.sum(layer.apply(p, x, valid)[0] * cot)
    return (layer.apply(params, x, valid),
            jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x))

  (y_ref, load_ref), g_ref = run("ragged_dot")
  (y, load), g = run(impl)
  assert numerics.rel_err(y, y_ref) <= 1e-6
  np.testing.assert_array_equal(load, load_ref)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
    assert numerics.rel_err(a, b) <= 1e-6


def _sharded_loss(x, idx, w, weights, cot, ragged=False):
  return jnp.sum(moe_support.expert_parallel_vmapped(
      x, idx, w, weights, ragged=ragged) * cot)


def _whole_loss(x, idx, w, weights, cot):
  y = moe.dispatch_swiglu(x.reshape(-1, D), idx.reshape(-1, idx.shape[-1]),
                          w.reshape(-1, w.shape[-1]), *weights,
                          impl="ragged_dot")
  return jnp.sum(y.reshape(x.shape) * cot)


# Compiled once per shard count for every routing (idx is an argument).
_SHARDED = jax.jit(jax.value_and_grad(_sharded_loss, argnums=(0, 2, 3)),
                   static_argnames="ragged")
_WHOLE = jax.jit(jax.value_and_grad(_whole_loss, argnums=(0, 2, 3)))


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("n,routing", [(2, "random"), (4, "random"),
                                       (4, "one_expert"), (4, "one_shard")])
def test_expert_parallel_dispatch_equals_one_device(n, routing, ragged):
  """The exchange on n shards (vmapped), padded or ragged, against
  `dispatch_swiglu` on all tokens: the loss and the gradients of tokens,
  weights and combine weights within 4x the float32 floor of this
  computation; every pair on one expert, or on one shard's experts (the
  others empty), fills the receiver's buffer to its bound.

  The floor (`_ulp_floor`) is how far the one-device results move when
  every input moves by one float32 ulp, measured in the same run: the
  exchange only reorders sums, which costs rounding of that order. A fixed
  1e-6 failed on one 2-core x86 host (2.02e-6 at n=4, "one_shard"). Here:
  floors 3.8e-7 to 4.6e-7, and 4.1e-6 for "one_shard" (every pair on two
  experts: long sums); errors 0 (loss) to 1.1e-7."""
  rng = np.random.default_rng(6)
  M, A = 6, 2
  x = jnp.asarray(rng.normal(size=(n, M, D)), jnp.float32)
  idx = np.stack([rng.permutation(E)[:A] for _ in range(n * M)])
  if routing == "one_expert":
    idx[:, 0], idx[:, 1] = 3, rng.integers(0, E, n * M)
    idx[idx[:, 1] == 3, 1] = 2
  elif routing == "one_shard":
    idx = np.tile([E - 1, E - 2], (n * M, 1))
  idx = jnp.asarray(idx.reshape(n, M, A), jnp.int32)
  w = jnp.asarray(rng.uniform(size=(n, M, A)), jnp.float32)
  weights = [jnp.asarray(rng.normal(size=s), jnp.float32)
             for s in ((E, D, F), (E, D, F), (E, F, D))]
  cot = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
  loss, g = _SHARDED(x, idx, w, weights, cot, ragged=ragged)
  loss_ref, g_ref = _WHOLE(x, idx, w, weights, cot)
  want = [loss_ref] + jax.tree.leaves(g_ref)
  tol = 4 * _ulp_floor(x, idx, w, weights, cot, want)
  assert 1e-8 < tol < 2e-5, tol
  got = [loss] + jax.tree.leaves(g)
  for a, b in zip(got, want, strict=True):
    assert numerics.rel_err(a, b) <= tol, (numerics.rel_err(a, b), tol)


def _ulp_floor(x, idx, w, weights, cot, want):
  """The largest relative move of the one-device loss or any gradient when
  x, w and the weights move by one float32 ulp (random signs)."""
  rng = np.random.default_rng(0)
  nudge = lambda a: a * (1 + np.float32(2.0 ** -23) * rng.choice(
      np.array([-1, 1], np.float32), a.shape))
  loss, g = _WHOLE(nudge(x), idx, nudge(w), [nudge(a) for a in weights], cot)
  return max(numerics.rel_err(a, b)
             for a, b in zip([loss] + jax.tree.leaves(g), want, strict=True))


def _kept_pairs(idx_nMA, cap):
  """[n,M,A] 1.0 where a pair stays within the exchange capacity: of the
  pairs one shard sends to one shard, the first `cap` in expert order."""
  n, M, A = idx_nMA.shape
  keep = np.zeros(n * M * A)
  for s in range(n):
    flat = idx_nMA[s].reshape(-1)
    rank = collections.Counter()
    for p in np.argsort(flat, kind="stable"):
      target = flat[p] // (E // n)
      keep[s * M * A + p] = rank[target] < cap
      rank[target] += 1
  return keep.reshape(n, M, A)


def test_capacity_factor_drops_the_pairs_past_capacity():
  """With a capacity factor the exchange equals the one-device dispatch
  without the pairs past capacity (their combine weights zeroed); the
  capacity is `ceil(c * M * A / n)` (`moe.exchange_capacity`)."""
  rng = np.random.default_rng(7)
  n, M, A = 4, 6, 2
  x = jnp.asarray(rng.normal(size=(n, M, D)), jnp.float32)
  idx = np.stack([rng.permutation(E)[:A] for _ in range(n * M)])
  idx[: n * M // 2, 0] = 1     # shard 0's experts get more than capacity
  idx = idx.reshape(n, M, A).astype(np.int32)
  w = jnp.asarray(rng.uniform(size=(n, M, A)), jnp.float32)
  weights = [jnp.asarray(rng.normal(size=s), jnp.float32)
             for s in ((E, D, F), (E, D, F), (E, F, D))]
  keep = _kept_pairs(idx, 2)
  assert 0 < keep.sum() < keep.size
  y_ref = moe.dispatch_swiglu(x.reshape(-1, D), idx.reshape(-1, A),
                              (w * keep).reshape(-1, A), *weights)
  for ragged in (False, True):
    y = jax.jit(functools.partial(moe_support.expert_parallel_vmapped,
                                  ragged=ragged, capacity_factor=0.5))(
                                      x, idx, w, weights)
    assert numerics.rel_err(y.reshape(-1, D), y_ref) <= 1e-6


CHECKS = os.path.join(process_support.REPO, "tests", "layers_moe_checks.py")


def test_expert_parallel_layer_on_meshes_equals_one_device():
  """`layers_moe_checks.py` (8 fake devices): the layer under expert=2
  and 4 meshes (beside data, fsdp, context) against no mesh; the shared
  experts' FLOPs per device under fsdp x context."""
  result = subprocess.run([sys.executable, CHECKS], cwd=process_support.REPO,
                          env=process_support.subprocess_env(),
                          capture_output=True, text=True, timeout=600,
                          check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  out = json.loads(result.stdout.strip().splitlines()[-1])
  # The shared experts run on each device's own tokens: flattening [B,T]
  # before them once replicated them over `context` (2x here).
  assert out["flops"]["per_device"] == out["flops"]["expected"], out["flops"]
  results = out["errors"]
  assert len(results) == 3 * 2 + 1 + 2, sorted(results)
  for case, errors in results.items():
    assert errors["y"] <= 1e-6 and errors["grads"] <= 1e-6, (case, errors)
    assert errors["expert_grads"] <= 1e-6, (case, errors)
    # The load counts valid tokens only, over the whole mesh.
    assert errors["load"] == 0, (case, errors)
    assert errors["load_total"] == errors["valid_pairs"], (case, errors)
    assert errors["expert_spec"].startswith("P('expert'"), case
    # The bias forces the routing: 2 experts, 1 expert, or many.
    used = {"experts_0_and_5": 2, "all_on_expert_3": 1}
    routing = next((r for r in used if r in case), "random")
    assert (errors["experts_used"] == used[routing] if routing in used
            else errors["experts_used"] > 2), (case, errors)


# One KDA layer with a dense FFN, then one MLA layer with the MoE.
MOE_CONFIG = helpers.tiny_model(
    attention_pattern="KM", num_experts=8, num_experts_per_tok=2,
    num_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1,
    routed_scaling_factor=2.5, n_group=2, topk_group=2)


@functools.lru_cache(maxsize=None)
def _model_setup():
  m = model.build(MOE_CONFIG)
  tokens, seg = helpers.packed_row(0)
  params = jax.jit(m.init)(jax.random.key(0), tokens, seg)
  # Random selection biases, so routing differs from bias-free routing.
  for module in model.router_bias_modules(MOE_CONFIG):
    params[module][moe.BIAS_NAME] = jax.random.normal(
        jax.random.key(len(module)), (8,)) * 0.1
  return m, params, jax.jit(m.apply, static_argnames="return_aux")


def test_moe_model_packed_equals_unpacked_and_param_count():
  m, params, apply = _model_setup()
  tokens, seg = helpers.alone_rows(*helpers.packed_row(1))
  # One call (one compilation): routing is per token, so rows don't mix.
  out, aux = apply(params, tokens, seg, return_aux=True)
  out = np.asarray(out)
  assert aux["expert_load"].shape == (1, 8)
  np.testing.assert_array_equal(aux["expert_load"].sum(-1),
                                2 * np.sum(seg != 0))
  for i, n in enumerate(helpers.LENS):
    alone = out[1 + i, :n]
    got = helpers.doc(out[:1], i)[0]
    err = np.abs(got - alone).max() / np.abs(alone).max()
    assert err <= 1e-5, (i, err)
  n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(
      model.abstract_params(MOE_CONFIG)))
  assert n == model.param_count(MOE_CONFIG)
  assert model.router_bias_modules(MOE_CONFIG) == ["layer_1/moe"]
  assert "layer_0/mlp/gate_proj" in params and "layer_0/moe" not in params


def _clamped_reference(x, idx, w, weights, limit):
  """Per token, in float64: sum_j w_j down(min(silu(x Wg), L) clip(x Wu))."""
  wg, wu, wd = (np.asarray(a, np.float64) for a in weights)
  x, idx, w = (np.asarray(a) for a in (x, idx, w))
  out = np.zeros(x.shape, np.float64)
  for m in range(x.shape[0]):
    for j, e in enumerate(idx[m]):
      g, u = x[m] @ wg[e], x[m] @ wu[e]
      h = np.minimum(g / (1 + np.exp(-g)), limit) * np.clip(u, -limit, limit)
      out[m] += w[m, j] * (h @ wd[e])
  return out


def test_clamped_experts_on_one_device_and_over_shards():
  """The routed experts' SwiGLU clamp (`limit`): `dispatch_swiglu` and the
  expert-parallel exchange (n = 2, vmapped) against a per-token float64
  reference; a limit that binds changes the result."""
  rng = np.random.default_rng(3)
  n, M, A, limit = 2, 5, 2, 0.5
  x = jnp.asarray(3 * rng.normal(size=(n * M, D)), jnp.float32)
  idx = jnp.asarray(np.stack([rng.permutation(E)[:A] for _ in range(n * M)]),
                    jnp.int32)
  w = jnp.asarray(rng.uniform(size=(n * M, A)), jnp.float32)
  weights = [jnp.asarray(rng.normal(size=s), jnp.float32)
             for s in ((E, D, F), (E, D, F), (E, F, D))]
  want = _clamped_reference(x, idx, w, weights, limit)
  one = moe.dispatch_swiglu(x, idx, w, *weights, impl="ragged_dot",
                            limit=limit)
  assert numerics.rel_err(one, want) < 1e-6
  local = [a.reshape(n, E // n, *a.shape[1:]) for a in weights]
  fn = functools.partial(moe.expert_parallel_swiglu, shards=n,
                         impl="ragged_dot", limit=limit)
  split = jax.vmap(fn, axis_name=parallel_maps.EXPERT_AXIS)(
      x.reshape(n, M, D), idx.reshape(n, M, A), w.reshape(n, M, A), *local)
  assert numerics.rel_err(split.reshape(-1, D), want) < 1e-6
  plain = moe.dispatch_swiglu(x, idx, w, *weights, impl="ragged_dot")
  assert numerics.rel_err(plain, want) > 0.05


def test_dispatch_gradient_gathers_rather_than_scatters():
  """The rows' sort and unsort are permutations: their gradients gather by
  the inverse permutation (fast everywhere) where autodiff would
  scatter-add the [pairs, D] and [tokens, D] cotangent rows (slow on
  TPUs)."""
  layer, params, x = _setup()
  grad = jax.grad(lambda p, x: layer.apply(p, x)[0].sum(), argnums=(0, 1))
  eqns = helpers.jaxpr_eqns(jax.make_jaxpr(grad)(params, x).jaxpr)
  rows = {(x.shape[0] * x.shape[1], D), (x.shape[0] * x.shape[1] * K, D)}
  scatters = [e.invars[0].aval.shape for e in eqns
              if e.primitive.name.startswith("scatter")]
  assert scatters and not rows & set(scatters), scatters


def test_expert_parallel_grouped_matmuls_state_their_mean_rows():
  """The receiving buffer holds the worst case n*cap rows; on average a
  device receives M*A of them, which the megablox calls' name scope
  states for readers of the compiled cost (`gmm.ROWS_SCOPE`), forward
  and backward (3 matmuls each way)."""
  rng = np.random.default_rng(8)
  n, M, A = 2, 4, 2
  x = jnp.asarray(rng.normal(size=(n, M, D)), jnp.float32)
  idx = jnp.asarray(rng.integers(0, E, (n, M, A)), jnp.int32)
  w = jnp.ones((n, M, A), jnp.float32)
  weights = [jnp.ones(s, jnp.float32)
             for s in ((E, D, F), (E, D, F), (E, F, D))]
  loss = lambda x, ws: jnp.sum(moe_support.expert_parallel_vmapped(
      x, idx, w, ws, impl="megablox"))
  text = jax.jit(jax.grad(loss, (0, 1))).lower(x, weights).as_text(
      debug_info=True)
  cap = moe.exchange_capacity(M, A, E // n, n)
  assert gmm.ROWS_SCOPE.format(M * A, n * cap) in text
