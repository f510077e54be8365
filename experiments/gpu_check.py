r"""GPU benchmark of the Pallas KDA kernels against the xla path, same run.

Run by experiments/gpu_check.sh on an H100/H200 (jax with CUDA). For
B=1, T=8192, H=16, K=V=128 bfloat16 inputs, with segment_ids all ones and
with `--docs` documents per row, it times the forward and forward+backward
of `chunk_kda` for each `--impls` (median of `--repeats` after a warm-up,
`block_until_ready` around each call) and prints a markdown table with:

* ms, tokens/s and the speed-up of pallas over xla;
* model TFLOP/s: F = 6CK + 4CV + 6KV + C^2/3 matmul FLOPs per token and head
  (C=64) forward, 3F forward+backward (the formula of bench_kda.py), against
  the device's dense bf16 tensor-core peak and its FP32 (FMA) peak: the
  kernels' dots are float32 at HIGHEST precision (IEEE on Triton), which do
  not use tensor cores;
* model GB/s: bytes of every Pallas kernel operand and result (the least the
  kernels must move through HBM; canonicalisation outside them not counted)
  against the device's HBM peak;
* the relative error of pallas vs xla on o (bf16 inputs, same canonical
  float32 math), a correctness check at this size.

FLA's published chunk_kda forward at this shape on an H100 is ~0.93 ms
(a third-party measurement); the targets are a forward within 2x of it and a
forward+backward at least 5x faster than xla.

Usage:

  python -m experiments.gpu_check                       # the default table
  python -m experiments.gpu_check --num_warps=4,8       # sweep Triton warps
  python -m experiments.gpu_check --v_blocks=32,64,128  # sweep V blocks

Pallas runs once per (num_warps, v_block, precision), each a
`pallas.KernelOptions` over the default backend's: `--v_blocks` sets
`v_block`, the state columns each recurrence program owns (128 = one
program per (b, h)); `--precisions` sets `precision` ("bf16" = bfloat16
operands on tensor cores, the GPU default; "tf32"; "highest" = IEEE
float32 dots).
"""

import dataclasses
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from kda_lm.ops import chunk_kda
from kda_lm.ops.kda import pallas
from testbed import kda_cases, numerics

_T = flags.DEFINE_integer("seq_len", 8192, "Tokens per row T.")
_B = flags.DEFINE_integer("batch", 1, "Rows B.")
_H = flags.DEFINE_integer("heads", 16, "Heads H.")
_D = flags.DEFINE_integer("head_dim", 128, "K = V.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Input dtype.")
_DOCS = flags.DEFINE_integer("docs", 8, "Documents per row in the segmented "
                             "runs.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed runs after a warm-up.")
_IMPLS = flags.DEFINE_list("impls", ["pallas", "xla"], "Implementations.")
_WARPS = flags.DEFINE_list("num_warps", [], "Triton num_warps values to "
                           "sweep for pallas (default: the module's).")
_VBLOCKS = flags.DEFINE_list("v_blocks", ["64"], "V columns per program "
                             "to sweep for pallas.")
_PRECISIONS = flags.DEFINE_list("precisions", ["bf16", "tf32"],
                                "In-kernel dot precisions to sweep for pallas "
                                "(KernelOptions.precision).")

CHUNK = 64
FLA_FWD_MS_H100 = 0.93
# Dense peaks (TFLOP/s bf16 tensor core, TFLOP/s FP32 FMA, TB/s HBM), from
# NVIDIA's data sheets (SXM parts).
PEAKS = {"H100": (989.0, 67.0, 3.35), "H200": (989.0, 67.0, 4.8)}


def device_peaks():
  kind = jax.devices()[0].device_kind
  for name, peaks in PEAKS.items():
    if name in kind:
      return kind, peaks
  return kind, None


def flops(B, T, H, K, V, backward):
  f = 6 * CHUNK * K + 4 * CHUNK * V + 6 * K * V + CHUNK * CHUNK / 3
  return B * T * H * f * (3 if backward else 1)


def kernel_bytes(B, T, H, K, V, backward):
  """Bytes of the Pallas kernels' operands and results (all float32), each
  kernel's counted once (V blocks re-reading w and k E not counted)."""
  n = -(-T // CHUNK)
  tp = n * CHUNK
  C, S = CHUNK, K * V
  inputs = 3 * K + V + 1                 # q, k, g, v, beta per token, head
  seg = 2 * B * tp                       # run, reset (per row)
  per_tok = {  # (per token and head, per chunk and head, per head)
      "intra": (inputs + 3 * K + V + C, K, 0),   # -> w, u, qF, kE, Aqk, Dv
      "recur": (2 * K + 2 * V, K + S, 2 * S),    # w, u, kE, Dv, h0 -> v_new
      "out": (K + C + 2 * V, S, 0),              # qF, S_in, Aqk, v_new -> o
      "out_bwd": (K + C + 2 * V, S, 0),          # qF, Aqk, do -> Aqk^T do, ...
      "recur_bwd": (V + 2 * K, 2 * S + K, 2 * S),
      "chunk_bwd": (2 * inputs + V, 2 * S, 0),   # + S_in, dS', do -> grads
  }
  kernels = ["intra", "recur", "out"]
  if backward:
    kernels += ["out_bwd", "recur_bwd", "chunk_bwd"]
  total = 0
  for name in kernels:
    tok, chunk, head = per_tok[name]
    total += B * H * (tp * tok + n * chunk + head)
    if name in ("intra", "chunk_bwd"):
      total += seg
  return 4 * total


def make_inputs(seed, B, T, H, D, dtype, docs):
  """Bounded-gate inputs (`kda_cases.kda_inputs`) in `dtype`, all-ones and
  `docs`-document segment ids, cotangents."""
  rng = np.random.default_rng(seed)
  raw, _ = kda_cases.kda_inputs(rng, B, T, H, D, D, gate="safe", l2norm=True,
                                h0=False)
  params = {n: jnp.asarray(x, jnp.float32 if n in ("A_log", "dt_bias")
                           else dtype) for n, x in raw.items()}
  do, dht = kda_cases.kda_cotangents(rng, (B, T, H, D), B, D)
  segmented = np.broadcast_to(kda_cases.document_ids(rng, 1, T, docs), (B, T))
  ones = np.ones((B, T), np.int32)
  return (params, jnp.asarray(ones), jnp.asarray(segmented),
          dict(do=jnp.asarray(do), dht=jnp.asarray(dht)))


STATIC = dict(use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True,
              use_qk_l2norm_in_kernel=True, output_final_state=True)


def build(impl, backward, options=None):
  def forward(params, seg):
    return chunk_kda(**params, segment_ids=seg, impl=impl,
                     pallas_options=options, **STATIC)

  if not backward:
    return jax.jit(forward)

  def loss(params, seg, cot):
    o, s = forward(params, seg)
    return (jnp.sum(o.astype(jnp.float32) * cot["do"])
            + jnp.sum(s * cot["dht"]))

  return jax.jit(jax.grad(loss))


def timed(fn, args, repeats):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))                # compile + warm-up
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times), first, out


def main(argv):
  del argv
  B, T, H, D = _B.value, _T.value, _H.value, _D.value
  dtype = jnp.dtype(_DTYPE.value)
  kind, peaks = device_peaks()
  print(f"device: {kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"pallas {pallas.default_options()}")
  params, ones, segmented, cot = make_inputs(0, B, T, H, D, dtype, _DOCS.value)
  variants = [(impl, None) for impl in _IMPLS.value if impl != "pallas"]
  if "pallas" in _IMPLS.value:
    warps = _WARPS.value or [str(pallas.default_options().num_warps)]
    variants = [("pallas", (w, vb, pr)) for w in warps
                for vb in _VBLOCKS.value for pr in _PRECISIONS.value
                ] + variants
  rows, outs, ms = [], {}, {}
  for impl, setting in variants:
    label, options = impl, None
    if setting is not None:
      warps, v_block, precision = setting
      options = dataclasses.replace(
          pallas.default_options(), num_warps=int(warps),
          v_block=int(v_block), precision=precision)
      label = f"{impl} (warps {warps}, V block {v_block}, {precision})"
    for seg_name, seg in (("none", ones), (f"{_DOCS.value} docs", segmented)):
      for backward in (False, True):
        fn = build(impl, backward, options)
        args = (params, seg, cot) if backward else (params, seg)
        sec, first, out = timed(fn, args, _REPEATS.value)
        if not backward:
          outs[label, seg_name] = out[0]
        ms[label, seg_name, backward] = sec * 1e3
        f = flops(B, T, H, D, D, backward)
        by = kernel_bytes(B, T, H, D, D, backward)
        tflops, gbs = f / sec / 1e12, by / sec / 1e9
        row = [label, seg_name, "fwd+bwd" if backward else "fwd",
               f"{sec * 1e3:.3f}", f"{first:.1f}", f"{B * T / sec / 1e6:.2f}M",
               f"{tflops:.2f}", f"{gbs:.0f}"]
        if peaks:
          row += [f"{100 * tflops / peaks[1]:.1f}%",
                  f"{100 * tflops / peaks[0]:.2f}%",
                  f"{100 * gbs / (peaks[2] * 1e3):.1f}%"]
        rows.append(row)
        print("  " + " | ".join(row), flush=True)

  head = ["impl", "segments", "pass", "ms", "first call s", "tok/s",
          "model TFLOP/s", "kernel GB/s"]
  if peaks:
    head += ["of FP32 peak", "of bf16 peak", "of HBM peak"]
  print(f"\n## Pallas KDA on {kind}: B={B}, T={T}, H={H}, K=V={D}, "
        f"{dtype.name}, safe gate, q/k L2 norm\n")
  print("| " + " | ".join(head) + " |")
  print("|" + "|".join("---" for _ in head) + "|")
  for r in rows:
    print("| " + " | ".join(r) + " |")
  print()
  if "xla" in _IMPLS.value:
    for (label, seg_name, backward), t in ms.items():
      if label.startswith("pallas"):
        x = ms.get(("xla", seg_name, backward))
        if x:
          print(f"speed-up {label} over xla, {seg_name}, "
                f"{'fwd+bwd' if backward else 'fwd'}: {x / t:.2f}x")
    for (label, seg_name), o in outs.items():
      if label.startswith("pallas"):
        print(f"rel_err(o) {label} vs xla, {seg_name}: "
              f"{numerics.rel_err(o, outs['xla', seg_name]):.2e}")
  for (label, seg_name, backward), t in ms.items():
    if label.startswith("pallas") and not backward and seg_name == "none":
      print(f"{label} forward vs FLA chunk_kda on H100 ({FLA_FWD_MS_H100} "
            f"ms): {t / FLA_FWD_MS_H100:.2f}x the time")
  print("\nmodel TFLOP/s: F = 6CK + 4CV + 6KV + C^2/3 per token and head, 3F "
        "for fwd+bwd; kernel GB/s: bytes of all Pallas kernel operands and "
        "results / time (canonicalisation outside the kernels not counted). "
        "Peaks from NVIDIA data sheets (dense bf16 / FP32 FMA / HBM).")


if __name__ == "__main__":
  app.run(main)
