"""Where a compiled program's device time goes, from a profiler trace.

`jax.profiler` writes an XSpace (`*.xplane.pb`): per device, one event per
executed HLO instruction. This module joins those events with the compiled
program's HLO text (each instruction's opcode and its `op_name` metadata,
which carries Haiku's module names) and sums the time per model part, on
the machine that ran it, so that only a small table leaves it.

  rows, _ = profile_summary.profile(compiled, args, steps=3)
  print(profile_summary.table(rows, step_s))
"""

import collections
import glob
import os
import re
import tempfile

import jax
from jax import profiler

# Opcodes whose events span other events (a loop's body, a called
# computation): counting them too would count their children twice.
_CONTAINERS = frozenset({"while", "conditional", "call", "async-start",
                         "async-done", "async-update"})

# The first rule whose pattern occurs in an instruction's op_name names its
# part. Module names come from `kda_lm.layers.block` and `kda_lm.model`.
PARTS = (
    ("KDA mixer", ("/kda/",)),
    ("MLA mixer", ("/mla/",)),
    ("MoE router", ("/moe/router/",)),
    ("MoE routed experts", ("/moe/routed/",)),
    ("MoE shared experts", ("/moe/shared_experts/",)),
    ("MoE, the rest", ("/moe/",)),
    ("dense feed-forward", ("/mlp/",)),
    ("norms", ("_norm/",)),
    ("embedding", ("/embed/",)),
    ("head and loss", ("/lm_head/", "/loss/")),
    ("optimizer", ("/optimizer/",)),
)

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# TPU events are named by the instruction's whole HLO line.
_EVENT = re.compile(r"^%?([\w.\-]+)(?:\s*=|$)")


def hlo_instructions(hlo_text):
  """{instruction name: (opcode, op_name)} of every computation's lines."""
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    op = _OP_NAME.search(line)
    out[m.group(1)] = (m.group(2), op.group(1) if op else "")
  return out


def part_of(op_name):
  """The model part an op_name belongs to; "other" when no rule matches.

  Scopes inside transformations (`jvp(loss)`) count as path components.
  """
  name = "/" + re.sub(r"[()]", "/", op_name.lower()) + "/"
  for part, patterns in PARTS:
    if any(p in name for p in patterns):
      return part
  return "other"


def device_op_ns(xspace_path):
  """{HLO instruction name: summed nanoseconds} over the device events.

  Accelerators report their ops on a "/device:*" plane's "XLA Ops" line;
  XLA:CPU reports them as host events carrying an `hlo_op` stat.
  """
  data = profiler.ProfileData.from_file(xspace_path)
  totals = collections.Counter()
  for plane in data.planes:
    device = plane.name.startswith("/device:")
    for line in plane.lines:
      if device and line.name != "XLA Ops":
        continue
      for ev in line.events:
        name = ev.name if device else dict(ev.stats).get("hlo_op")
        m = _EVENT.match(name or "")
        if m:
          totals[m.group(1)] += ev.duration_ns
  return totals


def summarise(op_ns, instructions, steps, top=25):
  """Rows (part, seconds per step, its `top` ops by time) from
  `device_op_ns`'s totals."""
  parts = collections.defaultdict(collections.Counter)
  for name, ns in op_ns.items():
    opcode, op_name = instructions.get(name, ("", ""))
    if opcode in _CONTAINERS:
      continue
    parts[part_of(op_name)][f"{name} ({opcode}) {op_name[-70:]}"] += ns
  rows = [(part, sum(ops.values()) / steps / 1e9, ops.most_common(top))
          for part, ops in parts.items()]
  return sorted(rows, key=lambda r: -r[1])


def profile(compiled, args, steps=3, rerun=None):
  """Traces `steps` calls; returns `summarise`'s rows and the last args.

  Args:
    compiled: a `jax.stages.Compiled`.
    args: its arguments.
    steps: calls to trace.
    rerun: optional `f(compiled, args) -> args` for each call (a donating
      step returns its next state); by default the same args each time.
  """
  with tempfile.TemporaryDirectory() as tmp:
    profiler.start_trace(tmp)
    for _ in range(steps):
      out = compiled(*args)
      jax.block_until_ready(out)
      if rerun is not None:
        args = rerun(out, args)
    profiler.stop_trace()
    paths = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
    op_ns = device_op_ns(max(paths, key=os.path.getmtime))
  rows = summarise(op_ns, hlo_instructions(compiled.as_text()), steps)
  return rows, args


def table(rows, step_s):
  """A markdown table of `summarise`'s rows against the step time."""
  lines = ["| part (profiled in the step) | ms per step | share | top op |",
           "| --- | --- | --- | --- |"]
  for part, sec, top in rows:
    op = top[0][0] if top else ""
    lines.append(f"| {part} | {1e3 * sec:.1f} | {100 * sec / step_s:.0f}% "
                 f"| `{op}` |")
  total = sum(r[1] for r in rows)
  lines.append(f"| device ops in all | {1e3 * total:.1f} | "
               f"{100 * total / step_s:.0f}% | |")
  return "\n".join(lines)
