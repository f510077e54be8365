"""Tests of kda_lm.infer.decoding: cached decoding equals the full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_lm import config as config_lib
from kda_lm import model as model_lib
from kda_lm.infer import decoding

pytestmark = pytest.mark.usefixtures("fast_compile")

RTOL = 1e-5


def tiny_config(**overrides):
  """A KKKM MoE model small enough to compile fast; chunk size 16."""
  values = dict(
      vocab_size=32, d_model=32, attention_pattern="KKKM", num_heads=2,
      head_dim=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
      v_head_dim=8, mlp_hidden_dim=32, mla_output_gate=True, num_experts=4,
      num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=16,
      first_k_dense_replace=1, routed_scaling_factor=2.5, kda_impl="xla",
      kda_chunk_size=16)
  values.update(overrides)
  return config_lib.ModelConfig(**values)


def init_params(cfg, seed=0):
  params = jax.jit(model_lib.build(cfg).init)(jax.random.key(seed),
                                              jnp.zeros((1, 8), jnp.int32))
  # Non-zero A_log / biases are the defaults; nudge MoE selection biases so
  # routing is not tied.
  return params


def max_abs_err_ratio(a, b):
  """`max |a - b| / max |b|` in float64: the largest error against the
  largest reference entry (not testbed.numerics.rel_err's L2 ratio)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def cached_logits(decoder, params, tokens, p):
  """Logits at positions p-1 .. T-1 from a prefill of p and T-p steps."""
  logits, cache = decoder.prefill(params, tokens[:, :p])
  out = [logits[:, -1]]
  for t in range(p, tokens.shape[1]):
    step_logits, cache = decoder.step(params, tokens[:, t], cache)
    out.append(step_logits)
  return jnp.stack(out, axis=1), logits


# (config overrides, prompt lengths p): the default KKKM MoE model at p = 1,
# a non-multiple and a multiple of the chunk size (16); smaller stacks for
# the other variants.
CASES = {
    "default": ({}, (1, 21, 32)),
    "kimi": (dict(kda_gate="kimi", attention_pattern="KM"), (21,)),
    "nope": (dict(use_nope=True, attention_pattern="KM"), (21,)),
    "mla_q_lora": (dict(attention_pattern="MK", q_lora_rank=8), (32,)),
}
N_STEPS = 4


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_then_steps_equals_full_forward(case):
  overrides, prompt_lengths = CASES[case]
  cfg = tiny_config(**overrides)
  params = init_params(cfg)
  T = max(prompt_lengths) + N_STEPS
  tokens = jax.random.randint(jax.random.key(1), (2, T), 0, cfg.vocab_size)
  full = jax.jit(model_lib.build(cfg).apply)(params, tokens)
  decoder = decoding.Decoder(cfg, max_len=T + 3)
  for p in prompt_lengths:
    got, prefill_logits = cached_logits(decoder, params,
                                        tokens[:, :p + N_STEPS], p)
    assert max_abs_err_ratio(prefill_logits, full[:, :p]) < RTOL, p
    assert max_abs_err_ratio(got, full[:, p - 1:p + N_STEPS]) < RTOL, p


def test_batch_of_different_lengths_decodes_each_row_as_alone():
  cfg = tiny_config(attention_pattern="KM")
  params = init_params(cfg)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 32, size=n).tolist() for n in (5, 19, 1)]
  decoder = decoding.Decoder(cfg, max_len=32)
  batch = decoding.generate(decoder, params, prompts, max_new_tokens=6)
  tokens, segment_ids = decoding.left_pad(prompts)
  logits, cache = decoder.prefill(params, tokens, segment_ids)
  steps = [logits[:, -1]]
  for t in range(3):
    step_logits, cache = decoder.step(
        params, jnp.asarray([batch[b][t] for b in range(3)]), cache)
    steps.append(step_logits)
  for b, prompt in enumerate(prompts):
    alone = decoding.generate(decoder, params, [prompt], max_new_tokens=6)
    assert alone[0] == batch[b]
    # As `generate` prefills it (one compile per prompt length).
    a_logits, a_cache = decoder.prefill(params, *decoding.left_pad([prompt]))
    a_steps = [a_logits[:, -1]]
    for t in range(3):
      s, a_cache = decoder.step(params, jnp.asarray([batch[b][t]]), a_cache)
      a_steps.append(s)
    for got, want in zip(steps, a_steps, strict=True):
      assert max_abs_err_ratio(got[b], want[0]) < RTOL


def _abstract_cache(cfg, batch, prompt_len, max_len):
  """The cache's shapes after a prefill (nothing is run)."""
  decoder = decoding.Decoder(cfg, max_len)
  params = model_lib.abstract_params(cfg)
  tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
  return jax.eval_shape(decoder.prefill_jit, params, tokens, tokens)[1]


def test_cache_sizes():
  cfg = tiny_config(attention_pattern="KMKM")
  short = _abstract_cache(cfg, 2, 3, max_len=40)
  long = _abstract_cache(cfg, 2, 30, max_len=40)
  bigger = _abstract_cache(cfg, 2, 30, max_len=41)
  assert decoding.cache_bytes(short) == decoding.cache_bytes(long)
  kda_sizes = [jax.tree.map(lambda a: a.shape, c) for c in (short, bigger)]
  assert kda_sizes[0][0] == kda_sizes[1][0]
  grow = decoding.cache_bytes(bigger)["mla"] - decoding.cache_bytes(
      long)["mla"]
  per_value = 4  # float32
  assert grow == 2 * 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * (
      per_value)
  assert decoding.cache_bytes(bigger)["kda"] == decoding.cache_bytes(
      long)["kda"]
  state = short[0].state
  assert state.shape == (2, cfg.num_heads, cfg.head_dim, cfg.kda_head_v_dim)
  assert state.dtype == jnp.float32


def test_sampling_options():
  logits = jnp.asarray([[0.0, 5.0, 1.0, 4.9]])
  greedy = decoding.sample_logits(logits, jax.random.key(0))
  assert int(greedy[0]) == 1
  picks = {int(decoding.sample_logits(logits, jax.random.key(s),
                                      temperature=1.0, top_k=2)[0])
           for s in range(50)}
  assert picks == {1, 3}
  picks = {int(decoding.sample_logits(logits, jax.random.key(s),
                                      temperature=1.0, top_p=0.3)[0])
           for s in range(20)}
  assert picks == {1}
  picks = {int(decoding.sample_logits(logits, jax.random.key(s),
                                      temperature=2.0)[0])
           for s in range(200)}
  assert picks == {0, 1, 2, 3}
  with pytest.raises(ValueError, match="Unknown sampling option 'topk'"):
    decoding.SamplingConfig.from_options(topk=3)
  for bad in (dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0),
              dict(top_p=1.5), dict(temperature=float("nan"))):
    with pytest.raises(ValueError):
      decoding.SamplingConfig(**bad)


def test_generate_stops_and_rejects_bad_input():
  cfg = tiny_config(attention_pattern="KM", num_experts=0)
  params = init_params(cfg)
  decoder = decoding.Decoder(cfg, max_len=16)
  first = decoding.generate(decoder, params, [[1, 2, 3]], max_new_tokens=8)
  assert len(first[0]) == 8
  end = first[0][2]
  stopped = decoding.generate(decoder, params, [[1, 2, 3]],
                              max_new_tokens=8, end_token=end)
  assert stopped[0] == first[0][:first[0].index(end)]
  same = decoding.generate(
      decoder, params, [[1, 2, 3]], max_new_tokens=8,
      sampling=decoding.SamplingConfig(temperature=1.0, seed=3))
  again = decoding.generate(
      decoder, params, [[1, 2, 3]], max_new_tokens=8,
      sampling=decoding.SamplingConfig(temperature=1.0, seed=3))
  assert same == again
  with pytest.raises(ValueError, match="more than max_len"):
    decoder.prefill(params, np.zeros((1, 17), np.int32))
  with pytest.raises(ValueError, match="exceeds max_len"):
    decoding.generate(decoder, params, [[1] * 10], max_new_tokens=8)
  with pytest.raises(ValueError, match="outside the model vocabulary"):
    decoding.generate(decoder, params, [[1, 40]], max_new_tokens=2)
  with pytest.raises(ValueError, match="top_k"):
    decoding.generate(decoder, params, [[1]], max_new_tokens=2,
                      sampling=decoding.SamplingConfig(temperature=1.0,
                                                       top_k=99))
  with pytest.raises(ValueError, match="empty"):
    decoding.generate(decoder, params, [[1], []], max_new_tokens=2)


# Distinct logits in no particular order, so that a sampler that keeps the
# wrong indices (not just the wrong number of them) is caught too. At T = 1
# the sorted probabilities are .475 .213 .158 .087 .043 .024.
LOGITS_W = np.array([0.3, 2.0, -1.0, 1.2, -0.4, 0.9])

# (temperature, top_k, top_p) and the tokens the filter must keep. Nucleus
# boundaries sit >= 0.02 away from every cumulative probability, so float32
# rounding cannot move them.
SAMPLING_CASES = {
    # T = 2 vs T^2 = 4: total variation 0.096; vs 1/T: 0.42.
    "temperature_2": ((2.0, 0, 1.0), [0, 1, 2, 3, 4, 5]),
    "temperature_half": ((0.5, 0, 1.0), [0, 1, 2, 3, 4, 5]),
    "top_k_3": ((1.0, 3, 1.0), [1, 3, 5]),
    "top_k_3_tempered": ((1.5, 3, 1.0), [1, 3, 5]),
    "top_k_5": ((1.0, 5, 1.0), [0, 1, 3, 4, 5]),
    # Cumulative .475 .688 .847: the probability before token 3 (.688)
    # is under 0.8, so 3 tokens stay (an inclusive cumsum keeps 2).
    "top_p_0.8": ((1.0, 0, 0.8), [1, 3, 5]),
    "top_p_0.6": ((1.0, 0, 0.6), [1, 3]),
    "top_p_0.4": ((1.0, 0, 0.4), [1]),
    # On the tempered distribution (cumulative .313 .522 .703 at T = 2):
    # 3 tokens, where the untempered nucleus has 2.
    "top_p_tempered": ((2.0, 0, 0.6), [1, 3, 5]),
    # Top-p on the renormalised top-4 (cumulative .509 .738 .907): 3
    # tokens; on the full softmax (.475 .688 .847) it would keep 4.
    "top_k_then_top_p": ((1.0, 4, 0.88), [1, 3, 5]),
}


def sampling_probs(logits_W, temperature, top_k=0, top_p=1.0):
  """The distribution `sample_logits` must draw from, in float64 numpy:
  softmax(logits / T) restricted to the top k, then to the nucleus (the
  likeliest tokens while the probability before them is < top_p),
  renormalised."""
  z = np.asarray(logits_W, np.float64) / temperature
  order = np.argsort(-z)
  keep = np.zeros(z.shape, bool)
  keep[order[:top_k or len(z)]] = True
  p = np.where(keep, np.exp(z - z.max()), 0.0)
  p /= p.sum()
  before = np.cumsum(p[order]) - p[order]
  keep[order[before >= top_p]] = False
  p = np.where(keep, p, 0.0)
  return p / p.sum()


def test_sampling_probs_reference():
  """The numpy reference itself, on the cases' kept sets."""
  for (t, k, p), kept in SAMPLING_CASES.values():
    probs = sampling_probs(LOGITS_W, t, k, p)
    assert np.flatnonzero(probs).tolist() == kept, (t, k, p)
  np.testing.assert_allclose(
      sampling_probs([0.0, np.log(3.0)], 1.0), [0.25, 0.75])
  np.testing.assert_allclose(
      sampling_probs([0.0, np.log(3.0)], 0.5), [0.1, 0.9])


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampler_draws_from_the_filtered_softmax_exactly(case, monkeypatch):
  """The logits `sample_logits` hands to `jax.random.categorical` are
  exactly log of the filtered, renormalised distribution (up to a
  constant): -inf on every dropped token and nowhere else."""
  (t, k, p), kept = SAMPLING_CASES[case]
  drawn = _logits_drawn_from(monkeypatch,
                             np.stack([LOGITS_W, LOGITS_W[::-1]]),
                             temperature=t, top_k=k, top_p=p)
  for row, want_logits in zip(drawn, (LOGITS_W, LOGITS_W[::-1]),
                              strict=True):
    want = sampling_probs(want_logits, t, k, p)
    np.testing.assert_array_equal(np.isfinite(row), want > 0)
    got = np.exp(row - row[np.isfinite(row)].max())
    np.testing.assert_allclose(got / got.sum(), want, rtol=1e-6, atol=1e-7)
  assert np.flatnonzero(np.isfinite(drawn[0])).tolist() == kept


N_DRAWS = 40_000
# Total-variation bound for N_DRAWS draws over 6 tokens: the correct sampler
# exceeds it with probability <= 2^6 exp(-2 N eps^2) < 1e-12 (Bretagnolle-
# Huber-Carol), while every wrong distribution of these cases (T^2, 1/T, an
# off-by-one k or nucleus) lies >= 0.08 away.
TV_BOUND = 0.02


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampler_frequencies_match_the_filtered_softmax(case):
  """Through the jitted sampler: N_DRAWS rows of the same logits, one draw
  each; only kept tokens appear, at their probabilities."""
  (t, k, p), kept = SAMPLING_CASES[case]
  logits = jnp.broadcast_to(jnp.asarray(LOGITS_W, jnp.float32),
                            (N_DRAWS, len(LOGITS_W)))
  draws = np.asarray(decoding.sample_logits(
      logits, jax.random.key(7), temperature=t, top_k=k, top_p=p))
  counts = np.bincount(draws, minlength=len(LOGITS_W))
  assert np.flatnonzero(counts).tolist() == kept, counts
  want = sampling_probs(LOGITS_W, t, k, p)
  tv = 0.5 * np.abs(counts / N_DRAWS - want).sum()
  assert tv <= TV_BOUND, (tv, counts / N_DRAWS, want)


def _caught(right, wrong):
  """Whether the frequency test must fail on draws from `wrong`: a token
  the right sampler keeps never drawn, a dropped token drawn >= 50 times
  on average (missing it has probability < e^-50), or the total variation
  more than twice the bound."""
  tv = 0.5 * np.abs(right - wrong).sum()
  extra = wrong[(right == 0) & (wrong > 0)]
  return (np.any((right > 0) & (wrong == 0))
          or np.any(extra * N_DRAWS >= 50) or tv > 2 * TV_BOUND)


def test_wrong_samplers_are_caught_by_the_frequency_test():
  """The cases tell the right distribution from its plausible mistakes:
  T^2, 1/T or T = 1 for T; k +- 1; a nucleus one token too short or long;
  and the right sampler draws every kept token >= 50 times on average."""
  for (t, k, p), kept in SAMPLING_CASES.values():
    right = sampling_probs(LOGITS_W, t, k, p)
    assert right[kept].min() * N_DRAWS >= 50
    wrongs = [(w, k, p) for w in (t * t, 1.0 / t, 1.0) if w != t]
    if k and p == 1:   # (With a nucleus, k - 1 may not matter.)
      wrongs += [(t, k + 1, p), (t, k - 1, p)]
    for wrong in wrongs:
      assert _caught(right, sampling_probs(LOGITS_W, *wrong)), (
          (t, k, p), wrong)
    if p < 1:
      # The nucleus one token shorter or longer than it should be.
      order = np.argsort(-right)
      for n in (len(kept) - 1, len(kept) + 1):
        if 1 <= n <= len(LOGITS_W):
          wrong = np.zeros_like(right)
          base = sampling_probs(LOGITS_W, t, k)
          wrong[order[:n]] = base[order[:n]]
          if wrong.sum() > 0:
            assert _caught(right, wrong / wrong.sum()), ((t, k, p), n)


# The sampler at its edges, eagerly, with `jax.random.categorical` replaced
# by a recorder: which logits reach the draw.


def _logits_drawn_from(monkeypatch, logits_BW, **options):
  seen = []

  def categorical(key, logits, axis=-1):
    del key
    seen.append(np.asarray(logits, np.float64))
    return jnp.argmax(logits, axis=axis)

  monkeypatch.setattr(jax.random, "categorical", categorical)
  with jax.disable_jit():
    decoding.sample_logits(jnp.asarray(logits_BW, jnp.float32),
                           jax.random.key(0), **options)
  assert len(seen) == 1, "the sampler no longer calls categorical"
  return seen[0]


def test_sampler_greedy_picks_each_rows_argmax():
  """Greedy is the default; options after the rng are keyword-only."""
  logits = jnp.asarray([[0.0, 5.0, 1.0], [3.0, -1.0, 2.0],
                        [-2.0, -3.0, -1.0]], jnp.bfloat16)
  picks = decoding.sample_logits(logits, jax.random.key(0))
  assert picks.dtype == jnp.int32 and picks.tolist() == [1, 0, 2]
  # Close logits: any sampling would draw the others too.
  close = jnp.broadcast_to(jnp.asarray([0.0, 0.2, 0.1]), (256, 3))
  assert set(decoding.sample_logits(close, jax.random.key(1)).tolist()) == {1}
  with pytest.raises(TypeError):
    decoding.sample_logits(  # pylint: disable=too-many-function-args
        close, jax.random.key(1), 1.0)


def test_sampler_top_p_1_keeps_even_unlikely_tokens(monkeypatch):
  """At top_p = 1 there is no nucleus: a token whose probability rounds
  to nothing next to the rest (the probability before it sums to 1.0 in
  float32) is still drawn from."""
  drawn = _logits_drawn_from(monkeypatch, [[0.0, -40.0, 1.0]],
                             temperature=1.0, top_p=1.0)
  np.testing.assert_array_equal(drawn, [[0.0, -40.0, 1.0]])


def test_sampler_nucleus_reached_exactly_stops_there(monkeypatch):
  """top_p equal to the probability of the two likeliest tokens (as the
  sampler sums it in float32): the third is not needed."""
  logits = jnp.asarray([[2.0, 0.5, 1.0, -1.0]], jnp.float32)
  with jax.disable_jit():
    sorted_ = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_, axis=-1)
    before = np.asarray(jnp.cumsum(probs, axis=-1) - probs)
  top_p = float(before[0, 2])
  assert 0.8 < top_p < 0.9
  drawn = _logits_drawn_from(monkeypatch, logits, temperature=1.0,
                             top_p=top_p)
  assert np.isfinite(drawn).tolist() == [[True, False, True, False]]


def test_sampler_top_k_of_the_whole_vocabulary(monkeypatch):
  """top_k = vocabulary size (or more) keeps everything; the sampler built
  from a config refuses a larger k and draws like `sample_logits`
  otherwise."""
  logits = [[0.3, 2.0, -1.0, 1.2]]
  for top_k in (4, 5):               # (5: `sample_logits` called directly.)
    drawn = _logits_drawn_from(monkeypatch, logits, temperature=1.0,
                               top_k=top_k)
    np.testing.assert_allclose(drawn, logits, rtol=1e-6)
    monkeypatch.undo()
  config = decoding.SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)
  sample = decoding._sampler(config, 4)  # pylint: disable=protected-access
  logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (64, 4))
  np.testing.assert_array_equal(
      sample(logits, jax.random.key(3)),
      decoding.sample_logits(logits, jax.random.key(3), temperature=0.7,
                             top_k=4, top_p=0.9))
  with pytest.raises(ValueError,
                     match=r"^top_k 4 exceeds the vocabulary \(3\)\.$"):
    decoding._sampler(config, 3)  # pylint: disable=protected-access
  decoding._sampler(config, 5)  # pylint: disable=protected-access


def test_generate_reports_prefill_and_decode_apart_from_compilation(
    monkeypatch):
  """`stats`: the prefill and the first decode step, each with its
  compilation, and the steps after it, which alone make the decode rate;
  `progress` counts from there (a clock that moves 1 s per call)."""
  cfg = tiny_config(attention_pattern="KM", num_experts=0)
  params = init_params(cfg)
  decoder = decoding.Decoder(cfg, max_len=16)
  ticks = iter(range(10_000))
  monkeypatch.setattr(decoding.time, "time", lambda: float(next(ticks)))
  stats, calls = {}, []
  out = decoding.generate(decoder, params, [[1, 2, 3], [4, 5]],
                          max_new_tokens=8, stats=stats,
                          progress=lambda n, s: calls.append((n, s)))
  assert [len(r) for r in out] == [8, 8]
  assert stats["prefill_tokens"] == 2 * 3 and stats["prefill_s"] > 0
  assert stats["first_step_s"] > 0
  assert stats["decode_steps"] == 6      # 8 tokens: 7 steps, the first apart
  assert stats["decode_s"] > 0
  assert calls and all(0 < n <= 6 and s > 0 for n, s in calls)
