r"""Benchmarks the ling3_tiny model: forward+backward tokens/s and memory.

For each attention pattern (KDA/MLA layout), row length and KDA chunk size it
jits one training-shaped step (`jax.value_and_grad` of the masked next-token
cross-entropy over packed rows with segment ids), runs it once to warm up
and then times it, reporting

* tokens/s: token slots (rows x seq_len) per second of forward+backward,
* XLA MiB: the compiled step's memory: the allocator's peak where the backend
  reports one (GPU/TPU), else XLA's buffer assignment of the step
  (arguments + outputs + temporaries, CPU),
* RSS MiB: the peak resident memory of the process that ran it (CPU).

The pattern table uses dense SwiGLU feed-forwards in every layer
(`num_experts=0`) so that it compares sequence mixers only.

Each configuration runs in its own subprocess with a time limit, so its peak
RSS is its own and a wedged run is reported instead of blocking the table.

Usage:

  python -m experiments.bench_model
  python -m experiments.bench_model --patterns=KKKK --seq_lens=2048 \
      --kda_chunk_sizes=32,64,128
  python -m experiments.bench_model --patterns= --moe_seq_lens=512,2048

A second table (`--moe_seq_lens`, empty = none) compares MoE feed-forwards
with the dense model of equal active parameters: the dense SwiGLU
(F = mlp_hidden_dim) vs `E` routed experts of width F/3, top-2, plus one
shared expert (active width 3 x F/3 = F) after a first dense layer, for each
`E` in `--moe_num_experts` and each grouped-matmul implementation in
`--moe_impls` (`ragged_dot`: dense over the experts, the layer before
`kda_lm.ops.gmm`; `auto`: the XLA tile loop on CPU).

A third table (`--tiny_rounds`, 0 = none) times the config's own model as
configured (ling3_tiny: 8 experts, 4 rows of 128 tokens) with each of
`--moe_impls`, alternating, `--tiny_rounds` rounds.
"""

import json
import resource
import subprocess
import sys
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from kda_lm import config as config_lib
from kda_lm import model

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/ling3_tiny.py", "Config file with a `model` dict.",
    lock_config=True)
_PATTERNS = flags.DEFINE_list("patterns", ["KKKM", "KKKK", "MMMM"],
                              "attention_pattern values to compare.")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["512", "2048", "8192"],
                              "Row lengths (tokens).")
_CHUNKS = flags.DEFINE_list(
    "kda_chunk_sizes", [], "KDA chunk sizes to sweep; empty = the config's.")
_ROWS = flags.DEFINE_integer("rows", 1, "Rows (batch size) per step.")
_SECONDS = flags.DEFINE_float("seconds", 3.0,
                              "Minimum timed seconds per configuration.")
_MIN_STEPS = flags.DEFINE_integer("min_steps", 2, "Minimum timed steps.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 420,
                                "Time limit per configuration (seconds).")
_MOE_SEQ_LENS = flags.DEFINE_list(
    "moe_seq_lens", ["512", "2048"],
    "Row lengths of the MoE vs dense table; empty = no MoE table.")
_MOE_EXPERTS = flags.DEFINE_list("moe_num_experts", ["8", "32"],
                                 "Routed experts of the MoE rows.")
_MOE_IMPLS = flags.DEFINE_list(
    "moe_impls", ["ragged_dot", "auto"],
    "Grouped-matmul implementations (model.moe_impl) of the MoE rows.")
_TINY_ROUNDS = flags.DEFINE_integer(
    "tiny_rounds", 2, "Alternating rounds of the config's own model with "
    "each of --moe_impls; 0 = no such table.")
_CHILD = flags.DEFINE_string(
    "child", None, "Internal: run one configuration given as JSON "
    "{pattern, seq_len, chunk[, model, rows]} and print its result as "
    "JSON.")


def _batch(batch, seq_len, vocab, seed=0):
  """Random tokens packed as documents of 64..seq_len tokens (no padding)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (batch, seq_len)).astype(np.int32)
  seg = np.zeros((batch, seq_len), np.int32)
  for b in range(batch):
    t, doc = 0, 1
    while t < seq_len:
      n = int(rng.integers(64, seq_len + 1))
      seg[b, t:t + n] = doc
      t, doc = t + n, doc + 1
  return jnp.asarray(tokens), jnp.asarray(seg)


def _peak_mib(compiled):
  stats = jax.devices()[0].memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    return stats["peak_bytes_in_use"] / 2**20
  m = compiled.memory_analysis()
  total = (m.argument_size_in_bytes + m.output_size_in_bytes
           + m.temp_size_in_bytes - m.alias_size_in_bytes)
  return total / 2**20


def bench(model_config, seq_len: int, *, rows: int, seconds: float,
          min_steps: int) -> dict[str, float]:
  """Times forward+backward of one model configuration in this process.

  Args:
    model_config: the model's settings, typed.
    seq_len: row length.
    rows: rows per step.
    seconds: minimum timed seconds.
    min_steps: minimum timed steps.

  Returns:
    A dict with `compile_s`, `step_s`, `tokens_per_s`, `xla_mib`, `rss_mib`.
  """
  m = model.build(model_config)
  tokens, seg = _batch(rows, seq_len, model_config.vocab_size)
  params = jax.jit(m.init)(jax.random.key(0), tokens[:1, :64], seg[:1, :64])

  def loss_fn(p, tokens, seg):
    logits = m.apply(p, tokens, seg)
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    mask = (seg[:, 1:] == seg[:, :-1]).astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)

  start = time.perf_counter()
  compiled = jax.jit(jax.value_and_grad(loss_fn)).lower(
      params, tokens, seg).compile()
  compile_s = time.perf_counter() - start
  jax.block_until_ready(compiled(params, tokens, seg))   # warm-up
  steps, start = 0, time.perf_counter()
  while steps < min_steps or time.perf_counter() - start < seconds:
    jax.block_until_ready(compiled(params, tokens, seg))
    steps += 1
  step_s = (time.perf_counter() - start) / steps
  rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  return dict(compile_s=compile_s, step_s=step_s,
              tokens_per_s=rows * seq_len / step_s,
              xla_mib=_peak_mib(compiled), rss_mib=rss_mib)


def _config(pattern: str, chunk: int, overrides: dict | None = None
            ) -> config_lib.ModelConfig:
  """The pattern table's model: dense SwiGLU FFNs (MoE rows override)."""
  cfg = _CONFIG.value.model.copy_and_resolve_references()
  cfg.num_experts = 0
  cfg.attention_pattern = pattern
  cfg.kda_chunk_size = chunk
  cfg.update(overrides or {})
  return config_lib.ModelConfig.from_config(cfg)


def _moe_overrides(num_experts: int) -> dict:
  """Model keys of a MoE with the dense model's active FFN width."""
  width = _CONFIG.value.model.mlp_hidden_dim // 3
  return dict(num_experts=num_experts, num_experts_per_tok=2,
              num_shared_experts=1, moe_intermediate_size=width,
              first_k_dense_replace=1)


def _run_child(pattern: str, seq_len: int, chunk: int,
               overrides: dict | None = None, rows: int | None = None
               ) -> dict | str:
  """Runs one configuration in a subprocess; returns its result or why not."""
  spec = dict(pattern=pattern, seq_len=seq_len, chunk=chunk,
              rows=rows or _ROWS.value)
  if overrides:
    spec["model"] = overrides
  spec = json.dumps(spec)
  argv = [sys.executable, "-m", "experiments.bench_model", f"--child={spec}"]
  argv += [a for a in sys.argv[1:] if a.startswith("--config")]
  argv += [f"--seconds={_SECONDS.value}",
           f"--min_steps={_MIN_STEPS.value}"]
  try:
    out = subprocess.run(argv, capture_output=True, text=True, check=False,
                         timeout=_TIMEOUT.value)
  except subprocess.TimeoutExpired:
    return f"timeout > {_TIMEOUT.value} s"
  for line in reversed(out.stdout.splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  logging.error("child %s failed:\n%s", spec, out.stderr[-2000:])
  return f"failed (rc {out.returncode})"


def main(argv):
  del argv
  if _CHILD.value:
    spec = json.loads(_CHILD.value)
    cfg = _config(spec["pattern"], spec["chunk"], spec.get("model"))
    result = bench(cfg, spec["seq_len"],
                   rows=spec["rows"], seconds=_SECONDS.value,
                   min_steps=_MIN_STEPS.value)
    print(json.dumps(result), flush=True)
    return
  base = _CONFIG.value.model
  chunks = [int(c) for c in _CHUNKS.value] or [base.kda_chunk_size]
  print(f"backend {jax.default_backend()}, d_model {base.d_model}, "
        f"{_ROWS.value} row(s) per step, compute {base.compute_dtype}, "
        f"kda_impl {base.kda_impl}\n")
  print("| pattern | seq_len | kda chunk | step s | tokens/s | XLA MiB "
        "| RSS MiB |")
  print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
  for pattern in _PATTERNS.value:
    for seq_len in (int(s) for s in _SEQ_LENS.value):
      for chunk in chunks if "K" in pattern else chunks[:1]:
        r = _run_child(pattern, seq_len, chunk)
        chunk_s = str(chunk) if "K" in pattern else "-"
        if isinstance(r, str):
          print(f"| {pattern} | {seq_len} | {chunk_s} | {r} | | | |",
                flush=True)
          continue
        print(f"| {pattern} | {seq_len} | {chunk_s} | {r['step_s']:.3f} "
              f"| {r['tokens_per_s']:,.0f} | {r['xla_mib']:,.0f} "
              f"| {r['rss_mib']:,.0f} |", flush=True)
  if _MOE_SEQ_LENS.value:
    _moe_table(base, chunks[0])
  if _TINY_ROUNDS.value:
    _tiny_table(base, chunks[0])


def _tiny_table(base, chunk: int) -> None:
  """The config's own model (its MoE) with each grouped matmul."""
  rows, seq_len = _CONFIG.value.data.batch_size, _CONFIG.value.data.seq_len
  keys = ("num_experts", "num_experts_per_tok", "num_shared_experts",
          "moe_intermediate_size", "first_k_dense_replace")
  model_keys = {k: base[k] for k in keys}
  print(f"\nThe config's model as configured ({base.num_experts} experts, "
        f"top-{base.num_experts_per_tok}), {rows} rows of {seq_len} tokens, "
        f"{_TINY_ROUNDS.value} alternating rounds\n")
  print("| round | moe_impl | step s | tokens/s | XLA MiB |")
  print("| ---: | --- | ---: | ---: | ---: |", flush=True)
  for round_ in range(1, _TINY_ROUNDS.value + 1):
    for impl in _MOE_IMPLS.value:
      r = _run_child(base.attention_pattern, seq_len, chunk,
                     dict(model_keys, moe_impl=impl), rows)
      if isinstance(r, str):
        print(f"| {round_} | {impl} | {r} | | |", flush=True)
        continue
      print(f"| {round_} | {impl} | {r['step_s']:.4f} "
            f"| {r['tokens_per_s']:,.0f} | {r['xla_mib']:,.0f} |",
            flush=True)


def _moe_table(base, chunk: int) -> None:
  """MoE rows vs the dense model of equal active parameters."""
  pattern = base.attention_pattern
  width = base.mlp_hidden_dim // 3
  print(f"\nMoE vs dense, pattern {pattern}, layer 0 dense in all rows "
        f"(active FFN width {base.mlp_hidden_dim} everywhere)\n")
  print("| FFN | seq_len | params | step s | tokens/s | XLA MiB | RSS MiB |")
  print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
  rows = [(f"dense SwiGLU {base.mlp_hidden_dim}", {})]
  rows += [(f"MoE {e} x {width}, top-2 + 1 shared, {impl}",
            dict(_moe_overrides(int(e)), moe_impl=impl))
           for e in _MOE_EXPERTS.value for impl in _MOE_IMPLS.value]
  for name, overrides in rows:
    params = model.param_count(_config(pattern, chunk, overrides))
    for seq_len in (int(s) for s in _MOE_SEQ_LENS.value):
      r = _run_child(pattern, seq_len, chunk, overrides)
      if isinstance(r, str):
        print(f"| {name} | {seq_len} | {params:,} | {r} | | | |", flush=True)
        continue
      print(f"| {name} | {seq_len} | {params:,} | {r['step_s']:.3f} "
            f"| {r['tokens_per_s']:,.0f} | {r['xla_mib']:,.0f} "
            f"| {r['rss_mib']:,.0f} |", flush=True)


if __name__ == "__main__":
  app.run(main)
