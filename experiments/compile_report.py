"""What XLA and ptxas report about compiled GPU kernels, and the limits the
compile check (experiments/compile_check.py) enforces. Pure text parsing,
no JAX: tested in tests/compile_report_test.py."""

import re


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
