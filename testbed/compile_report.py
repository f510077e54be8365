"""What XLA and ptxas report about compiled GPU kernels, and the limits the
compile check (experiments/compile_check.py) enforces; the bytes of the
collectives in a compiled step's HLO text (experiments/compile_mesh.py).
Pure text parsing (`kda_lm.ops.gmm` gives only its name-scope format):
tested in tests/compile_report_test.py."""

import re

from kda_lm.ops import gmm


def parse_ptxas(log):
  """{entry function: (registers, spill stores, spill loads)} from ptxas -v."""
  out = {}
  current = None
  for line in log.splitlines():
    m = re.search(r"Compiling entry function '([^']+)'", line)
    if m:
      current = m.group(1)
      out[current] = [0, 0, 0]
      continue
    if current is None:
      continue
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m:
      out[current][1:] = [int(m.group(1)), int(m.group(2))]
    m = re.search(r"Used (\d+) registers", line)
    if m:
      out[current][0] = int(m.group(1))
  return {k: tuple(v) for k, v in out.items()}


def parse_thunks(text):
  """[(kernel, grid, threads, shared bytes)] from XLA's thunk sequence."""
  out = []
  for m in re.finditer(r"(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: "
                       r"\[(\d+), \d+, \d+\]\s+shared_memory: (\d+) bytes",
                       text):
    out.append((m.group(1), (int(m.group(2)), int(m.group(3)),
                             int(m.group(4))), int(m.group(5)),
                int(m.group(6))))
  return out


def gpu_problems(shared, shared_limit, spills, max_spill):
  """What a compiled GPU kernel exceeds (empty: nothing)."""
  problems = []
  if shared > shared_limit:
    problems.append(f"shared memory {shared} > {shared_limit}")
  if max(spills) > max_spill:
    problems.append(f"spills {spills[0]}/{spills[1]} B > {max_spill}")
  return problems


# ---------------------------------------------------------------------------
# Collectives in compiled HLO text (`compiled.as_text()`).

COLLECTIVES = ("all-gather", "all-to-all", "ragged-all-to-all", "all-reduce",
               "reduce-scatter", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2,
               "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
               "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(
    r"=\s*(\([^=]*?\)|\S+)\s+(" + "|".join(
        re.escape(c) for c in sorted(COLLECTIVES, key=len, reverse=True))
    + r")(-done)?\(")


def _arrays(shape_text):
  """[(dtype, dims)] of an HLO result shape (an array or a tuple)."""
  return [(dt, tuple(int(d) for d in dims.split(",") if d))
          for dt, dims in _ARRAY.findall(shape_text) if dt in DTYPE_BYTES]


def collective_ops(hlo_text):
  """Every collective of a compiled module: [(kind, dtype, dims, bytes)].

  One entry per array a collective returns (a combined all-gather returns
  a tuple), its bytes those of the result on one device (an all-gather's
  gathered array, an all-to-all's received buffer, a reduce-scatter's
  piece). Asynchronous pairs count once, at their `-done` (whose result
  is the output); a `-start` is skipped. A collective inside a loop body
  counts once, not once per iteration. A ragged all-to-all moves only the
  rows it is told to: one whose name scope states that R of its result's
  M rows arrive (`kda_lm.ops.gmm.ROWS_SCOPE`, the expert exchange's mean
  fill) counts R/M of its result.
  """
  out = []
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.search(line)
    if not m:
      continue
    for dt, dims in _arrays(m.group(1)):
      size = DTYPE_BYTES[dt]
      for d in dims:
        size *= d
      if m.group(2) == "ragged-all-to-all":
        size = size * _arriving_rows(line, dims) // dims[0]
      out.append((m.group(2), dt, dims, size))
  return out


def _arriving_rows(line, dims):
  """The rows of a ragged all-to-all's result that arrive: R where its
  name scope states R of dims[0], else all of them."""
  op_name = _OP_NAME.search(line)
  rows = gmm.stated_rows(op_name.group(1)) if op_name else None
  return rows[0] if rows and rows[1] == dims[0] else dims[0]


def collective_bytes(hlo_text, select=None):
  """{kind: bytes per device} summed over `collective_ops` (those for
  which `select(kind, dtype, dims)` is true, when given)."""
  out = {}
  for kind, dt, dims, size in collective_ops(hlo_text):
    if select is None or select(kind, dt, dims):
      out[kind] = out.get(kind, 0) + size
  return out
