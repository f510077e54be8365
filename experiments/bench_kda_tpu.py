r"""Benchmarks the KDA op on an accelerator, side by side in one process.

For each row length T (B = tokens / T rows, at least 1), times the forward
and the forward+backward of `chunk_kda` with impl "pallas" (one row per
kernel-options variant), impl "xla", and JAX's splash attention (causal,
with the same segment ids) at the same shapes: H heads, K = V = head_dim,
bfloat16 inputs, the bounded gate computed in the kernel (lower_bound -5,
`safe_gate`), in-kernel q/k L2 norm, one document per `--doc_len` tokens.
The KDA inputs are token-major [B,T,H*K], as the KDA layer has them (see
`kda_program`).
The programs of a row length are timed alternately (`--repeats` rounds,
the median reported), after the same run has measured its own matmul rate
(an 8192^3 bfloat16 matmul). Prints a markdown table: ms, tokens/s, chunk
TFLOP/s (`common.chunk_flops_per_token_head`: forward F, forward+backward 3F)
and that rate as a fraction of the measured matmul rate.

  python -m experiments.bench_kda_tpu
  python -m experiments.bench_kda_tpu --seq_lens=8192 --nosplash \
      --variants='h4:heads_per_program=4;st:state_precision=highest'

A variant is `name:field=value,...` over `pallas.for_platform(<backend>)`.
"""

import dataclasses
import json
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from kda_lm.ops import chunk_kda
from kda_lm.ops.kda import common, pallas
from testbed import kda_cases, timing

_TOKENS = flags.DEFINE_integer("tokens", 16384, "Tokens per batch (B*T).")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["2048", "8192", "32768",
                                           "131072"], "Row lengths T.")
_HEADS = flags.DEFINE_integer("heads", 16, "Heads H.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "K = V.")
_DOC_LEN = flags.DEFINE_integer("doc_len", 2048, "Tokens per document.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds (median).")
_VARIANTS = flags.DEFINE_string(
    "variants", "default:", "Pallas kernel-option variants, "
    "'name:field=value,...' separated by ';'.")
_XLA = flags.DEFINE_bool("xla", True, "Also time impl='xla'.")
_SPLASH = flags.DEFINE_bool("splash", True, "Also time splash attention.")
_SPLASH_MAX_T = flags.DEFINE_integer("splash_max_t", 32768, "Longest T for "
                                     "splash attention.")
_MODES = flags.DEFINE_list("modes", ["fwd", "fwd+bwd"], "What to time.")
_JSON = flags.DEFINE_string("json", None, "Also write the rows here.")


def parse_variants(text, base):
  """[(name, KernelOptions)] from 'name:field=value,...;...'."""
  out = []
  for item in filter(None, (x.strip() for x in text.split(";"))):
    name, _, fields = item.partition(":")
    changes = {}
    for pair in filter(None, fields.split(",")):
      key, value = pair.split("=", 1)
      kind = type(getattr(base, key))
      if kind is bool:
        changes[key] = value in ("1", "true", "True")
      elif kind is int:
        changes[key] = int(value)
      else:
        changes[key] = None if value == "None" else value
    out.append((name, dataclasses.replace(base, **changes)))
  return out


def kda_program(impl, options, backward):
  """jit of the forward (o) or of the gradient of sum(o * do).

  q, k, v, g and do arrive token-major, [B,T,H*K], and are reshaped to
  [B,T,H,K] inside the program, as the KDA layer feeds the op (its
  projections produce [B,T,H*K]); do is bfloat16, like the cotangent the
  layer's output projection sends back.
  """
  static = dict(use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True,
                use_qk_l2norm_in_kernel=True, impl=impl)
  if options is not None:
    static["pallas_options"] = options

  def forward(p, seg):
    H = p["A_log"].shape[0]
    heads = lambda x: x.reshape(x.shape[:2] + (H, -1))
    o, _ = chunk_kda(heads(p["q"]), heads(p["k"]), heads(p["v"]),
                     heads(p["g"]), p["beta"], A_log=p["A_log"],
                     dt_bias=p["dt_bias"], segment_ids=seg, **static)
    return o.reshape(o.shape[:2] + (-1,))

  if not backward:
    return jax.jit(forward)

  def loss(p, seg, do):
    return jnp.sum((forward(p, seg) * do).astype(jnp.float32))

  return jax.jit(jax.grad(loss))


def splash_program(B, T, H, backward, block):
  """jit of causal splash attention with segment ids ([B,H,T,D] inputs),
  with `block`-sized tiles everywhere, or its default tiles (None)."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu import splash_attention
  sk = splash_attention.splash_attention_kernel
  sm = splash_attention.splash_attention_mask
  sizes = None
  if block:
    blk = min(block, T)
    sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk,
                          block_q_dkv=blk, block_kv_dkv=blk,
                          block_kv_dkv_compute=blk, block_q_dq=blk,
                          block_kv_dq=blk)
  mask = sm.MultiHeadMask([sm.CausalMask((T, T)) for _ in range(H)])
  kernel = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1,
                              q_seq_shards=1)

  def forward(p, seg):
    ids = sk.SegmentIds(q=seg, kv=seg)
    return jax.vmap(kernel)(p["q"], p["k"], p["v"], segment_ids=ids)

  if not backward:
    return jax.jit(forward)

  def loss(p, seg, do):
    return jnp.sum(forward(p, seg).astype(jnp.float32) * do)

  return jax.jit(jax.grad(loss))


def inputs(B, T, H, D, doc_len, seed=0):
  """bfloat16 KDA inputs, token-major [B,T,H*D] (bounded gate); splash
  inputs [B,H,T,D]; ids; the output cotangent (KDA [B,T,H*D])."""
  rng = np.random.default_rng(seed)
  raw, _ = kda_cases.kda_inputs(rng, B, T, H, D, D, gate="safe", l2norm=True,
                                h0=False)
  kda = {n: jnp.asarray(x, jnp.float32 if n in ("A_log", "dt_bias")
                        else jnp.bfloat16) for n, x in raw.items()}
  splash = {n: jnp.transpose(kda[n], (0, 2, 1, 3)) for n in ("q", "k", "v")}
  for n in ("q", "k", "v", "g"):
    kda[n] = kda[n].reshape(B, T, H * D)
  seg = jnp.asarray(np.broadcast_to(
      1 + np.arange(T) // doc_len, (B, T)).astype(np.int32))
  do = jnp.asarray(rng.standard_normal((B, T, H * D)), jnp.bfloat16)
  return kda, splash, seg, do


def matmul_tflops(n=8192, repeats=5):
  """This device's rate on an n^3 bfloat16 matmul, TFLOP/s."""
  return timing.matmul_rate(n, jnp.bfloat16, repeats) / 1e12


def time_programs(programs, repeats):
  """{name: (median seconds, compile seconds)}: compiles and warms each
  (fn, args), then times them in alternating rounds."""
  compiled = {}
  for name, (fn, args) in programs.items():
    start = time.perf_counter()
    try:
      c = fn.lower(*args).compile()
      jax.block_until_ready(c(*args))
    except Exception as e:  # pylint: disable=broad-except
      print(f"  {name}: failed: {type(e).__name__}: "
            f"{str(e).splitlines()[0][:300]}", flush=True)
      continue
    compiled[name] = (c, args, time.perf_counter() - start)
  times = {name: [] for name in compiled}
  for _ in range(repeats):
    for name, (c, args, _) in compiled.items():
      t = time.perf_counter()
      jax.block_until_ready(c(*args))
      times[name].append(time.perf_counter() - t)
  return {name: (statistics.median(ts), compiled[name][2])
          for name, ts in times.items()}


def rows_for_length(T, variants, rate, repeats):
  """Table rows for one row length."""
  B = max(1, _TOKENS.value // T)
  H, D = _HEADS.value, _HEAD_DIM.value
  kda, splash, seg, do = inputs(B, T, H, D, _DOC_LEN.value)
  programs = {}
  for mode in _MODES.value:
    bwd = mode == "fwd+bwd"
    extra = (do,) if bwd else ()
    for name, opts in variants:
      programs[(f"pallas {name}", mode)] = (
          kda_program("pallas", opts, bwd), (kda, seg) + extra)
    if _XLA.value:
      programs[("xla", mode)] = (kda_program("xla", None, bwd),
                                 (kda, seg) + extra)
    if _SPLASH.value and T <= _SPLASH_MAX_T.value:
      sdo = (jnp.transpose(do.reshape(B, T, H, D), (0, 2, 1, 3)),) \
          if bwd else ()
      for block in (512, None):
        label = f"{block} tiles" if block else "default tiles"
        programs[(f"splash causal, {label}", mode)] = (
            splash_program(B, T, H, bwd, block), (splash, seg) + sdo)
  timed = time_programs(programs, repeats)
  rows = []
  for (name, mode), (sec, comp) in timed.items():
    flops = common.chunk_flops_per_token_head(D, D, 64, backward=mode != "fwd")
    tflops = flops * B * T * H / sec / 1e12
    chunk = name.startswith(("pallas", "xla"))
    rows.append(dict(
        T=T, B=B, impl=name, mode=mode, ms=sec * 1e3,
        tokens_per_s=B * T / sec, compile_s=comp,
        chunk_tflops=tflops if chunk else None,
        of_matmul=tflops / rate if chunk else None))
  return rows


def format_table(rows, rate):
  lines = [f"matmul rate (8192^3 bfloat16, same run): {rate:.1f} TFLOP/s",
           "",
           "| B x T | impl | mode | ms | tokens/s | chunk TFLOP/s | "
           "of matmul rate | compile s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    tf = "" if r["chunk_tflops"] is None else f"{r['chunk_tflops']:.1f}"
    fr = "" if r["of_matmul"] is None else f"{100 * r['of_matmul']:.1f}%"
    lines.append(f"| {r['B']} x {r['T']} | {r['impl']} | {r['mode']} | "
                 f"{r['ms']:.2f} | {r['tokens_per_s']:,.0f} | {tf} | {fr} | "
                 f"{r['compile_s']:.1f} |")
  return "\n".join(lines)


def main(argv):
  del argv
  print(f"devices: {jax.devices()}", flush=True)
  backend = pallas.options.backend_platform()
  variants = parse_variants(_VARIANTS.value, pallas.for_platform(backend))
  for name, opts in variants:
    print(f"variant {name}: {opts}", flush=True)
  rate = matmul_tflops()
  print(f"matmul rate: {rate:.1f} TFLOP/s", flush=True)
  rows = []
  for T in (int(t) for t in _SEQ_LENS.value):
    rows += rows_for_length(T, variants, rate, _REPEATS.value)
    print(format_table(rows, rate), flush=True)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(dict(matmul_tflops=rate, rows=rows), f, indent=1)


if __name__ == "__main__":
  app.run(main)
