r"""Benchmarks cached decoding against recomputing the full forward.

For each attention pattern, batch size B and prompt length P it builds the
ling3_tiny model (random parameters; speed does not depend on them), then

* cached: prefills the B prompts (`kda_lm.infer.decoding.Decoder.prefill`) and
  times `--steps` jitted decode steps (one token per row, cache donated);
* recompute: times the full forward over P + 1 tokens per row, what a
  decoder without a cache runs to produce each next token;

and reports decode tokens/s (B tokens per step), per-token latency (ms per
step), the recompute step's latency, their ratio (same run), and the cache
bytes per row (KDA part: constant; MLA part: (kv_lora_rank +
qk_rope_head_dim) values per slot per MLA layer, P + steps slots).

Usage:

  python -m experiments.bench_decode
  python -m experiments.bench_decode --patterns=KKKK --prompt_lens=512,4096
"""

import time

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags

import kda_lm  # noqa: F401  # isort: skip  (first: XLA:CPU flags)
from kda_lm import config as config_lib
from kda_lm import model as model_lib
from kda_lm.infer import decoding

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/ling3_tiny.py", "Config file with a `model` dict.",
    lock_config=True)
_PATTERNS = flags.DEFINE_list("patterns", ["KKKM", "KKKK"],
                              "attention_pattern values to compare.")
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Rows B.")
_PROMPT_LENS = flags.DEFINE_list("prompt_lens", ["512", "4096"],
                                 "Prompt lengths P (tokens).")
_STEPS = flags.DEFINE_integer("steps", 32, "Timed decode steps.")
_RECOMPUTE_REPS = flags.DEFINE_integer("recompute_reps", 3,
                                       "Timed full forwards.")


def _time(fn, reps):
  """Seconds per call of `fn` (already compiled), best of `reps`."""
  best = float("inf")
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def bench_one(model_config, B, P, steps, reps):
  """One row of the table."""
  model = model_lib.build(model_config)
  vocab = model_config.vocab_size
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  tokens = jax.random.randint(jax.random.key(1), (B, P + 1), 0, vocab)
  decoder = decoding.Decoder(model_config, max_len=P + steps + 1)
  logits, cache = decoder.prefill(params, tokens[:, :P])
  next_B = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
  logits_BW, cache = decoder.step(params, next_B, cache)   # compile
  jax.block_until_ready(logits_BW)
  start = time.perf_counter()
  for _ in range(steps):
    logits_BW, cache = decoder.step(params, next_B, cache)
  jax.block_until_ready(logits_BW)
  step_s = (time.perf_counter() - start) / steps
  full = jax.jit(model.apply)
  jax.block_until_ready(full(params, tokens))               # compile
  full_s = _time(lambda: full(params, tokens), reps)
  sizes = decoding.cache_bytes(cache)
  return dict(B=B, P=P, tok_s=B / step_s, step_ms=1e3 * step_s,
              full_ms=1e3 * full_s, ratio=full_s / step_s,
              kda_row=sizes["kda"] // B, mla_row=sizes["mla"] // B)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}.")
  print(f"backend {jax.default_backend()}, {jax.device_count()} device(s); "
        f"{_STEPS.value} decode steps, recompute = full forward over P+1 "
        f"tokens (best of {_RECOMPUTE_REPS.value})")
  header = (f"{'pattern':<8} {'B':>2} {'P':>5} {'decode tok/s':>12} "
            f"{'ms/token':>9} {'recompute ms':>12} {'speedup':>8} "
            f"{'KDA B/row':>10} {'MLA B/row':>10}")
  print(header)
  print("-" * len(header))
  for pattern in _PATTERNS.value:
    model_config = _CONFIG.value.model.to_dict()
    model_config["attention_pattern"] = pattern
    model_config = config_lib.ModelConfig.from_config(model_config)
    for P in (int(p) for p in _PROMPT_LENS.value):
      for B in (int(b) for b in _BATCHES.value):
        r = bench_one(model_config, B, P, _STEPS.value,
                      _RECOMPUTE_REPS.value)
        print(f"{pattern:<8} {B:>2} {P:>5} {r['tok_s']:>12.1f} "
              f"{r['step_ms']:>9.2f} {r['full_ms']:>12.1f} "
              f"{r['ratio']:>7.1f}x {r['kda_row']:>10,} "
              f"{r['mla_row']:>10,}", flush=True)


if __name__ == "__main__":
  app.run(main)
