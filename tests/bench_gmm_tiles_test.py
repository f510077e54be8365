"""Tests of experiments/bench_gmm_tiles.py: its command runs on the CPU
(the megablox kernels in interpret mode) and prints a row per candidate."""

import subprocess
import sys

import process_support


def test_prints_ragged_dot_and_each_tiling_for_both_spreads():
  result = subprocess.run(
      [sys.executable, "-m", "experiments.bench_gmm_tiles", "--experts=4",
       "--shape=256,128,128", "--tiles=128x128x128,64x128x128",
       "--repeats=1"],
      cwd=process_support.REPO, env=process_support.subprocess_env(),
      capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [line.split(" | ")[:2] for line in result.stdout.splitlines()
          if line.startswith("| ") and "---" not in line][1:]
  assert rows == [[f"| {name}", spread] for spread in ("even", "skewed")
                  for name in ("ragged_dot", "megablox (128, 128, 128)",
                               "megablox (64, 128, 128)")], result.stdout
