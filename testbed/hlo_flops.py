"""Matmul FLOPs of a compiled program, counted from its optimized HLO text
with every loop's body multiplied by its trip count.

XLA's `compiled.cost_analysis()` counts the body of a while loop once, so a
scanned layer group or a loss computed in pieces reports a fraction of its
FLOPs, and the deviceless GPU compile reports none at all. This module reads
`compiled.as_text()` instead and adds up, per device:

- `dot`: 2 x output elements x the product of the contracted dimensions;
- `convolution` (how the TPU compiler writes a matmul): 2 x output
  elements x the kernel elements each output reads;
- the cuBLAS GEMM custom call of the GPU compiler: as a `dot`, with the
  contracting dimensions of its backend config;
- a Pallas TPU kernel (Mosaic custom call) that carries a cost estimate:
  the estimate's `flops` (the KDA kernels carry none and count 0, as in
  XLA's own cost analysis); a megablox grouped matmul whose name scope
  states that its groups cover R of its M rows (`kda_lm.ops.gmm.ROWS_SCOPE`:
  an expert-parallel exchange buffer, sized for the worst case and on
  average M*A rows full) R/M of it, since its grid visits only the tiles
  that hold rows;

recursing into fusions and called computations, a conditional's costliest
branch, and a while loop's body times its trip count: XLA's
`known_trip_count` where the compiler states it (XLA:CPU, XLA:GPU); else
the bound of the name scope a data-dependent loop states (the portable
grouped matmul's, `kda_lm.ops.gmm.MAX_TRIPS_SCOPE`: the worst case, every
expert's rows starting mid-tile); else read from the loop's counter,
`for (i = start; i < N; i += step)` with constant start, N and step (the
TPU compiler states no trip count, and steps by 2 through loops it
unrolled by two). Any other loop raises. Element-wise work (norms,
softmax, activations, the optimizer) is not counted: it is a small share
of a transformer step.

The count also says which FLOPs recompute a forward pass: a matmul, loop
or call JAX names `rematted_computation` (a `jax.checkpoint`'s replay: a
remat policy, the loss's pieces, an MLA query block), and the extra
copies XLA's own rematerialisation made (`.remat<n>` clones beyond one per
original). A custom VJP's forward replayed
inside a checkpoint keeps its forward names (JAX does not rename it) and
counts as work, not recompute, unless it is a loop.

`python -m experiments.hlo_flops [--scope=NAME ...] FILE...` prints the
count of saved HLO text (`python -m experiments.fit --hlo_dir=...`), in
all and within each named scope (the script: experiments/hlo_flops.py).
"""

import json
import math
import re
from typing import NamedTuple, Optional

import numpy as np

from kda_lm.ops import gmm

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"[a-z]\w*\[([\d,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(
    r"\b(?:calls|to_apply|body|true_computation|false_computation)"
    r"=%([\w.\-]+)")
_CALLED_LIST = re.compile(
    r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# The scope may be wrapped by a transformation's name: `jvp(<scope>)/`.
_MAX_TRIPS = re.compile(r"\b" + gmm.MAX_TRIPS_SCOPE.format(r"(\d+)") + r"\b")


def _dims(shape_text):
  """The first array's dimensions in a shape (a tuple's first element)."""
  match = _ARRAY.search(shape_text)
  if not match:
    return ()
  return tuple(int(d) for d in match.group(1).split(",") if d)


def _int_set(text, name):
  match = re.search(name + r"=\{([\d,]*)\}", text)
  return [int(d) for d in match.group(1).split(",") if d] if match else []


def _dot(out, lhs, contracting):
  return 2 * math.prod(out) * math.prod(lhs[d] for d in contracting)


def _window(rest, field, count):
  """A `window={...}` field's per-dimension values (`pad`: lo_hi pairs)."""
  match = re.search(r"window=\{[^}]*\b" + field + r"=([\d_x\-]+)", rest)
  if not match:
    return [(0, 0) if field == "pad" else 1] * count
  values = match.group(1).split("x")
  if field == "pad":
    return [tuple(int(v) for v in pair.split("_")) for pair in values]
  return [int(v) for v in values]


def _taps(in_size, out_size, size, stride, pad, lhs_dilate, rhs_dilate):
  """(output position, window position) pairs of one spatial dimension
  whose input lands on a real element (not padding, not a dilation
  hole), as XLA's own cost analysis counts a convolution."""
  span = (in_size - 1) * lhs_dilate + 1
  taps = 0
  for k in range(size):
    x = np.arange(out_size) * stride + k * rhs_dilate - pad[0]
    taps += int(np.sum((x >= 0) & (x < span) & (x % lhs_dilate == 0)))
  return taps


def _convolution(out, lhs, rhs, rest):
  """2 x the multiply-adds: per output element of the batch and feature
  dimensions, the kernel's input features times the spatial taps that
  land on input. The TPU compiler writes batched matmuls as convolutions
  whose padding or base dilation leaves one tap in a window."""
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
  if not labels or [len(x) for x in labels.groups()] != [
      len(lhs), len(rhs), len(out)]:
    raise ValueError(f"unreadable convolution: {rest[:200]}")
  lhs_labels, kernel, out_labels = labels.groups()
  digits = sorted(c for c in kernel if c.isdigit())
  fields = {f: _window(rest, f, len(digits)) for f in (
      "size", "stride", "pad", "lhs_dilate", "rhs_dilate")}
  macs = math.prod(out[out_labels.index(c)] for c in "bf")
  macs *= rhs[kernel.index("i")]
  for j, d in enumerate(digits):
    macs *= _taps(lhs[lhs_labels.index(d)], out[out_labels.index(d)],
                  *(fields[f][j] for f in fields))
  return 2 * macs


def _custom_call(out, operands, rest, shapes):
  """FLOPs of a cuBLAS GEMM or a costed Pallas kernel; 0 otherwise. A
  grouped matmul whose name scope states the rows its groups cover
  (`gmm.ROWS_SCOPE`) counts its estimate for those rows only."""
  if '"__cublas$gemm"' in rest or '"__cublas$lt$matmul' in rest:
    numbers = re.search(r'"dot_dimension_numbers":(\{[^}]*\})', rest)
    contracting = [int(d) for d in json.loads(numbers.group(1))[
        "lhs_contracting_dimensions"]]
    return _dot(out, shapes[operands[0]], contracting)
  flops = re.search(r'"cost_estimate":\{[^}]*"flops":"?(\d+)', rest)
  if not flops:
    return 0
  op_name = _OP_NAME.search(rest)
  rows = gmm.stated_rows(op_name.group(1)) if op_name else None
  if rows:
    return int(flops.group(1)) * rows[0] // rows[1]
  return int(flops.group(1))


class _Module(NamedTuple):
  computations: dict  # name: [(name, dims, opcode, operands, rest)]
  entry: str
  shapes: dict        # instruction: dimensions (a tuple's first array)
  constants: dict     # instruction: value, for integer scalar constants
  instructions: dict  # instruction: (name, dims, opcode, operands, rest)


def _parse(hlo_text) -> _Module:
  module = _Module({}, None, {}, {}, {})
  current = None
  for line in hlo_text.splitlines():
    head = _COMPUTATION.match(line)
    if head:
      current = module.computations.setdefault(head.group(1), [])
      if line.startswith("ENTRY"):
        module = module._replace(entry=head.group(1))
      continue
    instruction = _INSTRUCTION.match(line)
    if instruction and current is not None:
      name, shape, opcode, rest = instruction.groups()
      args = rest.split(")", 1)[0]
      entry = (name, _dims(shape), opcode, _OPERAND.findall(args), rest)
      current.append(entry)
      module.instructions[name] = entry
      module.shapes[name] = _dims(shape)
      if opcode == "constant" and re.match(r"[su]\d+\[\]", shape):
        module.constants[name] = int(args)
  if module.entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return module


def _source(module, name, hops=8):
  """The instruction `name` copies (through copies and bitcasts)."""
  instruction = module.instructions.get(name)
  for _ in range(hops):
    if not instruction or instruction[2] not in ("copy", "bitcast"):
      break
    instruction = module.instructions.get(instruction[3][0])
  return instruction


def _index(module, name):
  """k for an operand that is `get-tuple-element(...), index=k`."""
  instruction = _source(module, name)
  if not instruction or instruction[2] != "get-tuple-element":
    return None
  return int(re.search(r"\bindex=(\d+)", instruction[4]).group(1))


def _constant(module, name):
  """The integer constant an operand holds, else None."""
  instruction = _source(module, name)
  return module.constants.get(instruction[0]) if instruction else None


def _root(module, computation):
  return module.computations[computation][-1]


def _condition(module, condition):
  """(k, N) for a condition `tuple[k] < N`, N a constant, else None."""
  _, _, opcode, operands, rest = _root(module, condition)
  if opcode != "compare" or "direction=LT" not in rest:
    return None
  k = _index(module, operands[0])
  bound = _constant(module, operands[1])
  return None if k is None or bound is None else (k, bound)


def _step(module, body, k):
  """s for a body whose result k is `tuple[k] + s`, s a constant."""
  _, _, opcode, operands, _ = _root(module, body)
  if opcode != "tuple":
    return None
  counter = _source(module, operands[k])
  if not counter or counter[2] != "add":
    return None
  operands = counter[3]
  steps = [_constant(module, o) for o in operands]
  counters = [_index(module, o) for o in operands]
  if k in counters and any(v is not None for v in steps):
    return next(v for v in steps if v is not None)
  return None


def _counted_trips(module, operands, rest):
  """ceil((N - init) / s) for a loop `for (i = init; i < N; i += s)` with
  constants init, N and s (the TPU compiler unrolls some loops, stepping
  by 2), else None."""
  condition = re.search(r"\bcondition=%([\w.\-]+)", rest).group(1)
  body = re.search(r"\bbody=%([\w.\-]+)", rest).group(1)
  found = _condition(module, condition)
  if found is None:
    return None
  k, bound = found
  step = _step(module, body, k)
  init = module.instructions.get(operands[0])
  if step is None or step <= 0 or not init or init[2] != "tuple":
    return None
  start = _constant(module, init[3][k])
  return None if start is None else max(0, -(-(bound - start) // step))


def _trips(module, operands, rest):
  """A while loop's trip count: XLA's `known_trip_count`, else the bound
  its innermost name scope states, else read from its counter."""
  known = _TRIP_COUNT.search(rest)
  if known:
    return int(known.group(1))
  op_name = _OP_NAME.search(rest)
  bounds = _MAX_TRIPS.findall(op_name.group(1)) if op_name else []
  if bounds:
    return int(bounds[-1])
  trips = _counted_trips(module, operands, rest)
  if trips is None:
    raise ValueError(f"a while loop without a known trip count, a bound "
                     f"in its name scope or a constant counter: "
                     f"{rest[:200]}")
  return trips


def _called(module, opcode, operands, rest):
  """[(computation, multiplier)] an instruction runs; a conditional's
  branches are marked with multiplier None (the costliest counts)."""
  names = _CALLED.findall(rest)
  for group in _CALLED_LIST.findall(rest):
    names += _OPERAND.findall(group)
  if opcode == "while":
    body = re.search(r"\bbody=%([\w.\-]+)", rest).group(1)
    return [(body, _trips(module, operands, rest))]
  if opcode == "conditional":
    return [(n, None) for n in names]
  return [(n, 1) for n in names]


class Flops(NamedTuple):
  """Matmul FLOPs per device: all of them, and the share that recomputes a
  forward pass (rematerialisation)."""
  total: int
  recompute: int


def _is_replay(rest):
  """JAX names the forward a `jax.checkpoint` replays in the backward pass
  `rematted_computation`."""
  op_name = _OP_NAME.search(rest)
  return bool(op_name and "rematted_computation" in op_name.group(1))


def _extra_copies(instructions):
  """The names of a computation's instructions that XLA's own
  rematerialisation added: it suffixes a clone `.remat<n>` and deletes the
  original once no use is left, so of a family (one base name) all but
  one instance are extra work."""
  names = [i[0] for i in instructions]
  present, extra = set(names), set()
  for name in names:
    if ".remat" in name:
      base = name.split(".remat")[0]
      if base in present:
        extra.add(name)
      else:
        present.add(base)  # This clone stands for the deleted original.
  return extra


def _own(out, opcode, operands, rest, shapes):
  """The FLOPs of one instruction itself (not of what it calls)."""
  if opcode == "dot":
    return _dot(out, shapes[operands[0]],
                _int_set(rest, "lhs_contracting_dims"))
  if opcode == "convolution":
    return _convolution(out, shapes[operands[0]], shapes[operands[1]], rest)
  if opcode == "custom-call":
    return _custom_call(out, operands, rest, shapes)
  return 0


def _in_scope(rest, scope):
  op_name = _OP_NAME.search(rest)
  return scope is None or bool(op_name and scope in op_name.group(1))


def count(hlo_text: str, scope: Optional[str] = None) -> Flops:
  """Matmul FLOPs per device of one run of the module's entry: of every
  matmul, or of those whose JAX name (`op_name`) contains `scope`."""
  module = _parse(hlo_text)
  memo = {}

  def flops(computation):
    if computation not in memo:
      memo[computation] = Flops(0, 0)  # A cycle: a malformed module.
      total = recompute = 0
      extra = _extra_copies(module.computations[computation])
      for name, out, opcode, operands, rest in module.computations[
          computation]:
        own = _own(out, opcode, operands, rest, module.shapes) if (
            _in_scope(rest, scope)) else 0
        called = _called(module, opcode, operands, rest)
        branches = [flops(n) for n, k in called if k is None]
        inner = max(branches, default=Flops(0, 0))
        for n, k in called:
          if k is not None:
            sub = flops(n)
            inner = Flops(inner.total + k * sub.total,
                          inner.recompute + k * sub.recompute)
        total += own + inner.total
        # A matmul by its own name. A loop or call by its own name too: a
        # replayed loop may run the very body computation of the forward
        # one, whose ops carry the forward's names. A fusion by its ops
        # (its metadata names one of them), unless it is an extra copy.
        replay = _is_replay(rest)
        whole = name in extra or (
            replay and opcode in ("while", "call", "conditional"))
        recompute += own if (replay or name in extra) else 0
        recompute += inner.total if whole else inner.recompute
      memo[computation] = Flops(total, recompute)
    return memo[computation]

  return flops(module.entry)

