"""Narrows a cosmic-ray session to the mutants inside some functions.

Usage:
  python experiments/mutation/only_functions.py SESSION.sqlite MODULE.py \
      func1 [func2 ...]

Run it after `cosmic-ray init` and before `cosmic-ray exec`: it deletes
from the session database every work item whose mutation starts outside
the named functions of MODULE.py (their lines from `ast`, decorators
included) or lies in another module. A name is a function's or a method's
(`save`), or qualified by its class (`CheckpointManager.save`), or a
class's (`Options`: the whole class, its decorators and fields included);
a name matching several definitions keeps them all. Nested functions are
inside their parent. Prints the counts kept and removed per function.
"""

import ast
import os
import sqlite3
import sys


def function_ranges(source: str, names: list[str]) -> dict[str, list[tuple[
    int, int]]]:
  """name -> [(first line, last line)] of the definitions (functions,
  methods, classes) it names."""
  ranges = {name: [] for name in names}

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        first = min([child.lineno] +
                    [d.lineno for d in child.decorator_list])
        for name in (child.name, prefix + child.name):
          if name in ranges and (first, child.end_lineno) not in ranges[name]:
            ranges[name].append((first, child.end_lineno))
        visit(child, prefix + child.name + ".")
      elif isinstance(child, ast.ClassDef):
        first = min([child.lineno] +
                    [d.lineno for d in child.decorator_list])
        for name in (child.name, prefix + child.name):
          if name in ranges and (first, child.end_lineno) not in ranges[name]:
            ranges[name].append((first, child.end_lineno))
        visit(child, prefix + child.name + ".")
      else:
        visit(child, prefix)

  visit(ast.parse(source), "")
  return ranges


def main(argv: list[str]) -> int:
  if len(argv) < 4:
    print(__doc__, file=sys.stderr)
    return 2
  session, module, names = argv[1], argv[2], argv[3:]
  with open(module, encoding="utf-8") as f:
    ranges = function_ranges(f.read(), names)
  missing = [name for name, found in ranges.items() if not found]
  if missing:
    print(f"No function named {', '.join(missing)} in {module}.",
          file=sys.stderr)
    return 1
  spans = [span for found in ranges.values() for span in found]
  db = sqlite3.connect(session)
  with db:
    rows = db.execute(
        "SELECT job_id, module_path, start_pos_row FROM mutation_specs"
    ).fetchall()
    norm = os.path.abspath(module)
    drop, kept = [], {name: 0 for name in names}
    for job_id, module_path, row in rows:
      inside = [name for name, found in ranges.items()
                if any(first <= row <= last for first, last in found)]
      same = norm.endswith(os.sep + os.path.normpath(module_path))
      if same and any(first <= row <= last for first, last in spans):
        for name in inside:
          kept[name] += 1
      else:
        drop.append((job_id,))
    for table in ("work_results", "mutation_specs", "work_items"):
      db.executemany(f"DELETE FROM {table} WHERE job_id = ?", drop)
  db.close()
  for name, count in kept.items():
    print(f"{name}: {count} mutants")
  print(f"kept {len(rows) - len(drop)} of {len(rows)}, removed {len(drop)}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
