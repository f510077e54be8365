"""Tests of kda_lm/stack.py: the scanned layer group, the parameter layouts
and the rematerialisation policies."""

import collections
import contextlib
import functools
import io

import haiku as hk
import helpers
import jax
from jax import ad_checkpoint
import jax.extend
import jax.numpy as jnp
import kda_support
import numpy as np
import pytest

from configs import ling3
from kda_lm import config, model, optimizer, stack
from kda_lm.checkpoint import compat
from kda_lm.infer import decoding
from testbed import numerics

# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

# Dense layers 0-1, then the group KM three times (layers 2-7); MTP block.
_STACK = dict(
    attention_pattern="KMKMKMKM", num_experts=4, num_experts_per_tok=2,
    num_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=2,
    num_mtp_layers=1, mtp_layer_kind="K")
UNSCANNED = helpers.tiny_model(**_STACK)
SCANNED = helpers.tiny_model(**_STACK, scan_layers=True)
_cfg = helpers.tiny_model


def test_find_group_of_the_published_stacks():
  tiny = config.ModelConfig.from_config(ling3.model_config("tiny"))
  # Layer 0 is dense: the unrolled head is the first whole group.
  assert stack.find_group(tiny) == stack.LayerPlan(
      (0, 1, 2, 3), 4, 4, 5, ())
  flash = config.ModelConfig.from_config(ling3.model_config("flash"))
  assert stack.find_group(flash) == stack.LayerPlan(
      tuple(range(6)), 6, 6, 6, ())
  # Kimi Linear: MLA at layers 4, 8, ..., 24 and 27 (1-based), layer 0
  # dense: 3 layers stay unrolled (the group KMKK from layer 2 beats KKMK
  # from layer 1 by ending nearer the end).
  kimi = _cfg(attention_pattern="KKKM" * 6 + "KKM", first_k_dense_replace=1)
  assert stack.find_group(kimi) == stack.LayerPlan((0, 1), 2, 4, 6, (26,))


def test_find_group_without_a_repeat_unrolls_everything():
  plan = stack.find_group(_cfg(attention_pattern="KMK", num_experts=0))
  assert plan == stack.LayerPlan((0, 1, 2), 3, 0, 0, ())
  # A group may be one layer long.
  plan = stack.find_group(_cfg(attention_pattern="KKKM"))
  assert plan == stack.LayerPlan((0,), 1, 1, 2, (3,))
  # scan_layers off: the same stack unrolled.
  cfg = _cfg(attention_pattern="KMKM", num_experts=0)
  assert stack.find_group(cfg) == stack.LayerPlan((), 0, 2, 2, ())
  assert stack.layer_plan(cfg) == stack.LayerPlan((0, 1, 2, 3), 4, 0, 0, ())


def test_find_group_of_short_stacks_halves_and_ties():
  plan = lambda pattern: stack.find_group(
      _cfg(attention_pattern=pattern, num_experts=0))
  # Two or three layers still make a group of one layer repeated twice.
  assert plan("KK") == stack.LayerPlan((), 0, 1, 2, ())
  assert plan("KKM") == stack.LayerPlan((), 0, 1, 2, (2,))
  # A group may be half the stack, of an odd length too.
  assert plan("KKMKKM") == stack.LayerPlan((), 0, 3, 2, ())
  # KKK then MM: scanning KKK leaves 2 layers unrolled, MM 3.
  assert plan("KKKMM") == stack.LayerPlan((), 0, 1, 3, (3, 4))
  # KM from layer 0 and MK from layer 1 leave one layer each: the tie
  # goes to the fewest trailing layers.
  assert plan("KMKMK") == stack.LayerPlan((0,), 1, 2, 2, ())


def _batch(seed, B=2, T=24):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, helpers.VOCAB, (B, T)).astype(np.int32)
  seg = np.stack([kda_support.random_segment_row(rng, T) for _ in range(B)])
  return jnp.asarray(tokens), jnp.asarray(seg)


@functools.lru_cache(maxsize=None)
def _params():
  tokens, seg = _batch(0)
  init = jax.jit(model.build(UNSCANNED).init)
  return init(jax.random.key(1), tokens, seg)


def test_layouts_round_trip_bit_exactly():
  params = _params()
  scanned = stack.to_scanned(params, UNSCANNED)
  tokens, seg = _batch(0)
  want = jax.eval_shape(model.build(SCANNED).init, jax.random.key(1),
                        tokens, seg)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), scanned) == (
      jax.tree.map(lambda a: (a.shape, a.dtype), want))
  assert scanned["scanned/slot_0/kda/q_proj"]["w"].shape[0] == 3
  # The scanned model starts from the same parameters.
  init = jax.jit(model.build(SCANNED).init)
  jax.tree.map(np.testing.assert_array_equal,
               init(jax.random.key(1), tokens, seg), scanned)
  back = stack.to_unscanned(scanned, SCANNED)
  jax.tree.map(np.testing.assert_array_equal, back, params)
  assert stack.to_layout(params, SCANNED).keys() == scanned.keys()
  assert stack.to_layout(scanned, UNSCANNED).keys() == params.keys()
  with pytest.raises(ValueError, match="missing"):
    stack.to_scanned({k: v for k, v in params.items()
                      if not k.startswith("layer_5/")}, SCANNED)


def _loss(m, params, tokens, seg):
  logits, aux = m.apply(params, tokens, seg, return_aux=True)
  return (logits ** 2).mean() + (aux["mtp_logits"] ** 2).mean(), aux


def test_scanned_equals_unscanned_logits_loads_and_gradients():
  params, (tokens, seg) = _params(), _batch(2)
  grad = lambda m, p: jax.jit(jax.grad(
      functools.partial(_loss, m), has_aux=True))(p, tokens, seg)
  g_u, aux_u = grad(model.build(UNSCANNED), params)
  g_s, aux_s = grad(model.build(SCANNED), stack.to_scanned(params, SCANNED))
  np.testing.assert_array_equal(aux_s["expert_load"], aux_u["expert_load"])
  assert aux_u["expert_load"].shape == (7, 4)  # layers 2-7, then MTP
  assert numerics.rel_err(aux_s["mtp_logits"], aux_u["mtp_logits"]) < 1e-6
  g_s = stack.to_unscanned(g_s, SCANNED)
  for module in g_u:
    for name in g_u[module]:
      err = numerics.rel_err(g_s[module][name], g_u[module][name])
      assert err < 1e-6, (module, name, err)


def test_scanned_generation_equals_unscanned_token_for_token():
  params = _params()
  prompts = [[3, 4, 5, 6, 7], [9, 8]]
  out = {}
  for name, cfg, p in (("u", UNSCANNED, params),
                       ("s", SCANNED, stack.to_scanned(params, SCANNED))):
    out[name] = decoding.generate(decoding.Decoder(cfg, 16), p, prompts,
                                  max_new_tokens=8)
  assert out["s"] == out["u"]


def test_router_bias_slots_name_rows_of_the_expert_load():
  slots = model.router_bias_slots(SCANNED)
  assert [(s.module, s.rows, s.stacked) for s in slots] == [
      ("scanned/slot_0/moe", (0, 2, 4), True),
      ("scanned/slot_1/moe", (1, 3, 5), True),
      ("mtp_0/block/moe", (6,), False)]
  assert [s.module for s in model.router_bias_slots(UNSCANNED)] == (
      model.router_bias_modules(UNSCANNED))


# ---------------------------------------------------------------------------
# Rematerialisation.


def _remat_grad(remat, cfg, params, tokens, seg):
  m = model.build(cfg, remat=remat)
  return jax.jit(jax.grad(
      lambda p: (m.apply(p, tokens, seg) ** 2).mean()))


def _flat(tree):
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


def _ulp_floor(grad_fn, params, seeds=(0, 1)):
  """How far the gradient moves when every parameter moves by one float32
  ulp (relative 2^-23, random sign): the rounding any float32 recompute
  can cause, measured on this host."""
  base = _flat(grad_fn(params))
  floor = 0.0
  for seed in seeds:
    rng = np.random.default_rng(seed)
    nudged = jax.tree.map(lambda x, r=rng: x * (1 + np.float32(
        2.0 ** -23) * r.choice(np.array([-1, 1], np.float32), x.shape)),
                          params)
    floor = max(floor, numerics.rel_err(_flat(grad_fn(nudged)), base))
  return floor


def test_the_decay_mask_is_the_same_in_either_layout():
  """Scanned training equals unrolled when the gradients do (above) and
  every parameter gets the same optimizer rule: the weight-decay mask,
  decided by rank and name, must not change when a layer's parameters
  are stacked (a stacked bias has rank 2)."""
  params = _params()
  scanned = stack.to_scanned(params, UNSCANNED)
  filled = lambda mask, p: jax.tree.map(
      lambda b, a: np.full(a.shape, b), mask, p)
  got = stack.to_unscanned(
      filled(optimizer.weight_decay_mask(scanned), scanned), SCANNED)
  want = filled(optimizer.weight_decay_mask(params), params)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert not all(jax.tree.leaves(optimizer.weight_decay_mask(scanned)))


# The remat test's stack: the group KM twice, scanned, with the MTP block
# (the policies act on the scanned layers; fewer layers than the others'
# stack, since it compiles the gradient once per policy).
# The remat policies wrap the decoder layers only: no MTP layer here.
_REMAT = helpers.tiny_model(**dict(_STACK, attention_pattern="KMKM",
                                   first_k_dense_replace=0,
                                   num_mtp_layers=0),
                            scan_layers=True)


def test_remat_policies_keep_gradients_and_save_less_and_less():
  # Not bit-identical: the recomputed forward fuses (and vectorises exp and
  # log) differently, so activations differ by an ulp. Measured on this
  # stack: 5.7e-7 relative over all parameters, up to 1.3e-6 on a leaf,
  # while a one-ulp nudge of the parameters alone moves this gradient by
  # 1.4e-6 (on the 8-layer stack with MTP: 2.0e-6 to 2.4e-6 against a
  # floor of 3.1e-6 to 3.9e-6). So the bound is that floor, measured in
  # the same run, not a fixed 1e-6.
  tokens, seg = _batch(3, B=4, T=64)
  params = jax.jit(model.build(_REMAT).init)(jax.random.key(1), tokens, seg)
  temp, grads = {}, {}
  for remat in config.REMAT_POLICIES:
    compiled = _remat_grad(remat, _REMAT, params, tokens, seg).lower(
        params).compile()
    temp[remat] = compiled.memory_analysis().temp_size_in_bytes
    grads[remat] = compiled(params)
    if remat == "none":
      floor = _ulp_floor(compiled, params)
      assert 1e-7 < floor < 1e-5, floor
    err = numerics.rel_err(_flat(grads[remat]), _flat(grads["none"]))
    assert err < floor, (remat, err, floor)
    errs = jax.tree.map(numerics.rel_err, grads[remat], grads["none"])
    assert max(jax.tree.leaves(errs)) < 1e-5, remat
  sizes = [temp[r] for r in config.REMAT_POLICIES]
  assert sizes == sorted(sizes, reverse=True), temp
  assert temp["full"] < temp["none"], temp


def _residuals(remat: str, in_scan: bool) -> collections.Counter:
  """What a layer under `remat` keeps for its backward pass, as JAX lists
  it (`print_saved_residuals`): each residual's source ("argument",
  "output of dot_general", "named 'mixer_out'"...), counted."""

  def layer(x, w):
    h = ad_checkpoint.checkpoint_name(jnp.sin(x @ w), stack.MIXER_OUT)
    y = ad_checkpoint.checkpoint_name(jnp.cos(h) @ w, stack.FFN_OUT)
    return jnp.tanh(y * h)

  f = hk.without_apply_rng(hk.transform(
      lambda x, w: stack.rematted(layer, remat, in_scan=in_scan)(x, w)))
  listing = io.StringIO()
  with contextlib.redirect_stdout(listing):
    ad_checkpoint.print_saved_residuals(lambda x, w: f.apply({}, x, w),
                                        jnp.ones((4, 8)), jnp.ones((8, 8)))
  return collections.Counter(
      "argument" if " from the argument " in line else
      line.split(" ", 1)[1].split(" from ")[0]
      for line in listing.getvalue().splitlines())


@pytest.mark.parametrize("in_scan", [False, True])
def test_each_policy_keeps_what_its_name_says(in_scan):
  """The residuals of a layer under each policy (the same in a scan): none
  keeps every intermediate, `full` only the layer's inputs, `save_dots`
  the matmuls' outputs, `save_outputs` the named mixer and FFN outputs."""
  inputs = {"argument": 2}
  assert _residuals("full", in_scan) == inputs
  assert _residuals("save_dots", in_scan) == {
      **inputs, "output of dot_general": 2}
  assert _residuals("save_outputs", in_scan) == {
      **inputs, f"named '{stack.MIXER_OUT}'": 1,
      f"named '{stack.FFN_OUT}'": 1}
  # A name built at run time (as from a command line), not the literal.
  kept = _residuals("".join(["no", "ne"]), in_scan)
  assert {"output of sin", "output of tanh", f"named '{stack.MIXER_OUT}'",
          "argument"} <= set(kept), kept


def test_bad_remat_names_the_options():
  with pytest.raises(ValueError, match="remat must be one of"):
    model.build(UNSCANNED, remat="some")
  with pytest.raises(ValueError, match="config.train.remat"):
    config.TrainConfig(remat="dots")
  with pytest.raises(ValueError, match="grad_accum_steps"):
    config.TrainConfig(grad_accum_steps=0)


def test_checkpoint_of_the_other_layout_names_the_way_out():
  params = _params()
  abstract = lambda p: jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), p)
  with pytest.raises(compat.IncompatibleCheckpointError,
                     match="not scanned: resume with "
                     r"--config.model.scan_layers=False.*to_layout"):
    compat.check_compatible(abstract(params),
                            abstract(stack.to_scanned(params, SCANNED)))


def _checkpoints(jaxpr, in_scan=False, out=None):
  """(prevent_cse, inside a scan) of every rematerialised call."""
  out = [] if out is None else out
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("checkpoint", "remat", "remat2"):
      out.append((eqn.params["prevent_cse"], in_scan))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax.extend.core.Jaxpr):
          _checkpoints(sub, in_scan or name == "scan", out)
  return out


@pytest.mark.parametrize("cfg,want", [
    (SCANNED, {(True, False): 2, (False, True): 2}),
    (UNSCANNED, {(True, False): 8}),
])
def test_remat_prevents_cse_outside_a_scan_only(cfg, want):
  """JAX's advice for `jax.checkpoint`: `prevent_cse` on outside a scan
  (else XLA may merge the recomputation with the forward and keep the
  activations after all), off inside one (the scan already keeps them
  apart, and the barriers only cost). The dense layers 0-1 are outside the
  scan, the repeated group's two slots inside."""
  tokens, seg = _batch(0)
  m = model.build(cfg, remat="full")
  params = jax.eval_shape(m.init, jax.random.key(1), tokens, seg)
  jaxpr = jax.make_jaxpr(m.apply)(params, tokens, seg).jaxpr
  assert collections.Counter(_checkpoints(jaxpr)) == want


def test_layer_names_and_their_inverse():
  assert stack.layer_name(12) == "layer_12"
  assert [stack.layer_index(n) for n in (
      "layer_0", "layer_12", "layer_", "layer_x", "mtp_0", "layers_1")] == [
          0, 12, None, None, None, None]


def test_layers_with_other_swiglu_clamps_are_not_scanned_together():
  """Per-layer SwiGLU clamps are static: a layer whose clamps differ from
  its group's repeats cannot share the scan."""
  base = dict(vocab_size=32, d_model=16, attention_pattern="KMKMKMKM",
              num_heads=2, head_dim=8, kv_lora_rank=8, qk_nope_head_dim=4,
              qk_rope_head_dim=4, v_head_dim=4, mlp_hidden_dim=16,
              num_experts=4, num_experts_per_tok=2, scan_layers=True)
  plain = config.ModelConfig(**base)
  clamped = config.ModelConfig(
      **base, expert_swiglu_limits=(0,) * 6 + (4.0, 4.0))
  assert stack.find_group(plain).repeats == 4
  plan = stack.find_group(clamped)
  assert plan.repeats * plan.period <= 6, plan
  assert all(clamped.swiglu_limits(plan.layer(r, j))
             == clamped.swiglu_limits(plan.layer(0, j))
             for r in range(plan.repeats) for j in range(plan.period))
  with pytest.raises(ValueError, match="expert_swiglu_limits"):
    config.ModelConfig(**base, expert_swiglu_limits=(1.0,))
  with pytest.raises(ValueError, match="shared_swiglu_limits"):
    config.ModelConfig(**base, shared_swiglu_limits=(-1.0,) * 8)


# Kimi Linear's plan (see above): layers 0-1 unrolled, the group KMKK from
# layer 2 repeated 6 times, layer 26 unrolled.
_KIMI = dict(attention_pattern="KKKM" * 6 + "KKM", first_k_dense_replace=1)


def _numbered_tree(cfg):
  """An unscanned tree without a model: every leaf of layer i holds i (and
  a second leaf i + 0.5), beside modules outside the layers."""
  tree = {"embed": {"embeddings": np.arange(4.0)},
          "final_norm": {"scale": np.ones(2)}}
  for i in range(cfg.num_layers):
    tree[f"layer_{i}/mixer/q_proj"] = {"w": np.full((2, 3), float(i)),
                                       "b": np.full((3,), i + 0.5)}
    tree[f"layer_{i}"] = {"gate": np.full((1,), float(i))}
  return tree


def test_layouts_of_a_tree_without_a_model():
  """The layout conversion on its own (no model to compile): where each
  layer goes, what stays, and the way back."""
  cfg = _cfg(**_KIMI)
  plan = stack.find_group(cfg)
  assert plan == stack.LayerPlan((0, 1), 2, 4, 6, (26,))
  tree = _numbered_tree(cfg)
  scanned = stack.to_scanned(tree, cfg)
  unrolled = [k for k in tree if stack.layer_index(k.split("/")[0]) in (
      None, 0, 1, 26)]
  assert sorted(scanned) == sorted(
      unrolled + [f"scanned/slot_{j}{rest}" for j in range(4)
                  for rest in ("", "/mixer/q_proj")])
  for module in unrolled:
    assert scanned[module].keys() == tree[module].keys()
    for name, value in tree[module].items():
      np.testing.assert_array_equal(scanned[module][name], value)
  for j in range(4):
    rows = [plan.layer(r, j) for r in range(6)]
    assert rows == list(range(2 + j, 26, 4))
    group = scanned[f"scanned/slot_{j}/mixer/q_proj"]
    assert isinstance(group["w"], np.ndarray)  # numpy stays numpy
    np.testing.assert_array_equal(
        group["w"], np.asarray(rows, float)[:, None, None] * np.ones((2, 3)))
    np.testing.assert_array_equal(
        group["b"], (np.asarray(rows) + 0.5)[:, None] * np.ones(3))
    np.testing.assert_array_equal(
        scanned[f"scanned/slot_{j}"]["gate"], np.asarray(rows, float)[:, None])
  assert stack.is_scanned(scanned) and not stack.is_scanned(tree)
  back = stack.to_unscanned(scanned, cfg)
  assert sorted(back) == sorted(tree)
  for module in tree:
    assert back[module].keys() == tree[module].keys()
    for name, value in tree[module].items():
      np.testing.assert_array_equal(back[module][name], value)
  # to_layout converts to the layout scan_layers asks for, else copies.
  scan_cfg = _cfg(**_KIMI, scan_layers=True)
  for got, want in ((stack.to_layout(tree, scan_cfg), scanned),
                    (stack.to_layout(scanned, cfg), tree),
                    (stack.to_layout(tree, cfg), tree),
                    (stack.to_layout(scanned, scan_cfg), scanned)):
    assert sorted(got) == sorted(want)
    jax.tree.map(np.testing.assert_array_equal, got, want)
  # The tiny stack: its group of 6 layers starts at layer 2.
  assert stack.find_group(UNSCANNED).scanned == range(2, 8)
  scanned = stack.to_scanned(_numbered_tree(UNSCANNED), UNSCANNED)
  assert sorted(k for k in scanned if not k.startswith("scanned/")) == [
      "embed", "final_norm", "layer_0", "layer_0/mixer/q_proj", "layer_1",
      "layer_1/mixer/q_proj"]
  np.testing.assert_array_equal(scanned["scanned/slot_1"]["gate"],
                                [[3.0], [5.0], [7.0]])


def test_stacked_jax_leaves_and_missing_repeats():
  cfg = _cfg(attention_pattern="KMKM", num_experts=0)
  tree = {f"layer_{i}/mlp": {"w": jnp.full((2,), i, jnp.float32)}
          for i in range(4)}
  scanned = stack.to_scanned(tree, cfg)
  assert isinstance(scanned["scanned/slot_1/mlp"]["w"], jax.Array)
  np.testing.assert_array_equal(scanned["scanned/slot_1/mlp"]["w"],
                                [[1, 1], [3, 3]])
  del tree["layer_3/mlp"]
  with pytest.raises(ValueError, match="slot_1/mlp are missing for some "
                     "of the 2 repeats"):
    stack.to_scanned(tree, cfg)
  assert [stack.is_stacked(m) for m in (
      "scanned/slot_0/mlp", "scanned", "scanned_x/mlp", "layer_0/scanned",
      "mtp_0/block")] == [True, True, False, False, False]
