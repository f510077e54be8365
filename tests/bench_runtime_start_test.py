"""Tests of experiments/bench_runtime_start.py on the CPU: a measurement in
a fresh process, with the buffer's variable set or cleared, and its row."""

from experiments import bench_runtime_start as bench
from kda_lm.parallel import distributed


def test_a_measurement_moves_both_sizes_and_makes_a_row(monkeypatch):
  # The parent's own setting must not leak into the default's process.
  monkeypatch.setenv(distributed.PREMAPPED_SIZE_ENV, "1")
  row = bench.measure(0, big_mib=32)
  assert row["platform"] == "cpu" and row["devices_s"] >= 0
  assert row["buffer_env"] is None
  assert [row[k][2] for k in ("small", "big")] == [16 << 20, 32 << 20]
  assert bench.measure(64, big_mib=16)["buffer_env"] == str(64 << 20)
  text = bench.fmt(64, row)
  assert text.startswith("| 64 MiB | cpu | ") and text.count("GB/s") == 2
  assert bench.fmt(0, row).startswith("| default | cpu | ")
