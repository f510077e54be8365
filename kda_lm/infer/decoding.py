r"""Cached autoregressive decoding: the generation loop and sampling.

Shapes as docs/glossary.md; S cache slots per row (`max_len`).

A decode cache is a tuple with one entry per decoder layer: a
`kda.KDACache` (float32 recurrent state [B,H,K,V] and the q, k, v
short-convolution windows: a size that does not depend on the length) or an
`mla.MLACache` (normalised latent `c_kv` [B,S,Z] and rotated RoPE key
[B,S,R] of every past position, first valid slot and length per row). The
feed-forwards (dense, MoE) and norms need none; MTP layers are not used.

  decoder = decoding.Decoder(run.model, max_len=256)   # a ModelConfig
  tokens, segment_ids = decoding.left_pad([[3, 4, 5], [7]])
  logits_BTW, cache = decoder.prefill(params, tokens, segment_ids)
  logits_BW, cache = decoder.step(params, next_B, cache)   # cache donated

Prefill and decode step are two modes of the one decoder
(`kda_lm.model.forward` with `max_len` or `cache`); `Decoder` jits them.
`prefill` runs the full model (the chunked KDA op with
`output_final_state=True`) over left-padded prompts: padding has segment id
0, which KDA skips by construction (it changes no state) and MLA masks, so
every row continues its own prompt exactly as if it were alone. `step`
feeds one token per row: the KDA recurrence in closed form, a conv window
shift, and one latent-cache write per MLA layer, attending in latent space.

`generate` samples continuations (greedy, temperature, top-k, top-p; see
`SamplingConfig`) until an end token or `max_new_tokens`.
"""

import dataclasses
import functools
import math
import time
from typing import Any, Callable, Optional, Sequence

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from kda_lm import config as config_lib
from kda_lm import model as model_lib
from kda_lm.layers import kda

Cache = model_lib.Cache


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0
             ) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads prompts into one batch.

  Args:
    prompts: B non-empty sequences of token ids.
    pad_id: the id written at padding (never read).

  Returns:
    (tokens [B,T] int32, segment_ids [B,T] int32: 0 on padding, 1 on the
    prompt), T the longest prompt.

  Raises:
    ValueError: no prompts, or an empty one.
  """
  if not len(prompts):
    raise ValueError("No prompts given.")
  lengths = [len(p) for p in prompts]
  if min(lengths) < 1:
    raise ValueError(f"Every prompt needs at least one token; prompt "
                     f"{lengths.index(min(lengths))} is empty.")
  T = max(lengths)
  tokens = np.full((len(prompts), T), pad_id, np.int32)
  segment_ids = np.zeros((len(prompts), T), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, T - len(p):] = np.asarray(p, np.int64)
    segment_ids[b, T - len(p):] = 1
  return tokens, segment_ids


class Decoder:
  """Jitted prefill and decode step for one model config and cache size.

  Attributes:
    cfg: the `ModelConfig`.
    max_len: S, cache slots per row (prompt + generated tokens).
    prefill_jit: the jitted `(params, tokens, segment_ids) -> (logits,
      cache)` without `prefill`'s checks.
    step_jit: the jitted `(params, tokens [B,1], cache) -> (logits [B,1,W],
      cache)`, cache donated.
  """

  def __init__(self, model_config: config_lib.ModelConfig, max_len: int):
    """Builds the functions.

    Args:
      model_config: the model's settings, typed (a run's `Run.model`).
      max_len: S >= 1, the longest prompt + continuation to decode.

    Raises:
      TypeError: `model_config` is not a `ModelConfig`.
      ValueError: a bad max_len.
    """
    self.cfg = model_config
    if isinstance(max_len, bool) or not isinstance(max_len, int) or (
        max_len < 1):
      raise ValueError(f"max_len must be a positive int, got {max_len!r}.")
    self.max_len = max_len
    model = model_lib.build(self.cfg)
    self.prefill_jit = jax.jit(
        lambda p, t, s: model.apply(p, t, s, max_len=max_len))
    self.step_jit = jax.jit(lambda p, t, c: model.apply(p, t, cache=c),
                            donate_argnums=2)

  def check_prompt(self, tokens: Any, segment_ids: Any = None) -> None:
    """Raises ValueError for prompts the cache cannot hold or bad ids.

    Args:
      tokens: [B,T] int token ids.
      segment_ids: optional [B,T] ids; each row must end in a document.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] < 1:
      raise ValueError(f"tokens must be [B,T] with T >= 1, got shape "
                       f"{tokens.shape}.")
    if tokens.shape[1] > self.max_len:
      raise ValueError(f"The prompt has {tokens.shape[1]} tokens, more than "
                       f"max_len = {self.max_len}.")
    model_lib.check_tokens(tokens, self.cfg.vocab_size, "The prompt")
    if segment_ids is not None:
      seg = np.asarray(segment_ids)
      if seg.shape != tokens.shape or np.any(seg[:, -1] == 0):
        raise ValueError("segment_ids must have the prompt's shape and end "
                         "each row with a document (left padding).")

  def prefill(self, params: hk.Params, tokens: Any,
              segment_ids: Any = None) -> tuple[jax.Array, Cache]:
    """Runs the prompts; returns (logits [B,T,W] float32, cache).

    Args:
      params: the model parameters.
      tokens: [B,T] int token ids (left-padded, see `left_pad`).
      segment_ids: [B,T] int, 0 on padding; None = no padding.

    Raises:
      ValueError: see `check_prompt`.
    """
    self.check_prompt(tokens, segment_ids)
    tokens = jnp.asarray(tokens, jnp.int32)
    if segment_ids is not None:
      segment_ids = jnp.asarray(segment_ids, jnp.int32)
    return self.prefill_jit(params, tokens, segment_ids)

  def step(self, params: hk.Params, tokens_B: jax.Array, cache: Cache
           ) -> tuple[jax.Array, Cache]:
    """Feeds one token per row; returns (logits [B,W] float32, cache).

    `cache` is donated: do not use it after the call. The caller keeps the
    length within `max_len` (`generate` checks it before starting).
    """
    logits_B1W, cache = self.step_jit(params, jnp.asarray(tokens_B)[:, None],
                                   cache)
    return logits_B1W[:, 0], cache


# ---------------------------------------------------------------------------
# Cache sizes.


def cache_bytes(cache: Any) -> dict[str, int]:
  """Bytes of a cache (arrays or `ShapeDtypeStruct`s) by layer kind.

  Returns:
    {"kda": ..., "mla": ..., "total": ...}.
  """
  out = {"kda": 0, "mla": 0}
  for layer in cache:
    kind = "kda" if isinstance(layer, kda.KDACache) else "mla"
    out[kind] += sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                     for a in jax.tree.leaves(layer))
  out["total"] = out["kda"] + out["mla"]
  return out


# ---------------------------------------------------------------------------
# Sampling.


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to pick each next token.

  Attributes:
    temperature: 0 = greedy (argmax); else logits are divided by it.
    top_k: keep the k most likely tokens (0 = all).
    top_p: keep the smallest set of most likely tokens whose probability
      reaches top_p (1.0 = all).
    seed: the sampling rng seed.
  """
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0

  def __post_init__(self):
    t, k, p = self.temperature, self.top_k, self.top_p
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
        math.isfinite(t) and t >= 0):
      raise ValueError(f"temperature must be a finite float >= 0 (0 = "
                       f"greedy), got {t!r}.")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
      raise ValueError(f"top_k must be an int >= 0 (0 = off), got {k!r}.")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not (
        0 < p <= 1):
      raise ValueError(f"top_p must lie in (0, 1] (1 = off), got {p!r}.")
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ValueError(f"seed must be an int, got {self.seed!r}.")

  @classmethod
  def from_options(cls, **options: Any) -> "SamplingConfig":
    """Builds from keyword options, naming any unknown one.

    Raises:
      ValueError: an unknown option or a bad value.
    """
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(known))
    if unknown:
      raise ValueError(f"Unknown sampling option {unknown[0]!r}; known "
                       f"options: {known}.")
    return cls(**options)


@functools.partial(jax.jit, static_argnames=("temperature", "top_k",
                                             "top_p"))
def sample_logits(logits_BW: jax.Array, rng: jax.Array, *,
                  temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0) -> jax.Array:
  """Picks one token per row; returns [B] int32 ids.

  Args:
    logits_BW: [B,W] float logits.
    rng: a PRNG key (unused when greedy).
    temperature: 0 = argmax, else the softmax temperature.
    top_k: keep the k largest logits (0 = all).
    top_p: nucleus: keep the most likely tokens until their probability
      reaches top_p (always at least one).
  """
  logits_BW = logits_BW.astype(jnp.float32)
  if temperature == 0:
    return jnp.argmax(logits_BW, axis=-1).astype(jnp.int32)
  logits_BW = logits_BW / temperature
  if top_k and top_k < logits_BW.shape[-1]:
    kth_B1 = jax.lax.top_k(logits_BW, top_k)[0][:, -1:]
    logits_BW = jnp.where(logits_BW < kth_B1, -jnp.inf, logits_BW)
  if top_p < 1:
    sorted_BW = jnp.sort(logits_BW, axis=-1)[:, ::-1]
    probs_BW = jax.nn.softmax(sorted_BW, axis=-1)
    before_BW = jnp.cumsum(probs_BW, axis=-1) - probs_BW
    kept_BW = jnp.where(before_BW < top_p, sorted_BW, jnp.inf)
    cutoff_B1 = jnp.min(kept_BW, axis=-1, keepdims=True)
    logits_BW = jnp.where(logits_BW < cutoff_B1, -jnp.inf, logits_BW)
  return jax.random.categorical(rng, logits_BW, axis=-1).astype(jnp.int32)


def _sampler(sampling: SamplingConfig, vocab_size: int
             ) -> Callable[[jax.Array, jax.Array], jax.Array]:
  if sampling.top_k > vocab_size:
    raise ValueError(f"top_k {sampling.top_k} exceeds the vocabulary "
                     f"({vocab_size}).")
  return functools.partial(sample_logits, temperature=sampling.temperature,
                           top_k=sampling.top_k, top_p=sampling.top_p)


def generate(decoder: Decoder, params: hk.Params,
             prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: Optional[SamplingConfig] = None,
             end_token: Optional[int] = None,
             progress: Optional[Callable[[int, float], None]] = None,
             stats: Optional[dict[str, float]] = None
             ) -> list[list[int]]:
  """Continues each prompt.

  Args:
    decoder: the `Decoder` (its `max_len` bounds prompt + continuation).
    params: the model parameters.
    prompts: B sequences of token ids (different lengths allowed).
    max_new_tokens: tokens to generate per row, >= 1.
    sampling: a `SamplingConfig`; default greedy.
    end_token: a row stops after this token (it is not returned); None =
      always `max_new_tokens`.
    progress: called as `progress(steps, seconds)` about once a second,
      both counted after the first decode step (which compiles).
    stats: filled with `prefill_tokens`, `prefill_s` (compilation
      included), `first_step_s` (the first decode step, compilation
      included), and `decode_steps` and `decode_s` after it.

  Returns:
    B lists of generated token ids (without the prompt and end token).

  Raises:
    ValueError: bad prompts (see `Decoder.check_prompt`), a prompt plus
      `max_new_tokens` longer than `max_len`, or a bad option.
  """
  sampling = sampling or SamplingConfig()
  vocab = decoder.cfg.vocab_size
  if isinstance(max_new_tokens, bool) or not isinstance(
      max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive int, got "
                     f"{max_new_tokens!r}.")
  if end_token is not None and not 0 <= end_token < vocab:
    raise ValueError(f"end_token {end_token} is outside the vocabulary "
                     f"[0, {vocab}).")
  tokens, segment_ids = left_pad(prompts)
  if tokens.shape[1] + max_new_tokens - 1 > decoder.max_len:
    raise ValueError(
        f"The longest prompt ({tokens.shape[1]} tokens) plus "
        f"max_new_tokens={max_new_tokens} exceeds max_len = "
        f"{decoder.max_len}.")
  sample = _sampler(sampling, vocab)
  rng = jax.random.key(sampling.seed)
  stats = {} if stats is None else stats
  start = time.time()
  logits_BTW, cache = decoder.prefill(params, tokens, segment_ids)
  logits_BW = jax.block_until_ready(logits_BTW[:, -1])
  stats.update(prefill_tokens=int(tokens.size),
               prefill_s=time.time() - start, first_step_s=0.0,
               decode_steps=0, decode_s=0.0)
  generated = _decode_loop(decoder, params, logits_BW, cache, sample, rng,
                           max_new_tokens, end_token, progress, stats)
  rows = []
  for row in generated.tolist():
    if end_token is not None and end_token in row:
      row = row[:row.index(end_token)]
    rows.append(row)
  return rows


def _decode_loop(decoder, params, logits_BW, cache, sample, rng,
                 max_new_tokens, end_token, progress, stats) -> np.ndarray:
  """Samples and steps up to `max_new_tokens` times: [B, new] token ids.

  The first step compiles: `stats["first_step_s"]` holds it, and the
  decode clock (`decode_steps`, `decode_s`, `progress`) starts after it.
  """
  out, steady, last_report = [], None, time.time()
  for i in range(max_new_tokens):
    rng, key = jax.random.split(rng)
    next_B = sample(logits_BW, key)
    out.append(next_B)
    if i + 1 == max_new_tokens:
      break
    if end_token is not None and i % 16 == 15 and bool(
        jnp.all(jnp.any(jnp.stack(out) == end_token, axis=0))):
      break
    step_start = time.time()
    logits_BW, cache = decoder.step(params, next_B, cache)
    if steady is None:
      jax.block_until_ready(logits_BW)
      steady = last_report = time.time()
      stats["first_step_s"] = steady - step_start
      continue
    stats["decode_steps"] += 1
    if progress is not None and time.time() - last_report > 1.0:
      jax.block_until_ready(logits_BW)
      last_report = time.time()
      progress(stats["decode_steps"], last_report - steady)
  generated = np.asarray(jnp.stack(out, axis=1))
  if steady is not None:
    stats["decode_s"] = time.time() - steady
  return generated
