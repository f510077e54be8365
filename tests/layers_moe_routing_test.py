"""Tests of kda_lm/layers/moe.py's routing and bookkeeping on small arrays,
without a model: the router shape check, the expert selection and its
combine weights, the expert load, the selection-bias update, the load
metrics, the exchange capacity and the parameter count.
`layers_moe_test.py` tests the layer, its dispatch and expert parallelism.
"""

import collections
import re
import types

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_lm.layers import moe

# Small arrays: compiling each op dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

E, K = 8, 3
N_GROUP, TOPK_GROUP, SCALE = 4, 2, 2.5

# `route`'s combine weights against the float64 reference: the largest
# relative error measured over the cases of
# `test_route_matches_a_per_token_reference` was 2.1e-7, 1.8 float32 eps
# (the rounding of the sum, the division and the scaling).
WEIGHT_RTOL = 2.5e-7

# Jitted: one program compiled per shape and setting rather than one per
# op (compiling is most of these tests' time).
_route = jax.jit(moe.route, static_argnums=2, static_argnames=(
    "n_group", "topk_group", "routed_scaling_factor", "renormalize"))
_expert_load = jax.jit(moe.expert_load, static_argnums=1)
_update_bias = jax.jit(moe.update_bias, static_argnums=2)
_load_metrics = jax.jit(moe.load_metrics)


def _scores(rng, shape):
  return jax.nn.sigmoid(jnp.asarray(rng.normal(size=shape), jnp.float32))


def _reference_route(scores, bias, top_k, n_group=1, topk_group=1,
                     scale=1.0, renormalize=True):
  """Per token: the `topk_group` groups with the largest sum of their two
  best `scores + bias` (float32, as `route` adds them), then the `top_k`
  best experts of those groups, best first; the weights from the raw
  scores, in float64. Returns (ids, weights) shaped like `scores[..., :k]`.
  """
  scores = np.asarray(scores)
  num = scores.shape[-1]
  per = num // n_group
  sel_all = scores + np.asarray(bias, np.float32)
  ids, weights = [], []
  for s, sel in zip(scores.reshape(-1, num), sel_all.reshape(-1, num),
                    strict=True):
    group_score = [np.sort(sel[g * per:(g + 1) * per])[-2:].sum()
                   for g in range(n_group)]
    allowed = np.full(num, -np.inf, np.float32)
    for g in np.argsort(group_score, kind="stable")[::-1][:topk_group]:
      allowed[g * per:(g + 1) * per] = sel[g * per:(g + 1) * per]
    chosen = np.argsort(-allowed, kind="stable")[:top_k]
    w = s[chosen].astype(np.float64)
    if renormalize:
      w = w / w.sum()
    ids.append(chosen)
    weights.append(w * scale)
  shape = scores.shape[:-1] + (top_k,)
  return (np.reshape(ids, shape), np.reshape(weights, shape))


# (experts, top-k, groups, groups kept): plain top-k; groups of 2; groups of
# 4 (where the two best of a group differ from its best three or its best
# one); two groups of 4; groups of one expert (each group's score is its
# expert's, so that the kept groups hold the best experts: the groups do
# not change the selection).
ROUTINGS = [(8, 3, 1, 1), (8, 3, 4, 2), (12, 4, 3, 1), (8, 2, 2, 1),
            (4, 2, 4, 2)]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num,top_k,n_group,topk_group", ROUTINGS)
def test_route_matches_a_per_token_reference(num, top_k, n_group,
                                             topk_group, renormalize):
  """[4,16,E] scores (leading token dims kept) with a bias that changes the
  selection: the ids exactly, best first; the weights within
  `WEIGHT_RTOL`."""
  rng = np.random.default_rng(num * 100 + n_group * 10 + topk_group)
  scores = _scores(rng, (4, 16, num))
  bias = jnp.asarray(rng.normal(size=num) * 0.3, jnp.float32)
  idx, w = _route(scores, bias, top_k, n_group=n_group,
                     topk_group=topk_group, routed_scaling_factor=SCALE,
                     renormalize=renormalize)
  want_idx, want_w = _reference_route(scores, bias, top_k, n_group,
                                      topk_group, SCALE, renormalize)
  assert idx.dtype == jnp.int32 and w.dtype == jnp.float32
  np.testing.assert_array_equal(idx, want_idx)
  np.testing.assert_allclose(w, want_w, rtol=WEIGHT_RTOL, atol=0)
  # The bias and the groups (of more than one expert) both change the
  # selection of some tokens.
  unbiased, _ = _reference_route(scores, np.zeros(num), top_k, n_group,
                                 topk_group)
  assert np.any(unbiased != want_idx)
  if topk_group < n_group and num > n_group:
    ungrouped, _ = _reference_route(scores, bias, top_k)
    assert np.any(ungrouped != want_idx)


def test_route_defaults_are_plain_top_k_renormalised_and_one_group_kept():
  rng = np.random.default_rng(1)
  scores = _scores(rng, (2, 8, E))
  bias = jnp.asarray(rng.normal(size=E) * 0.3, jnp.float32)
  idx, w = _route(scores, bias, K)
  want_idx, want_w = _reference_route(scores, bias, K)
  np.testing.assert_array_equal(idx, want_idx)
  np.testing.assert_allclose(w, want_w, rtol=WEIGHT_RTOL, atol=0)
  idx, _ = _route(scores, bias, 2, n_group=N_GROUP)
  np.testing.assert_array_equal(
      idx, _reference_route(scores, bias, 2, N_GROUP, 1)[0])


def test_route_options_are_keyword_only():
  scores = jnp.full((2, E), 0.5, jnp.float32)
  with pytest.raises(TypeError, match="positional"):
    moe.route(scores, jnp.zeros(E), K, N_GROUP)


def test_weights_of_tiny_scores_are_finite_as_deepseek_v3s():
  """The renormalised weights are DeepSeek-V3's `s / (sum(s) + 1e-20)`: a
  sigmoid score underflows to 0 for very negative logits, and a token
  whose picks all scored 0 gets weights 0, not NaN; one whose picks sum
  to 1e-20 gets half the weight, not infinity."""
  scores = jnp.zeros((3, E), jnp.float32).at[1, 5].set(0.5)
  scores = scores.at[2, 2].set(1e-20)
  _, w = _route(scores, jnp.zeros(E), K, routed_scaling_factor=SCALE)
  np.testing.assert_array_equal(
      w, [[0, 0, 0], [SCALE, 0, 0], [SCALE / 2, 0, 0]])


def test_bias_changes_routing_not_combine_weights():
  rng = np.random.default_rng(2)
  scores = _scores(rng, (64, E))
  idx0, w0 = _route(scores, jnp.zeros(E), K, routed_scaling_factor=SCALE)
  bias = jnp.zeros(E).at[0].set(10.0)   # expert 0 always selected
  idx1, w1 = _route(scores, bias, K, routed_scaling_factor=SCALE)
  assert np.all(np.any(np.asarray(idx1) == 0, axis=1))
  assert np.any(np.asarray(idx0) != np.asarray(idx1))
  for idx, w in ((idx0, w0), (idx1, w1)):
    raw = jnp.take_along_axis(scores, idx, axis=1)
    np.testing.assert_allclose(w, raw / raw.sum(-1, keepdims=True) * SCALE,
                               rtol=1e-6)
    np.testing.assert_allclose(w.sum(-1), SCALE, rtol=1e-6)


def test_no_gradient_reaches_the_bias_through_the_weights():
  rng = np.random.default_rng(3)
  scores = _scores(rng, (16, E))
  bias = jnp.asarray(rng.normal(size=E) * 0.3, jnp.float32)
  cot = jnp.asarray(rng.normal(size=(16, K)), jnp.float32)
  loss = lambda s, b: jnp.sum(_route(s, b, K, n_group=N_GROUP,
                                        topk_group=TOPK_GROUP)[1] * cot)
  g_scores, g_bias = jax.grad(loss, argnums=(0, 1))(scores, bias)
  np.testing.assert_array_equal(g_bias, np.zeros(E))
  assert np.any(np.asarray(g_scores) != 0)


def test_route_and_load_keep_leading_token_dims():
  """[B,T,E] scores route as their [M,E] rows (group-limited too)."""
  rng = np.random.default_rng(5)
  scores = _scores(rng, (3, 5, E))
  bias = jnp.asarray(rng.normal(size=E) * 0.1, jnp.float32)
  valid = jnp.asarray(rng.uniform(size=(3, 5)) > 0.3)
  kw = dict(n_group=N_GROUP, topk_group=TOPK_GROUP,
            routed_scaling_factor=SCALE)
  idx, w = _route(scores, bias, K, **kw)
  idx_flat, w_flat = _route(scores.reshape(-1, E), bias, K, **kw)
  assert idx.shape == w.shape == (3, 5, K)
  np.testing.assert_array_equal(idx.reshape(-1, K), idx_flat)
  np.testing.assert_array_equal(w.reshape(-1, K), w_flat)
  np.testing.assert_array_equal(
      _expert_load(idx, E, valid),
      _expert_load(idx_flat, E, valid.reshape(-1)))


def test_weights_without_renormalisation_are_the_raw_scores():
  rng = np.random.default_rng(3)
  scores = _scores(rng, (16, E))
  idx, w = _route(scores, jnp.zeros(E), K, routed_scaling_factor=SCALE,
                     renormalize=False)
  np.testing.assert_array_equal(
      w, jnp.take_along_axis(scores, idx, axis=1) * SCALE)


def test_expert_load_counts_the_valid_tokens_pairs():
  """[B,T,A] ids: every (token, expert) pair counts once, padding none."""
  rng = np.random.default_rng(4)
  idx = np.stack([rng.permutation(E)[:K] for _ in range(15)]).reshape(
      3, 5, K)
  valid = rng.uniform(size=(3, 5)) > 0.3
  assert 0 < valid.sum() < valid.size
  load = _expert_load(jnp.asarray(idx), E)
  assert load.dtype == jnp.float32
  np.testing.assert_array_equal(load, np.bincount(idx.ravel(), minlength=E))
  np.testing.assert_array_equal(
      _expert_load(jnp.asarray(idx), E, jnp.asarray(valid)),
      np.bincount(idx[valid].ravel(), minlength=E))
  np.testing.assert_array_equal(
      _expert_load(jnp.asarray(idx), E, jnp.zeros((3, 5), bool)),
      np.zeros(E))


def test_update_bias_steps_each_expert_toward_the_mean_load():
  """`rate` up below the mean, down above it, unchanged at it; per row of
  a stacked [N,E] load; the bias keeps its dtype."""
  bias = np.float32([0.5, -0.25, 0.0, 1.0])
  load = np.float32([1, 2, 3, 6])                  # mean 3
  np.testing.assert_array_equal(
      _update_bias(jnp.asarray(bias), jnp.asarray(load), 0.125),
      [0.625, -0.125, 0.0, 0.875])
  rows = np.float32([[4, 0, 2, 2], [1, 1, 1, 9], [5, 5, 5, 5]])
  got = _update_bias(jnp.zeros((3, 4)), jnp.asarray(rows, jnp.int32),
                        0.02)
  np.testing.assert_array_equal(
      got, np.float32(0.02) * np.float32([[-1, 1, 0, 0], [1, 1, 1, -1],
                                          [0, 0, 0, 0]]))
  half = _update_bias(jnp.asarray(bias, jnp.bfloat16), jnp.asarray(load),
                         0.125)
  assert half.dtype == jnp.bfloat16
  np.testing.assert_array_equal(half.astype(jnp.float32),
                                [0.625, -0.125, 0.0, 0.875])


def test_bias_update_moves_load_toward_uniform():
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(512, E)) + np.linspace(3.0, -3.0, E)  # skewed
  scores = jax.nn.sigmoid(jnp.asarray(logits, jnp.float32))
  bias = jnp.zeros(E)

  @jax.jit
  def step(bias):
    idx, _ = moe.route(scores, bias, 2)
    load = moe.expert_load(idx, E)
    return moe.update_bias(bias, load, 0.02), load

  _, load0 = step(bias)
  for _ in range(300):
    bias, load = step(bias)
  frac0 = np.asarray(load0) / np.sum(load0)
  frac = np.asarray(load) / np.sum(load)
  assert frac0.max() > 3 / E and frac0.min() < 0.2 / E
  assert frac.max() < 1.5 / E and frac.min() > 0.5 / E, frac
  # Over-loaded experts were pushed down, under-loaded ones up.
  assert bias[0] < 0 < bias[-1]


def _bias_params(rng, stacked_rows):
  """Parameters with selection biases at `layer_0/moe`, `layer_2/moe` and
  a scanned `scan/moe` of `stacked_rows` repeats, and other entries."""
  bias = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return {"layer_0/moe": {moe.BIAS_NAME: bias(4), "router": bias(2, 4)},
          "layer_1/mlp": {"w": bias(2, 2)},
          "layer_2/moe": {moe.BIAS_NAME: bias(4), "router": bias(2, 4)},
          "scan/moe": {moe.BIAS_NAME: bias(stacked_rows, 4)}}


def test_selection_biases_move_from_before_the_step_by_their_rows_load():
  """Each bias is its value before the step (`old_params`), moved by its
  own rows of the load: one row for a layer, the listed rows in order for
  a scanned slot; everything else is the optimizer's update; nothing is
  modified in place."""
  rng = np.random.default_rng(6)
  old = _bias_params(rng, 2)
  params = _bias_params(rng, 2)      # the optimizer's, biases moved too
  before = jax.tree.map(np.asarray, params)
  load = jnp.asarray(rng.permutation(20).reshape(5, 4), jnp.float32)
  slots = [moe.BiasSlot("layer_2/moe", (3,), False),
           moe.BiasSlot("scan/moe", (4, 1), True),
           moe.BiasSlot("layer_0/moe", (0,), False)]
  new = moe.update_selection_biases(params, old, load, slots, 0.5)
  for module, rows in (("layer_0/moe", 0), ("layer_2/moe", 3),
                       ("scan/moe", [4, 1])):
    np.testing.assert_array_equal(
        new[module][moe.BIAS_NAME],
        _update_bias(old[module][moe.BIAS_NAME], load[rows, :], 0.5),
        err_msg=module)
  assert new["layer_0/moe"]["router"] is params["layer_0/moe"]["router"]
  assert new["layer_1/mlp"] is params["layer_1/mlp"]
  assert type(new) is dict
  jax.tree.map(np.testing.assert_array_equal, params, before)


def test_selection_biases_keep_a_dict_subclass_and_read_other_mappings():
  rng = np.random.default_rng(7)
  old = _bias_params(rng, 1)
  slots = [moe.BiasSlot("scan/moe", (0,), True)]
  load = jnp.ones((1, 4), jnp.float32)
  ordered = collections.OrderedDict(_bias_params(rng, 1))
  new = moe.update_selection_biases(ordered, old, load, slots, 0.1)
  assert type(new) is collections.OrderedDict
  assert list(new) == list(ordered)
  read_only = types.MappingProxyType(_bias_params(rng, 1))
  new = moe.update_selection_biases(read_only, old, load, slots, 0.1)
  assert type(new) is dict
  np.testing.assert_array_equal(new["scan/moe"][moe.BIAS_NAME],
                                old["scan/moe"][moe.BIAS_NAME])


def test_load_metrics_are_each_layers_fractions():
  """Over [layers, E] loads: the largest and smallest fraction of a layer's
  routed pairs, and the worst layer's max / mean (E times its largest
  fraction); a layer with no pair (all padding) reads 0, not NaN, and a
  layer of one pair has fraction 1."""
  load = jnp.asarray([[2, 6, 0, 0, 0], [3, 3, 3, 3, 4],
                      [0, 0, 0, 0, 0]], jnp.float32)
  got = _load_metrics(load)
  assert set(got) == {"moe_load_max", "moe_load_min", "moe_load_imbalance"}
  np.testing.assert_allclose(got["moe_load_max"], 0.75, rtol=0)
  np.testing.assert_allclose(got["moe_load_min"], 0.0, rtol=0)
  np.testing.assert_allclose(got["moe_load_imbalance"], 3.75, rtol=0)
  got = _load_metrics(jnp.asarray([[0, 1, 0, 0, 0], [4, 4, 4, 4, 4]],
                                     jnp.float32))
  np.testing.assert_allclose(got["moe_load_max"], 1.0, rtol=0)
  np.testing.assert_allclose(got["moe_load_min"], 0.0, rtol=0)
  np.testing.assert_allclose(got["moe_load_imbalance"], 5.0, rtol=0)
  got = _load_metrics(jnp.asarray([[1, 3, 2, 2], [2, 2, 2, 2],
                                      [4, 4, 5, 3]], jnp.float32))
  np.testing.assert_allclose(got["moe_load_max"], 0.375, rtol=0)
  np.testing.assert_allclose(got["moe_load_min"], 0.125, rtol=0)
  np.testing.assert_allclose(got["moe_load_imbalance"], 1.5, rtol=0)


def test_exchange_capacity():
  """`M * min(A, E)` pairs without a factor (a token's A experts are
  distinct, so at most E of them on one device); with one,
  `ceil(c * M * A / n)` within that bound, and never below one pair."""
  assert moe.exchange_capacity(6, 2, 4, 4) == 12
  assert moe.exchange_capacity(6, 3, 2, 4) == 12
  assert moe.exchange_capacity(6, 2, 2, 4, 0.5) == 2       # 1.5 rounds up
  assert moe.exchange_capacity(6, 2, 2, 4, 1.0) == 3       # exactly 3
  assert moe.exchange_capacity(7, 3, 2, 2, 1.5) == 14      # 16 > 7 * 2
  assert moe.exchange_capacity(6, 2, 2, 4, 100.0) == 12
  assert moe.exchange_capacity(6, 2, 2, 4, 1e-6) == 1
  assert moe.exchange_capacity(6, 2, 2, 4, 0.0) == 1


@pytest.mark.parametrize("dims", [
    dict(num_experts=1, num_experts_per_tok=1),
    dict(num_experts=8, num_experts_per_tok=8),
    dict(num_experts=8, num_experts_per_tok=1, n_group=8, topk_group=8),
    # The kept groups hold exactly the top-k: 2 groups of 2, 2 of 3.
    dict(num_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2),
    dict(num_experts=12, num_experts_per_tok=6, n_group=4, topk_group=2),
    dict(num_experts=8, num_experts_per_tok=4, n_group=2, topk_group=1),
])
def test_router_dims_at_their_bounds_are_accepted(dims):
  moe.check_dims(**dims)


_FEWER = "topk_group groups hold fewer experts than num_experts_per_tok."


@pytest.mark.parametrize("dims,message", [
    (dict(num_experts=0, num_experts_per_tok=1),
     "need 1 <= num_experts_per_tok <= num_experts, got 1, 0."),
    (dict(num_experts=4, num_experts_per_tok=0),
     "need 1 <= num_experts_per_tok <= num_experts, got 0, 4."),
    (dict(num_experts=4, num_experts_per_tok=5),
     "need 1 <= num_experts_per_tok <= num_experts, got 5, 4."),
    (dict(num_experts=8, num_experts_per_tok=2, n_group=3),
     "n_group 3 must divide num_experts 8."),
    (dict(num_experts=6, num_experts_per_tok=2, n_group=4),
     "n_group 4 must divide num_experts 6."),
    (dict(num_experts=2, num_experts_per_tok=1, n_group=4),
     "n_group 4 must divide num_experts 2."),
    (dict(num_experts=8, num_experts_per_tok=2, n_group=0),
     "n_group 0 must divide num_experts 8."),
    (dict(num_experts=8, num_experts_per_tok=2, n_group=-1),
     "n_group -1 must divide num_experts 8."),
    (dict(num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=0),
     "need 1 <= topk_group <= n_group, got 0, 4."),
    (dict(num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=5),
     "need 1 <= topk_group <= n_group, got 5, 4."),
    (dict(num_experts=8, num_experts_per_tok=2, topk_group=2),
     "need 1 <= topk_group <= n_group, got 2, 1."),
    (dict(num_experts=8, num_experts_per_tok=5, n_group=4, topk_group=2),
     _FEWER),
    (dict(num_experts=12, num_experts_per_tok=7, n_group=4, topk_group=2),
     _FEWER),
    (dict(num_experts=8, num_experts_per_tok=5, n_group=2, topk_group=1),
     _FEWER),
])
def test_bad_router_dims_name_the_broken_rule(dims, message):
  with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
    moe.check_dims(**dims)


@pytest.mark.parametrize("num_shared", [0, 1, 3])
def test_param_count_is_the_layers_parameter_count(num_shared):
  d, num, f = 5, 7, 3
  layer = hk.transform(lambda x: moe.MoE(
      num, 2, f, num_shared_experts=num_shared, name="moe")(x))
  shapes = jax.eval_shape(layer.init, jax.random.key(0),
                          jnp.zeros((1, 2, d), jnp.float32))
  assert moe.param_count(d, num, f, num_shared) == sum(
      int(np.prod(p.shape)) for p in jax.tree.leaves(shapes))


def test_inverse_of_a_permutation():
  order = jnp.asarray(np.random.default_rng(8).permutation(11), jnp.int32)
  inverse = moe._inverse(order)   # pylint: disable=protected-access
  assert inverse.dtype == jnp.int32
  np.testing.assert_array_equal(inverse[order], np.arange(11))
  np.testing.assert_array_equal(order[inverse], np.arange(11))
