"""Tests of kda_lm/layers/mla.py (and rope.py): MLA == a naive attention."""

import math

import haiku as hk
import helpers
import jax
import numpy as np
import pytest

from kda_lm.layers import mla, rope

DIMS = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
            v_head_dim=6)
H, D = 2, 16
SEG = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0, 0],
                [1] * 12], np.int32)
POS = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 0, 0],
                list(range(12))], np.int32)


# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


def _transformed(**kwargs):
  kw = dict(DIMS, q_lora_rank=0, rope_theta=100.0)
  kw.update(kwargs)
  return hk.without_apply_rng(hk.transform(
      lambda x, s=None, p=None: mla.MultiHeadLatentAttention(
          H, name="mla", **kw)(x, s, p)))


def _rms(x, w):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * w


def _hf_yarn(dim, base, factor, original_max_position_embeddings,
             beta_fast=None, beta_slow=None, truncate=True,
             attention_factor=None, mscale=None, mscale_all_dim=None):
  """transformers 5.24's `_compute_yarn_parameters` and `yarn_apply_mscale`
  (modeling_bailing_hybrid.py), transcribed to numpy float32: (inv_freq
  [dim/2], the cos/sin factor, the softmax scale's factor)."""

  def get_mscale(scale, mscale=1):
    if scale <= 1:
      return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0

  if attention_factor is None:
    if mscale and mscale_all_dim:
      attention_factor = float(get_mscale(factor, mscale)
                               / get_mscale(factor, mscale_all_dim))
    else:
      attention_factor = get_mscale(factor)
  beta_fast = beta_fast or 32
  beta_slow = beta_slow or 1

  def find_correction_dim(num_rotations, dim, base, max_position_embeddings):
    return (dim * math.log(max_position_embeddings
                           / (num_rotations * 2 * math.pi))
            ) / (2 * math.log(base))

  def find_correction_range(low_rot, high_rot, dim, base,
                            max_position_embeddings, truncate):
    low = find_correction_dim(low_rot, dim, base, max_position_embeddings)
    high = find_correction_dim(high_rot, dim, base, max_position_embeddings)
    if truncate:
      low = math.floor(low)
      high = math.ceil(high)
    return max(low, 0), min(high, dim - 1)

  def linear_ramp_factor(low, high, dim):
    if low == high:
      high += 0.001
    linear_func = (np.arange(dim, dtype=np.float32) - low) / (high - low)
    return np.clip(linear_func, 0, 1)

  pos_freqs = base ** (np.arange(0, dim, 2).astype(np.float32) / dim)
  inv_freq_extrapolation = 1.0 / pos_freqs
  inv_freq_interpolation = 1.0 / (factor * pos_freqs)
  low, high = find_correction_range(beta_fast, beta_slow, dim, base,
                                    original_max_position_embeddings,
                                    truncate)
  inv_freq_extrapolation_factor = 1 - linear_ramp_factor(low, high,
                                                         dim // 2)
  inv_freq = (inv_freq_interpolation * (1 - inv_freq_extrapolation_factor)
              + inv_freq_extrapolation * inv_freq_extrapolation_factor)
  scaling = 1.0
  if mscale_all_dim:
    scaling = get_mscale(factor, mscale_all_dim) ** 2
  return inv_freq, attention_factor, scaling


# HF's `rope_parameters` (besides rope_type and rope_theta) of the YaRN
# cases: the bailing_hybrid_yarn fixture's, DeepSeek-V3's, an explicit
# attention factor, a ramp of one point (low == high), no scaling at all.
YARN_CASES = [
    (8, 10.0, dict(factor=4.0, original_max_position_embeddings=16,
                   beta_fast=2.0, beta_slow=0.5, truncate=False, mscale=2.0,
                   mscale_all_dim=1.0)),
    (64, 1e4, dict(factor=40.0, original_max_position_embeddings=4096,
                   beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                   mscale_all_dim=1.0)),
    (16, 1e4, dict(factor=8.0, original_max_position_embeddings=32,
                   attention_factor=1.5, mscale_all_dim=0.707)),
    (4, 1e4, dict(factor=4.0, original_max_position_embeddings=16,
                  beta_fast=32.0, beta_slow=32.0, mscale=3.0)),
    (8, 100.0, dict(factor=1.0, original_max_position_embeddings=8)),
]
YARN = rope.RopeScaling(type="yarn", **YARN_CASES[0][2])


@pytest.mark.parametrize("R,theta,hf_params", YARN_CASES)
def test_yarn_parameters_equal_transformers(R, theta, hf_params):
  scaling = rope.RopeScaling(type="yarn", **hf_params)
  inv_freq, factor, scale = _hf_yarn(R, theta, **hf_params)
  np.testing.assert_allclose(rope.inv_frequencies(R, theta, scaling),
                             inv_freq, rtol=1e-6)
  assert np.isclose(rope.rope_attention_factor(scaling), factor, rtol=1e-12)
  assert np.isclose(rope.softmax_scale_factor(scaling), scale, rtol=1e-12)
  # Each pair turns by position * inv_freq, its length scaled by `factor`.
  x = np.zeros((1, 3, 1, R), np.float32)
  x[..., 0::2] = 1.0
  y = np.asarray(rope.apply_rope(x, np.array([[0, 5, 37]]), theta, scaling))
  angle = np.array([0, 5, 37])[:, None] * inv_freq
  np.testing.assert_allclose(y[0, :, 0, 0::2], factor * np.cos(angle),
                             rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(y[0, :, 0, 1::2], factor * np.sin(angle),
                             rtol=2e-5, atol=2e-6)


def test_rope_scaling_errors_name_the_field():
  for kwargs, match in ((dict(type="linear"), "rope_scaling.type"),
                        (dict(type="yarn"),
                         "original_max_position_embeddings"),
                        (dict(type="yarn", factor=0.0,
                              original_max_position_embeddings=8),
                         "rope_scaling.factor"),
                        (dict(type="yarn", beta_slow=-1.0,
                              original_max_position_embeddings=8),
                         "rope_scaling.beta_slow")):
    with pytest.raises(ValueError, match=match):
      rope.RopeScaling(**kwargs)
  x = np.ones((1, 4, D), np.float32)
  with pytest.raises(ValueError, match="rope_scaling.type 'yarn' needs RoPE"):
    _transformed(use_nope=True, rope_scaling=YARN).init(jax.random.key(0), x)


def _rope_complex(x, pos, theta, scaling=None):
  """Interleaved RoPE via complex numbers: pair (2i, 2i+1) is one complex;
  YaRN's frequencies and factor from `_hf_yarn`."""
  R = x.shape[-1]
  z = x[..., 0::2] + 1j * x[..., 1::2]
  freq, factor = theta ** (-np.arange(0, R, 2) / R), 1.0
  if scaling is not None:
    freq, factor, _ = _hf_yarn(R, theta, **scaling)
  z = z * np.exp(1j * pos[:, :, None, None] * freq) * factor
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = z.real, z.imag
  return out


def _naive(params, x, seg, pos, *, q_lora_rank, use_nope, output_gate,
           theta=100.0, scaling=None):
  """MLA in float64 numpy with an explicit loop-built mask (`scaling`:
  HF's YaRN `rope_parameters`; biases where `params` has them)."""
  p = {k.split("/", 1)[1] if "/" in k else k: {n: np.asarray(v, np.float64)
                                               for n, v in d.items()}
       for k, d in params.items()}
  dense = lambda v, name: v @ p[name]["w"] + p[name].get("b", 0.0)
  x = x.astype(np.float64)
  B, T, _ = x.shape
  N, R = DIMS["qk_nope_head_dim"], DIMS["qk_rope_head_dim"]
  E, C = DIMS["v_head_dim"], DIMS["kv_lora_rank"]
  if q_lora_rank:
    q = _rms(dense(x, "q_a_proj"), p["q_a_norm"]["weight"])
    q = q @ p["q_b_proj"]["w"]
  else:
    q = x @ p["q_proj"]["w"]
  q = q.reshape(B, T, H, N + R)
  kv_a = dense(x, "kv_a_proj")
  kv = (_rms(kv_a[..., :C], p["kv_a_norm"]["weight"])
        @ p["kv_b_proj"]["w"]).reshape(B, T, H, N + E)
  k_rope = kv_a[..., None, C:]
  q_rope = q[..., N:]
  if not use_nope:
    q_rope = _rope_complex(q_rope, pos, theta, scaling)
    k_rope = _rope_complex(k_rope, pos, theta, scaling)
  scale = (1.0 if scaling is None else _hf_yarn(R, theta, **scaling)[2]
           ) / np.sqrt(N + R)
  out = np.zeros((B, T, H, E))
  for b in range(B):
    for h in range(H):
      for t in range(T):
        if seg[b, t] == 0:
          continue
        keys = [s for s in range(t + 1) if seg[b, s] == seg[b, t]]
        sc = np.array([(q[b, t, h, :N] @ kv[b, s, h, :N]
                        + q_rope[b, t, h] @ k_rope[b, s, 0]) * scale
                       for s in keys])
        w = np.exp(sc - sc.max())
        w /= w.sum()
        out[b, t, h] = sum(wi * kv[b, s, h, N:]
                           for wi, s in zip(w, keys, strict=True))
  if output_gate:
    out = out / (1.0 + np.exp(-(x @ p["g_proj"]["w"])))[..., None]
  return dense(out.reshape(B, T, H * E), "o_proj")


def _random_biases(params, seed):
  """`params` with its (zero-initialised) biases drawn at random."""
  rng = np.random.default_rng(seed)
  return {m: {n: (rng.standard_normal(v.shape).astype(v.dtype) * 0.5
                  if n == "b" else v) for n, v in d.items()}
          for m, d in params.items()}


@pytest.mark.parametrize("q_lora_rank,use_nope,output_gate,q_block,yarn", [
    (0, False, True, 512, False), (8, False, False, 512, False),
    (0, True, False, 512, False), (0, False, True, 5, False),
    (8, False, True, 5, True)])
def test_equals_naive_attention(q_lora_rank, use_nope, output_gate, q_block,
                                yarn):
  """The YaRN case also has biases (Ling's `attention_bias`)."""
  x = np.random.default_rng(0).standard_normal((2, 12, D)).astype(np.float32)
  extra = dict(rope_scaling=YARN, bias=True, rope_theta=10.0) if yarn else {}
  f = _transformed(q_lora_rank=q_lora_rank, use_nope=use_nope,
                   output_gate=output_gate, q_block=q_block, **extra)
  params = _random_biases(f.init(jax.random.key(0), x, SEG), 0)
  assert sum(n == "b" for d in params.values() for n in d) == 3 * yarn
  got = np.asarray(f.apply(params, x, SEG))
  ref = _naive(params, x, SEG, POS, q_lora_rank=q_lora_rank,
               use_nope=use_nope, output_gate=output_gate,
               theta=10.0 if yarn else 100.0,
               scaling=YARN_CASES[0][2] if yarn else None)
  # Padding queries output zeros before o_proj (then its bias).
  pad = params["mla/o_proj"]["b"] if yarn else np.zeros(D, np.float32)
  np.testing.assert_array_equal(got[0, 9:], np.broadcast_to(pad, (3, D)))
  err = np.abs(got - ref).max() / np.abs(ref).max()
  assert err <= 1e-5, err
  # Explicit positions equal to the derived ones give identical outputs.
  np.testing.assert_array_equal(np.asarray(f.apply(params, x, SEG, POS)), got)


def test_no_attention_across_segments():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((1, 12, D)).astype(np.float32)
  f = _transformed(output_gate=True)
  params = f.init(jax.random.key(1), x, SEG[:1])
  apply = jax.jit(f.apply)
  packed = np.asarray(apply(params, x, SEG[:1]))
  for lo, hi in ((0, 4), (4, 9)):
    alone = np.asarray(apply(params, x[:, lo:hi]))
    np.testing.assert_allclose(packed[:, lo:hi], alone, rtol=1e-5, atol=1e-6)
  # Changing document 1 (and the padding) leaves document 2 bit-identical.
  x2 = x.copy()
  x2[:, :4] = rng.standard_normal((1, 4, D))
  x2[:, 9:] = 1e3
  changed = np.asarray(apply(params, x2, SEG[:1]))
  np.testing.assert_array_equal(changed[:, 4:9], packed[:, 4:9])
  assert np.all(changed[:, :4] != packed[:, :4])


def test_query_blocks_match_dense_with_gradients():
  # Blocks [0,5), [5,10), [10,12): a document boundary inside a block.
  x = np.random.default_rng(3).standard_normal((2, 12, D)).astype(np.float32)
  dense, blocked = _transformed(output_gate=True), _transformed(
      output_gate=True, q_block=5)
  params = dense.init(jax.random.key(2), x, SEG)
  loss = lambda f: jax.jit(jax.grad(
      lambda p, x: jax.numpy.sum(f.apply(p, x, SEG) ** 2), argnums=(0, 1)))
  np.testing.assert_allclose(blocked.apply(params, x, SEG),
                             dense.apply(params, x, SEG), rtol=1e-5,
                             atol=1e-6)
  g_dense, g_blocked = loss(dense)(params, x), loss(blocked)(params, x)
  for a, b in zip(jax.tree.leaves(g_blocked), jax.tree.leaves(g_dense),
                  strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_rope_is_relative():
  rng = np.random.default_rng(2)
  q = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
  k = rng.standard_normal((1, 6, 2, 8)).astype(np.float32)
  pos = np.arange(6)[None]

  def scores(shift):
    qr = rope.apply_rope(q, pos + shift, 1e4)
    kr = rope.apply_rope(k, pos + shift, 1e4)
    return np.einsum("bthd,bshd->bhts", qr, kr)

  np.testing.assert_allclose(scores(0), scores(37), rtol=1e-4, atol=1e-5)
  # Interleaved layout: position 1, first pair rotated by exactly 1 radian.
  x = np.zeros((1, 2, 1, 4), np.float32)
  x[..., 0] = 1.0
  y = np.asarray(rope.apply_rope(x, pos[:, :2], 1e4))
  np.testing.assert_allclose(y[0, 1, 0, :2], [np.cos(1.0), np.sin(1.0)],
                             rtol=1e-6)
  np.testing.assert_array_equal(y[0, 0, 0], x[0, 0, 0])


def test_bad_dims_and_shapes():
  x = np.ones((1, 4, D), np.float32)
  for kwargs, match in (({"qk_rope_head_dim": 3}, "even"),
                        ({"kv_lora_rank": 0}, "kv_lora_rank"),
                        ({"qk_nope_head_dim": 0, "qk_rope_head_dim": 0},
                         "qk_nope_head_dim \\+ qk_rope_head_dim")):
    with pytest.raises(ValueError, match=match):
      _transformed(**kwargs).init(jax.random.key(0), x)
  # An odd RoPE width is fine without RoPE.
  _transformed(qk_rope_head_dim=3, use_nope=True).init(jax.random.key(0), x)
  f = _transformed()
  with pytest.raises(ValueError, match="segment_ids"):
    f.init(jax.random.key(0), x, np.ones((1, 5), np.int32))
  with pytest.raises(ValueError, match="q_block"):
    _transformed(q_block=0).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="positions"):
    f.init(jax.random.key(0), x, None, np.ones((4,), np.int32))


def test_document_at_an_offset_gets_its_own_rope_positions(monkeypatch):
  """Packed at t=4, document 2 gets the positions and rotated q/k it gets
  alone (RoPE being relative, the attention output alone would not show a
  shift of a whole document)."""
  run = helpers.record_rope(monkeypatch)
  rng = np.random.default_rng(4)
  # Row 0: SEG's packed row; row 1: its document 2 alone, then padding.
  x = np.zeros((2, 12, D), np.float32)
  x[0] = rng.standard_normal((12, D))
  x[1, :5] = x[0, 4:9]
  seg = np.stack([SEG[0], [1] * 5 + [0] * 7]).astype(np.int32)
  f = _transformed()
  params = f.init(jax.random.key(4), x, seg)
  (pos_q, q), (pos_k, k) = run(f.apply, params, x, seg)
  for pos in (pos_q, pos_k):
    np.testing.assert_array_equal(pos[0], POS[0])
    np.testing.assert_array_equal(pos[1, :5], np.arange(5))
  np.testing.assert_allclose(q[0, 4:9], q[1, :5], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(k[0, 4:9], k[1, :5], rtol=1e-6, atol=1e-6)


# Prompts of 7 tokens, then 4 decoded tokens continuing each row's last
# document: one document; a document before the last (masked, its slots
# before `starts`); left padding.
DECODE_SEG = np.array([[1] * 11, [1, 1, 1] + [2] * 8,
                       [0, 0, 0, 0, 0] + [3] * 6], np.int32)
PROMPT = 7


def _mla_decode_fns(max_len, **kwargs):
  """Jitted (full forward, prefill with a cache of max_len slots, one
  decode step) of the same MLA parameters."""
  kw = dict(DIMS, q_lora_rank=0, rope_theta=100.0)
  kw.update(kwargs)
  make = lambda: mla.MultiHeadLatentAttention(H, name="mla", **kw)
  full = hk.without_apply_rng(hk.transform(lambda x, s: make()(x, s)))
  prefill = hk.without_apply_rng(hk.transform(
      lambda x, s: make()(x, s, max_len=max_len)))
  step = hk.without_apply_rng(hk.transform(
      lambda x, c: make()(x, cache=c)))
  return full, jax.jit(prefill.apply), jax.jit(step.apply)


@pytest.mark.parametrize("kwargs", [
    dict(output_gate=True), dict(q_lora_rank=8), dict(use_nope=True),
    dict(q_lora_rank=8, output_gate=True, rope_scaling=YARN, bias=True,
         rope_theta=10.0)],
    ids=["gate", "q_lora", "nope", "yarn_bias"])
def test_decode_steps_equal_the_full_sequence(kwargs):
  """A prefill of 7 tokens and 4 one-token steps with the cache (the
  absorbed latent-space attention) give the full forward's outputs."""
  rng = np.random.default_rng(5)
  x = rng.standard_normal((3, 11, D)).astype(np.float32)
  full, prefill, step = _mla_decode_fns(12, **kwargs)
  params = _random_biases(full.init(jax.random.key(5), x, DECODE_SEG), 5)
  want = np.asarray(full.apply(params, x, DECODE_SEG))
  y, cache = prefill(params, x[:, :PROMPT], DECODE_SEG[:, :PROMPT])
  np.testing.assert_allclose(y, want[:, :PROMPT], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(cache.starts, [0, 3, 5])
  np.testing.assert_array_equal(cache.lengths, [PROMPT] * 3)
  assert cache.c_kv.shape == (3, 12, DIMS["kv_lora_rank"])
  for t in range(PROMPT, 11):
    y, cache = step(params, x[:, t:t + 1], cache)
    err = np.abs(np.asarray(y)[:, 0] - want[:, t]).max() / np.abs(
        want[:, t]).max()
    assert err <= 1e-5, (t, err)
  np.testing.assert_array_equal(cache.lengths, [11] * 3)
  # Slots past the length stay zero.
  np.testing.assert_array_equal(cache.c_kv[:, 11:], 0.0)


def test_decode_ignores_the_earlier_document_and_padding():
  """Row 1's earlier document (and row 2's padding) can change at will:
  the decoded outputs of the last document stay the same."""
  rng = np.random.default_rng(6)
  x = rng.standard_normal((3, 9, D)).astype(np.float32)
  full, prefill, step = _mla_decode_fns(9, output_gate=True)
  params = full.init(jax.random.key(6), x, DECODE_SEG[:, :9])

  def decoded(x):
    _, cache = prefill(params, x[:, :PROMPT], DECODE_SEG[:, :PROMPT])
    outs = []
    for t in range(PROMPT, 9):
      y, cache = step(params, x[:, t:t + 1], cache)
      outs.append(np.asarray(y))
    return np.concatenate(outs, axis=1)

  base = decoded(x)
  x2 = x.copy()
  x2[1, :3] = rng.standard_normal((3, D)) * 10
  x2[2, :5] = rng.standard_normal((5, D)) * 10
  np.testing.assert_allclose(decoded(x2), base, rtol=1e-5, atol=1e-6)
