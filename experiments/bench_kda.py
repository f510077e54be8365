r"""Benchmarks the KDA op: an implementation vs the reference scan, same run.

For every gate mode, dtype, batch B and length T (H=4, K=V=128 by default) it
compiles forward and forward+backward of `kda_lm.ops.chunk_kda` for `--impl`
and for `"reference"`, reads the compiled memory (`memory_analysis()`), runs
each one a warm-up then `--repeats` times and reports the median time. Then it
prints markdown tables:

* time of the impl and of the reference, their ratio, tokens/s of the impl,
  memory ("work MiB" = XLA temp buffers, plus arguments+outputs), and the
  impl's achieved GFLOP/s next to this machine's large-matmul GFLOP/s
  (a 2048x2048 float32 matmul, measured in the same run);
* T-scaling: cost at the longest T / cost at the previous T;
* segment_ids overhead: forward+backward of the impl with `--docs` documents
  per row vs without (first dtype only: every dtype is upcast to float32 on
  entry, so the segment cost does not depend on it).

Gate modes (`--gate`): "safe" is the realistic bounded form used in training
(raw gates, use_gate_in_kernel with lower_bound=-5 and safe_gate=True);
"exact" passes pre-activated log-sigmoid gates (unbounded, the general path).
Both use the in-kernel q/k L2 norm. The default runs both.

`--compare=REV` also times the same shapes with the op of git revision REV
(checked out into a temporary `git worktree`, imported under its own module
objects), alternating run by run with the current tree and the reference, so
the speed-up over REV is a ratio measured in the same run (columns
`REV ms` and `REV/impl`).

A measurement that does not finish within `--hang_s` (e.g. a deadlocked XLA
CPU thread pool) stops the run: the table so far is printed with a HUNG line
and the process exits with status 2.

The reference's backward stores one [B,H,K,V] state per token (> 24 GiB at
T=16384); any program whose compiled memory exceeds `--max_gib` is skipped
and says so.

Usage:

  python -m experiments.bench_kda                # the default table
  python -m experiments.bench_kda --quick        # T in {1024, 4096}, B=1
  python -m experiments.bench_kda --quick --compare=main --dtypes=float32
  python -m experiments.bench_kda --gate=safe --dtypes=float32 \
      --seq_lens=4096,16384 --batches=4
"""

import dataclasses
import importlib
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from kda_lm.ops import chunk_kda
from kda_lm.ops.kda import api, common
from testbed import kda_cases, timing

_IMPL = flags.DEFINE_string("impl", "xla", "Implementation to compare with "
                            "the reference (xla; later pallas).")
_QUICK = flags.DEFINE_bool("quick", False, "Fast check: T in {1024, 4096}, "
                           "B=1 (unless --seq_lens / --batches are given).")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["1024", "4096", "16384"],
                              "Sequence lengths T.")
_BATCHES = flags.DEFINE_list("batches", ["1", "4"], "Batch sizes B (1..4).")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"],
                            "Input dtypes of q, k, v, g, beta.")
_GATE = flags.DEFINE_enum("gate", "both", ["safe", "exact", "both"],
                          "Gate mode(s), see the module docstring.")
_COMPARE = flags.DEFINE_string("compare", None, "Git revision whose op is "
                               "timed alternately with the current tree.")
_HEADS = flags.DEFINE_integer("heads", 4, "Heads H.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "K = V.")
_DOCS = flags.DEFINE_integer("docs", 10, "Documents per row for the "
                             "segment_ids rows (0 to skip them).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs after a warm-up; "
                                "the median is reported.")
_MAX_GIB = flags.DEFINE_float("max_gib", 12.0, "Skip a program whose "
                              "compiled memory (work+args+out) exceeds this.")
_HANG_S = flags.DEFINE_float("hang_s", 900.0, "Give up (print what was "
                             "measured, exit 2) if one measurement takes "
                             "longer than this.")

_CHUNK = flags.DEFINE_integer("chunk_size", None, "chunk_size passed to "
                              "chunk_kda (default: the op's choice per "
                              "backend, `api.default_chunk_size`).")

MIB = 2.0 ** 20


def matmul_gflops(n=2048, repeats=3):
  """This machine's large-matmul rate: an n x n float32 matmul."""
  return timing.matmul_rate(n, jnp.float32, repeats) / 1e9


@dataclasses.dataclass
class Result:
  seconds: float | None = None   # median; None when skipped
  work_mib: float = 0.0          # temp_size_in_bytes
  io_mib: float = 0.0            # argument + output sizes
  note: str = ""


def make_inputs(rng, B, T, H, D, dtype, gate, docs):
  """(differentiable params, fixed args, static kwargs, segment ids) for one
  config: `kda_cases.kda_inputs` with gate "safe" (bounded) or "exact"
  (pre-activated log-sigmoid), in `dtype`."""
  raw, static = kda_cases.kda_inputs(
      rng, B, T, H, D, D, gate="pre" if gate == "exact" else gate,
      l2norm=True, h0=False)
  static["output_final_state"] = True
  if _CHUNK.value is not None:
    static["chunk_size"] = _CHUNK.value
  params = {n: jnp.asarray(x, jnp.float32 if n in ("A_log", "dt_bias")
                           else dtype) for n, x in raw.items()}
  do, dht = kda_cases.kda_cotangents(rng, (B, T, H, D), B, D)
  fixed = dict(do=jnp.asarray(do), dht=jnp.asarray(dht), segment_ids=None)
  return params, fixed, static, jnp.asarray(
      kda_cases.document_ids(rng, B, T, docs))




def build(op, impl, backward, static):
  """jit of the forward, or of the gradient of sum(o*do) + sum(S*dht)."""
  def forward(params, fixed):
    return op(**params, segment_ids=fixed["segment_ids"], impl=impl,
              **static)

  if not backward:
    return jax.jit(forward)

  def loss(params, fixed):
    o, s = forward(params, fixed)
    return (jnp.sum(o.astype(jnp.float32) * fixed["do"])
            + jnp.sum(s * fixed["dht"]))

  return jax.jit(jax.grad(loss))


def measure(fns, repeats, max_gib):
  """Compiles each (fn, params, fixed), reads its memory, warms it up, then
  times them alternately `repeats` times. Returns a Result per entry.

  Each timed call follows an untimed call of the same program: a program
  timed right after another inherits its memory state (after the
  reference's backward, with GiBs of working memory, the next program ran
  up to 2.7x slower), so no timing depends on the order of the programs.
  """
  compiled, results = [], []
  for fn, params, fixed in fns:
    c = fn.lower(params, fixed).compile()
    mem = c.memory_analysis()
    res = Result(work_mib=mem.temp_size_in_bytes / MIB,
                 io_mib=(mem.argument_size_in_bytes
                         + mem.output_size_in_bytes) / MIB)
    total_gib = (res.work_mib + res.io_mib) / 1024
    if total_gib > max_gib:
      res.note = f"skipped: needs {total_gib:.1f} GiB > {max_gib:g} GiB"
      c = None
    else:
      jax.block_until_ready(c(params, fixed))               # warm-up
    compiled.append(c)
    results.append(res)
  times = [[] for _ in fns]
  for _ in range(repeats):
    for i, (c, (_, params, fixed)) in enumerate(zip(compiled, fns,
                                                    strict=True)):
      if c is None:
        continue
      jax.block_until_ready(c(params, fixed))               # re-warm
      t = time.perf_counter()
      jax.block_until_ready(c(params, fixed))
      times[i].append(time.perf_counter() - t)
  for res, ts in zip(results, times, strict=True):
    if ts:
      res.seconds = statistics.median(ts)
  return results


def load_revision(rev):
  """`chunk_kda` of git revision `rev`, from a temporary worktree.

  The revision's `kda_lm` is imported with `sys.modules` emptied of the
  current one and then restored, so both versions live side by side (each
  module keeps references to its own submodules).

  Returns:
    (chunk_kda, cleanup) where cleanup() removes the worktree.
  """
  root = subprocess.run(["git", "rev-parse", "--show-toplevel"],
                        capture_output=True, text=True, check=True
                        ).stdout.strip()
  path = tempfile.mkdtemp(prefix="bench_kda_")
  subprocess.run(["git", "worktree", "add", "--detach", path, rev],
                 cwd=root, check=True, capture_output=True)

  def cleanup():
    subprocess.run(["git", "worktree", "remove", "--force", path],
                   cwd=root, check=False, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)

  saved = {n: m for n, m in sys.modules.items()
           if n == "kda_lm" or n.startswith("kda_lm.")}
  for n in saved:
    del sys.modules[n]
  sys.path.insert(0, path)
  try:
    ops = importlib.import_module("kda_lm.ops")
    op = ops.chunk_kda
  finally:
    sys.path.remove(path)
    for n in [n for n in sys.modules
              if n == "kda_lm" or n.startswith("kda_lm.")]:
      del sys.modules[n]
    sys.modules.update(saved)
  return op, cleanup


def with_watchdog(seconds, fn, *args):
  """Runs fn(*args) in a thread; None if it is still running after
  `seconds` (an XLA computation cannot be cancelled, so the caller must
  report and exit)."""
  box = []
  thread = threading.Thread(target=lambda: box.append(fn(*args)),
                            daemon=True)
  thread.start()
  thread.join(seconds)
  if thread.is_alive():
    return None
  if not box:
    raise RuntimeError("measurement failed (see the traceback above)")
  return box[0]


def _ms(r):
  return "–" if r is None or r.seconds is None else f"{r.seconds * 1e3:.1f}"


def _ratio(num, den, fmt="{:.1f}x"):
  if not num or not den:
    return "–"
  return fmt.format(num / den)


def _table(head, rows):
  lines = ["| " + " | ".join(head) + " |",
           "|" + "|".join("---" for _ in head) + "|"]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


class Bench:
  """Runs the configurations and renders the markdown report."""

  def __init__(self, impl, H, D, repeats, max_gib, docs, hang_s,
               base=None, base_name=None, cleanup=lambda: None):
    self.impl, self.H, self.D = impl, H, D
    self.base, self.base_name = base, base_name   # --compare: REV's op
    self.cleanup = cleanup
    self.repeats, self.max_gib, self.docs = repeats, max_gib, docs
    self.hang_s = hang_s
    self.results = {}     # (gate, dtype, pass, B, T) -> {name: Result}
    self.order = []
    self.start = time.perf_counter()
    self.peak = matmul_gflops()
    self._log(f"2048^2 float32 matmul: {self.peak:.1f} GFLOP/s")

  def _log(self, msg):
    print(f"[{time.perf_counter() - self.start:6.0f}s] {msg}",
          file=sys.stderr, flush=True)

  def run(self, gate, dtype, B, T, with_segments):
    rng = np.random.default_rng(T * 10 + B)
    params, fixed, static, ids = make_inputs(rng, B, T, self.H, self.D,
                                             dtype, gate, self.docs)
    for backward in (False, True):
      pass_name = "fwd+bwd" if backward else "fwd"
      key = (gate, dtype.name, pass_name, B, T)
      self.results[key] = r = {}
      self.order.append(key)
      runs = [("impl", chunk_kda, self.impl, None),
              ("ref", chunk_kda, "reference", None)]
      if self.base is not None:
        runs.append(("base", self.base, self.impl, None))
      if with_segments and backward:
        runs.append(("seg", chunk_kda, self.impl, ids))
        if self.base is not None:
          runs.append(("base_seg", self.base, self.impl, ids))
      fns = []
      for _, op, who, seg in runs:
        fx = dict(fixed, segment_ids=seg) if backward else dict(
            segment_ids=seg)                 # the forward takes no cotangents
        fns.append((build(op, who, backward, static), params, fx))
      self._log(f"{gate} {dtype.name} {pass_name} B={B} T={T}: "
                + ", ".join(n for n, *_ in runs))
      res = with_watchdog(self.hang_s, measure, fns, self.repeats,
                          self.max_gib)
      if res is None:
        self.render(hung=f"{gate} {dtype.name} {pass_name} B={B} T={T}")
        sys.stdout.flush()
        self.cleanup()
        os._exit(2)                          # the hung XLA thread stays
      r.update({n: x for (n, *_), x in zip(runs, res, strict=True)})

  def _scaling_table(self):
    """Lines of the T-scaling table (time at the largest T / the next)."""
    seq_lens = sorted({k[4] for k in self.order})
    if len(seq_lens) < 2:
      return []
    t_hi, t_lo = seq_lens[-1], seq_lens[-2]
    scale = []
    for key in self.order:
      gate, dtype, pass_name, B, T = key
      lo = self.results.get((gate, dtype, pass_name, B, t_lo), {})
      if T != t_hi or "impl" not in self.results[key] or "impl" not in lo:
        continue
      hi = self.results[key]
      scale.append([gate, dtype, pass_name, str(B)] + [
          _ratio(hi[n].seconds, lo[n].seconds, "{:.2f}")
          for n in ("impl", "ref")])
    return [f"T-scaling: time at T={t_hi} / time at T={t_lo} (linear "
            f"= {t_hi / t_lo:g}).\n",
            _table(["gate", "dtype", "pass", "B", self.impl, "reference"],
                   scale), ""]

  def render(self, hung=None):
    impl, H, D = self.impl, self.H, self.D
    C = _CHUNK.value or api.default_chunk_size(impl)
    out = [f"## KDA op benchmark: `{impl}` vs `reference`\n",
           f"{os.cpu_count()} CPUs ({platform.machine()}), jax "
           f"{jax.__version__} ({jax.default_backend()}); H={H}, K=V={D}, "
           f"chunk {C}, in-kernel q/k L2 norm; median of {self.repeats} "
           f"runs after a warm-up. This machine's large-matmul rate "
           f"(2048x2048 float32 matmul, same run): **{self.peak:.1f} "
           "GFLOP/s**.\n"]
    head = ["gate", "dtype", "pass", "B", "T", f"{impl} ms", "ref ms",
            f"ref/{impl}", f"{impl} tok/s", f"{impl} work MiB",
            f"{impl} args+out MiB", "ref work MiB", "work ref/impl",
            f"{impl} GFLOP/s", "of matmul", "note"]
    rows, seg_rows = [], []
    for key in self.order:
      gate, dtype, pass_name, B, T = key
      r = self.results[key]
      imp, ref = r.get("impl"), r.get("ref")
      if imp is None or ref is None:
        continue
      flops = B * T * H * common.chunk_flops_per_token_head(
          D, D, C, backward=pass_name == "fwd+bwd")
      gf = flops / imp.seconds / 1e9 if imp.seconds else None
      rows.append([
          gate, dtype, pass_name, str(B), str(T), _ms(imp), _ms(ref),
          _ratio(ref.seconds, imp.seconds),
          f"{B * T / imp.seconds / 1e3:.0f}k" if imp.seconds else "–",
          f"{imp.work_mib:.0f}", f"{imp.io_mib:.0f}", f"{ref.work_mib:.0f}",
          _ratio(ref.work_mib, imp.work_mib),
          "–" if gf is None else f"{gf:.1f}",
          "–" if gf is None else f"{100 * gf / self.peak:.0f}%",
          "ref " + ref.note if ref.note else ""])
      if "seg" in r:
        seg = r["seg"]
        seg_rows.append([gate, dtype, pass_name, str(B), str(T), _ms(imp),
                         _ms(seg), _ratio(seg.seconds, imp.seconds, "{:.2f}"),
                         f"{imp.work_mib:.0f}", f"{seg.work_mib:.0f}"])
    out.append(_table(head, rows))
    out.append("")

    out += self._scaling_table()
    if self.base is not None:
      out.append(self._compare_table())
      out.append("")
    if seg_rows:
      out.append(f"segment_ids: `{impl}` with {self.docs} documents per row "
                 "(random lengths) vs segment_ids=None.\n")
      out.append(_table(["gate", "dtype", "pass", "B", "T", "no segs ms",
                         f"{self.docs} docs ms", "ratio", "work MiB",
                         "work MiB (segs)"], seg_rows))
      out.append("")
    f = common.chunk_flops_per_token_head(D, D, C)
    out.append(
        f"FLOPs: chunked KDA, per token and head, F = 6CK + 4CV + 6KV + "
        f"C^2/3 = {f:.3g} (C={C}, K=V={D}) for the forward and 3F for "
        "forward+backward (checkpoint recomputation not counted); "
        "GFLOP/s = B*T*H*F / time. work MiB = XLA temp buffers "
        "(`compile().memory_analysis().temp_size_in_bytes`); args+out = "
        "argument + output buffers. Programs over "
        f"{self.max_gib:g} GiB are skipped: the reference's backward keeps "
        "a [B,H,K,V] float32 state per token. Total time "
        f"{time.perf_counter() - self.start:.0f} s.")
    if hung:
      out.append(f"\n**HUNG:** {hung} did not finish within {self.hang_s:g} "
                 "s; the table stops there.")
    print("\n".join(out))


  def _compare_table(self):
    """Current tree vs --compare's revision (and both vs the token scan)."""
    base, impl = self.base_name, self.impl
    rows = []
    for key in self.order:
      r = self.results[key]
      for tag, a, b in (("", "impl", "base"), (f"{self.docs} docs", "seg",
                                               "base_seg")):
        if a not in r or b not in r:
          continue
        new, old, ref = r[a], r[b], r.get("ref")
        rows.append([*key[:3], str(key[3]), str(key[4]), tag, _ms(new),
                     _ms(old), _ratio(old.seconds, new.seconds, "{:.2f}x"),
                     _ratio(ref.seconds, new.seconds) if ref else "–",
                     _ratio(ref.seconds, old.seconds) if ref else "–",
                     f"{new.work_mib:.0f}", f"{old.work_mib:.0f}"])
    head = ["gate", "dtype", "pass", "B", "T", "segment_ids", f"{impl} ms",
            f"{base} ms", f"{base}/{impl}", f"ref/{impl}", f"ref/{base}",
            "work MiB", f"{base} work MiB"]
    return (f"`{impl}` of this tree vs `{impl}` of `{base}` (timed "
            "alternately with the token-scan reference, same inputs, each "
            "tree with its own default chunk size unless --chunk_size; ref/x "
            "uses the reference's time without segment_ids).\n\n"
            + _table(head, rows))


def main(argv):
  del argv
  seq_lens = [int(t) for t in _SEQ_LENS.value]
  batches = [int(b) for b in _BATCHES.value]
  if _QUICK.value:
    if not flags.FLAGS["seq_lens"].present:
      seq_lens = [1024, 4096]
    if not flags.FLAGS["batches"].present:
      batches = [1]
  gates = ["safe", "exact"] if _GATE.value == "both" else [_GATE.value]
  dtypes = [jnp.dtype(d) for d in _DTYPES.value]
  base, cleanup = None, lambda: None
  if _COMPARE.value:
    base, cleanup = load_revision(_COMPARE.value)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run `finally`
  try:
    bench = Bench(_IMPL.value, _HEADS.value, _HEAD_DIM.value, _REPEATS.value,
                  _MAX_GIB.value, _DOCS.value, _HANG_S.value, base=base,
                  base_name=_COMPARE.value, cleanup=cleanup)
    for gate in gates:
      for i, dtype in enumerate(dtypes):
        for B in batches:
          for T in seq_lens:
            bench.run(gate, dtype, B, T,
                      with_segments=_DOCS.value > 0 and i == 0)
    bench.render()
  finally:
    cleanup()


if __name__ == "__main__":
  app.run(main)
