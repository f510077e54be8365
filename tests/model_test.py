"""Tests of kda_lm/model.py: packed == unpacked end to end, causality, grads."""

import functools
import subprocess
import sys

import haiku as hk
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import ling3_tiny
from kda_lm import config, layers, model, ops, optimizer
from kda_lm.layers import moe

VOCAB, T = helpers.VOCAB, helpers.T
LENS, STARTS = helpers.LENS, helpers.STARTS
tiny_config, tiny_model = helpers.tiny_config, helpers.tiny_model
_packed_row, _doc = helpers.packed_row, helpers.doc

# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


CONFIGS = {
    "ling": tiny_model(),
    # Every other option: Kimi gates, NoPE, low-rank query, tied embeddings,
    # no output gate, conv bias, V != K, MLA-first pattern, chunk 32.
    "kimi": tiny_model(kda_gate="kimi", use_nope=True, q_lora_rank=16,
                       tie_embeddings=True, mla_output_gate=False,
                       conv_bias=True, kda_head_v_dim=8,
                       attention_pattern="MKKK", kda_chunk_size=32),
}


@functools.lru_cache(maxsize=None)
def _setup(name):
  m = model.build(CONFIGS[name])
  tokens, seg = _packed_row(0)
  params = jax.jit(m.init)(jax.random.key(0), tokens, seg)
  return params, jax.jit(m.apply)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_equals_unpacked(name):
  params, apply = _setup(name)
  tokens, seg = _packed_row(1)
  packed = np.asarray(apply(params, tokens, seg))
  assert packed.dtype == np.float32 and packed.shape == (1, T, VOCAB)
  for i in range(len(LENS)):
    alone = np.asarray(apply(params, _doc(tokens, i)))
    err = np.abs(_doc(packed, i) - alone).max() / np.abs(alone).max()
    assert err <= 1e-5, (i, err)

  # Changing one document leaves the others bit-identical.
  for i in range(len(LENS)):
    changed = tokens.copy()
    rng = np.random.default_rng(10 + i)
    changed[:, STARTS[i]:STARTS[i] + LENS[i]] = rng.integers(
        0, VOCAB, (1, LENS[i]))
    other = np.asarray(apply(params, changed, seg))
    for j in range(len(LENS)):
      if j != i:
        np.testing.assert_array_equal(_doc(other, j), _doc(packed, j))
    assert np.any(_doc(other, i) != _doc(packed, i))

  # Leak detector: without segment ids the 2nd and 3rd documents change.
  leaky = np.asarray(apply(params, tokens))
  # (The first document sees nothing earlier: equal up to rounding.)
  np.testing.assert_allclose(_doc(leaky, 0), _doc(packed, 0), rtol=1e-5,
                             atol=1e-5)
  for i in (1, 2):
    diff = np.abs(_doc(leaky, i) - _doc(packed, i)).max()
    assert diff > 1e-3 * np.abs(_doc(packed, i)).max(), (i, diff)


def test_causal():
  params, apply = _setup("ling")
  tokens, _ = _packed_row(2)
  base = np.asarray(apply(params, tokens))
  for t in (1, 63, 64, 100):
    changed = tokens.copy()
    changed[0, t] = (changed[0, t] + 1) % VOCAB
    out = np.asarray(apply(params, changed))
    np.testing.assert_array_equal(out[:, :t], base[:, :t])
    assert np.any(out[:, t] != base[:, t])


def test_positions_argument():
  params, apply = _setup("ling")
  tokens, seg = _packed_row(3)
  derived = np.asarray(apply(params, tokens, seg))
  pos = np.asarray(jnp.where(seg == 0, 0,
                             jnp.arange(T) - np.array(STARTS)[
                                 np.maximum(seg - 1, 0)]))
  # Two programs (positions given vs derived): equal up to rounding.
  np.testing.assert_allclose(
      np.asarray(apply(params, tokens, seg, pos.astype(np.int32))), derived,
      rtol=1e-5, atol=1e-5)
  shifted = np.asarray(apply(params, tokens, seg, pos.astype(np.int32) + 5))
  assert np.any(shifted != derived)  # RoPE sees the positions.


def test_gradients_finite_and_reach_every_parameter():
  m = model.build(CONFIGS["ling"])
  params, _ = _setup("ling")
  tokens, seg = _packed_row(4)

  def loss(p):
    logits = m.apply(p, tokens, seg)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]),
                               tokens[:, 1:, None], -1)[..., 0]
    return jnp.sum(nll * (seg[:, 1:] != 0)) / jnp.sum(seg[:, 1:] != 0)

  grads = jax.jit(jax.grad(loss))(params)
  n_bias = 0
  for module, name, g in hk.data_structures.traverse(grads):
    g = np.asarray(g)
    assert np.all(np.isfinite(g)), (module, name)
    if name == moe.BIAS_NAME:   # selection only: steered by load, not grads
      assert np.all(g == 0), (module, name)
      n_bias += 1
    else:
      assert np.any(g != 0), (module, name)
  assert n_bias == 3            # the default config's MoE layers 1-3
  kda_modules = [m_ for m_ in grads if m_.endswith("/kda")]
  assert len(kda_modules) == 3
  for module in kda_modules:
    assert np.all(np.asarray(grads[module]["A_log"]) != 0)
    assert np.all(np.asarray(grads[module]["dt_bias"]) != 0)


@pytest.mark.parametrize("ffn", ["dense", "moe"])
def test_bfloat16_compute(ffn):
  tokens, seg = _packed_row(5)
  if ffn == "moe":
    params, apply = _setup("ling")
    overrides = {}
  else:
    overrides = dict(num_experts=0)
    params = jax.jit(model.build(tiny_model(**overrides)).init)(
        jax.random.key(0), tokens, seg)
    apply = jax.jit(model.build(tiny_model(**overrides)).apply)
  m = model.build(tiny_model(compute_dtype="bfloat16", **overrides))
  ref = np.asarray(apply(params, tokens, seg))
  out = np.asarray(jax.jit(m.apply)(params, tokens, seg))
  assert out.dtype == np.float32 and np.all(np.isfinite(out))
  valid = seg[0] != 0
  err = np.abs(out[0, valid] - ref[0, valid]).max(-1) / np.abs(ref).max()
  if ffn == "dense":
    assert err.max() < 0.1, err.max()
  else:
    # bfloat16 activations can flip a near-tie top-k choice of the (float32)
    # router, which changes that token's output by a whole expert (4.4% of
    # the tokens here); the others stay within 10% of the float32 logits.
    assert np.mean(err >= 0.1) <= 0.1, (np.mean(err >= 0.1), err)
    assert np.median(err) < 0.02, np.median(err)
  init_params = jax.eval_shape(m.init, jax.random.key(0), tokens)
  assert {p.dtype for p in jax.tree.leaves(init_params)} == {
      np.dtype(np.float32)}


def test_param_count_and_summary():
  cfg = config.ModelConfig.from_config(ling3_tiny.get_config().model)
  params = model.abstract_params(cfg)
  n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  assert n == model.param_count(cfg)
  for name, c in CONFIGS.items():
    params = model.abstract_params(c)
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)) == (
        model.param_count(c)), name
  shapes = {f"{m}/{k}": p.shape for m, k, p in
            hk.data_structures.traverse(params)}
  assert shapes["embed/embeddings"] == (VOCAB, 32)
  assert "lm_head/w" not in shapes  # tied
  mask = optimizer.weight_decay_mask(model.abstract_params(cfg))
  assert not mask["layer_0/kda"]["A_log"] and not mask["layer_0/kda"][
      "dt_bias"]
  assert mask["layer_0/kda/q_proj"]["w"] and not mask["final_norm"]["weight"]
  out = subprocess.run(
      [sys.executable, "-m", "kda_lm.model",
       "--config=configs/ling3_tiny.py", "--noshapes"],
      capture_output=True, text=True, check=True).stdout
  assert f"{model.param_count(cfg):,}" in out
  assert "layer_3" in out and "MLA" in out and "KDA (ling)" in out


def test_ling_pattern():
  assert model.ling_pattern(4, 4) == "KKKM"
  assert model.ling_pattern(6, 4) == "KKKMKM"
  assert model.ling_pattern(24, 4) == "KKKM" * 6
  assert model.ling_pattern(3, 1) == "MMM"


@pytest.mark.parametrize("overrides,match", [
    (dict(attention_pattern=""), "attention_pattern"),
    (dict(attention_pattern="KKXM"), "invalid characters"),
    (dict(qk_rope_head_dim=7), "even"),
    (dict(qk_nope_head_dim=0, qk_rope_head_dim=0), "qk_nope_head_dim"),
    (dict(head_dim=0), "head_dim"),
    (dict(kda_gate="mamba"), "kda_gate"),
    (dict(kda_impl="cuda"), "impl"),
    (dict(compute_dtype="float64"), "compute_dtype"),
])
def test_bad_config(overrides, match):
  with pytest.raises(ValueError, match=match):
    model.build(tiny_model(**overrides))


def test_bad_inputs():
  m = model.build(CONFIGS["ling"])
  tokens = np.zeros((2, 8), np.int32)
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="segment_ids"):
    m.init(key, tokens, np.ones((2, 7), np.int32))
  with pytest.raises(ValueError, match="positions"):
    m.init(key, tokens, None, np.ones((8,), np.int32))
  with pytest.raises(ValueError, match="segment_ids must be an integer"):
    m.init(key, tokens, np.ones((2, 8), np.float32))
  with pytest.raises(ValueError, match="tokens must be"):
    m.init(key, np.zeros((8,), np.int32))
  with pytest.raises(ValueError, match=r"\[0, 32\)"):
    m.init(key, tokens + VOCAB)
  # Under jit an out-of-range id cannot raise: it reads NaN, never clips.
  params, apply = _setup("ling")
  bad, seg = _packed_row(6)
  bad[0, 5] = -1
  assert np.all(np.isnan(np.asarray(apply(params, bad, seg))[0, 5]))


def test_an_untyped_model_config_is_refused_naming_the_fix():
  """The library takes the model's settings typed: a `model` ConfigDict
  or dict is refused by `config.typed_model` with what to pass."""
  fix = r"pass kda_lm\.config\.ModelConfig\.from_config\(config\.model\)"
  for untyped in (tiny_config(), {"vocab_size": 8}):
    with pytest.raises(TypeError, match="kda_lm.model.build takes a "
                       "kda_lm.config.ModelConfig, got .*: " + fix):
      model.build(untyped)
  assert config.typed_model(CONFIGS["ling"], "x") is CONFIGS["ling"]


def test_packed_documents_get_their_own_rope_positions(monkeypatch):
  """Without a `positions` argument, each document's RoPE positions (and
  rotated q/k) in every MLA layer are the ones it gets alone. RoPE is
  relative, so the logits alone would barely show a document shifted to its
  row offset."""
  run = helpers.record_rope(monkeypatch)
  m = model.build(tiny_model(attention_pattern="MM"))
  # Row 0 packed; row 1 + i: document i alone at the row start, padded.
  packed_tokens, packed_seg = _packed_row(5)
  tokens, seg = [packed_tokens[0]], [packed_seg[0]]
  for i, n in enumerate(LENS):
    tokens.append(np.pad(_doc(packed_tokens, i)[0], (0, T - n)))
    seg.append(np.pad(np.ones(n, np.int32), (0, T - n)))
  tokens, seg = np.stack(tokens), np.stack(seg)
  params = jax.jit(m.init)(jax.random.key(0), tokens, seg)
  calls = run(m.apply, params, tokens, seg)
  assert len(calls) == 4                       # q and k of two MLA layers
  for pos, rotated in calls:
    for i, n in enumerate(LENS):
      np.testing.assert_array_equal(_doc(pos[:1], i)[0], np.arange(n))
      np.testing.assert_array_equal(pos[1 + i, :n], np.arange(n))
      alone = rotated[1 + i, :n]
      err = np.abs(_doc(rotated[:1], i)[0] - alone).max() / np.abs(
          alone).max()
      assert err <= 1e-5, (i, err)


def test_every_entry_point_checks_through_segments_check():
  """The model, each layer and the op refuse bad ids with the one rule's
  message (float ids here), before any computation."""
  m = tiny_model(attention_pattern="KM", d_model=16)
  tokens = jnp.zeros((1, 10), jnp.int32)
  bad = np.array([[1, 1, 2, 2, 2, 0, 0, 3, 3, 1]], np.float32)
  built = model.build(m)
  params = built.init(jax.random.key(0), tokens)
  x = jnp.zeros((1, 10, 16))
  calls = {
      "model": lambda: built.apply(params, tokens, bad),
      "op": lambda: ops.chunk_kda(*[jnp.zeros((1, 10, 2, 8))] * 4,
                                  jnp.zeros((1, 10, 2)), segment_ids=bad),
      "conv": lambda: hk.transform(lambda: layers.ShortConvolution(4)(
          x, bad)).init(jax.random.key(0)),
      "kda": lambda: hk.transform(lambda: layers.KimiDeltaAttention(2, 8)(
          x, bad)).init(jax.random.key(0)),
      "mla": lambda: hk.transform(lambda: layers.MultiHeadLatentAttention(
          2, q_lora_rank=0, kv_lora_rank=8, qk_nope_head_dim=8,
          qk_rope_head_dim=8, v_head_dim=8)(x, bad)).init(jax.random.key(0)),
  }
  for name, call in calls.items():
    with pytest.raises(ValueError, match="segment_ids must be an integer "
                       r"array \(int32\)"):
      call()
      pytest.fail(f"{name} accepted float segment ids")


def test_kernel_settings_of_the_config_reach_the_op():
  """`model.kda_kernel` is passed down to `chunk_kda`: with the TPU family
  set (interpreted on CPU) the traced model calls its kernel; unset, the
  platform's default (the generic family here)."""
  tokens = jnp.zeros((1, 64), jnp.int32)

  def kernels(**kernel):
    cfg = tiny_config(kda_impl="pallas", attention_pattern="KM")
    cfg.kda_kernel.update(kernel)
    m = model.build(config.ModelConfig.from_config(cfg))
    params = jax.eval_shape(m.init, jax.random.key(0), tokens)
    return str(jax.make_jaxpr(m.apply)(params, tokens))

  assert "kda_tpu_forward" in kernels(family="tpu", heads_per_program=1)
  assert "kda_tpu_forward" not in kernels()
  with pytest.raises(ValueError, match="kda_kernel.*heads_per_program"):
    kernels(heads_per_program=-1)
