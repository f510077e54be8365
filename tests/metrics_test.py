"""Tests of kda_lm.metrics: the metrics file survives torn writes; the
window of steps behind each logged row."""

import logging

import numpy as np
import pytest

from kda_lm import metrics


def test_torn_last_line_is_dropped_on_resume(tmp_path, caplog):
  writer = metrics.MetricsWriter(str(tmp_path))
  for step in (10, 20, 30):
    writer.write(step, {"loss": 1.0 / step})
  with open(writer.path, "a") as f:
    f.write('{"step": 40, "loss": 0.0')   # a kill during the write
  with caplog.at_level(logging.WARNING):
    assert [r["step"] for r in metrics.read_metrics(str(tmp_path))] == [
        10, 20, 30]
  assert "metrics.jsonl" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    writer.truncate_after(20)
  assert "torn" in caplog.text and writer.path in caplog.text
  writer.write(30, {"loss": 0.5})
  rows = metrics.read_metrics(writer.path)
  assert [(r["step"], r["loss"]) for r in rows] == [
      (10, 0.1), (20, 0.05), (30, 0.5)]


class FakeClock:
  """Stands in for the `time` module inside kda_lm.metrics."""

  def __init__(self):
    self.now = 1000.0

  def time(self):
    return self.now


def step_metrics(step):
  return {"loss": np.float32(10.0 * step), "accuracy": np.float32(step / 10),
          "lr": np.float32(step * 1e-3)}


def test_window_averages_its_steps_and_leaves_out_compile_and_pauses(
    monkeypatch):
  clock = FakeClock()
  monkeypatch.setattr(metrics, "time", clock)
  window = metrics.Window(tokens_per_step=100)
  window.add(1, step_metrics(1))
  clock.now += 50.0                 # The first step compiles.
  assert window.time_first_step() == 50.0
  for step in (2, 3):
    window.add(step, step_metrics(step))
    clock.now += 2.0
  with window.paused():             # An eval or a checkpoint.
    clock.now += 30.0
  assert [s for s, _ in window.fetch()] == [2, 3]
  row = window.row()
  # The row holds steps 1-3; tokens/s only steps 2 and 3 (4 s).
  assert row["loss"] == pytest.approx(20.0)
  assert row["accuracy"] == pytest.approx(0.2)
  assert row["lr"] == pytest.approx(3e-3)      # The last step's.
  assert row["tokens_per_s"] == pytest.approx(200 / 4.0)
  window.reset()
  for step in (4, 5, 6):
    window.add(step, step_metrics(step))
    clock.now += 1.0
  window.fetch()
  row = window.row()
  assert row["loss"] == pytest.approx(50.0)
  assert row["tokens_per_s"] == pytest.approx(300 / 3.0)


def test_window_of_the_first_step_alone(monkeypatch):
  """log_every = 1: the first row has only the compile step, whose tokens/s
  (compilation included) is all there is."""
  clock = FakeClock()
  monkeypatch.setattr(metrics, "time", clock)
  window = metrics.Window(tokens_per_step=100)
  window.add(1, step_metrics(1))
  clock.now += 20.0
  window.time_first_step()
  window.fetch()
  row = window.row()
  assert row["loss"] == pytest.approx(10.0)
  assert row["tokens_per_s"] == pytest.approx(100 / 20.0)
