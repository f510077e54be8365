"""Prints the matmul FLOPs of saved HLO text files, in all and within each
named scope (the count: `testbed.hlo_flops.count`).

  python -m experiments.hlo_flops [--scope=NAME ...] FILE...
"""

import gzip
import sys

from testbed import hlo_flops


def main(args):
  """Prints the count of each HLO text file (`.gz` read gzipped), e.g. the
  steps `python -m experiments.fit --hlo_dir=...` saved; each
  `--scope=NAME` adds the count of the matmuls whose JAX name contains
  NAME (`--scope=/moe/`, or MLA's key expansion `--scope=bsc,chx->bshx`)."""
  scopes = [a[len("--scope="):] for a in args if a.startswith("--scope=")]
  paths = [a for a in args if not a.startswith("--scope=")]
  if not paths or any(a.startswith("-") for a in paths):
    raise SystemExit("usage: python -m experiments.hlo_flops "
                     "[--scope=NAME ...] FILE...")
  for path in paths:
    with (gzip.open(path, "rt") if path.endswith(".gz") else
          open(path)) as f:
      text = f.read()
    for scope in [None] + scopes:
      flops = hlo_flops.count(text, scope=scope)
      print(f"{path}{'' if scope is None else ' [' + scope + ']'}: "
            f"{flops.total / 1e12:.3f} TFLOP, of which recompute "
            f"{flops.recompute / 1e12:.3f}")


if __name__ == "__main__":
  main(sys.argv[1:])
