"""Tests of kda_lm.metrics: the metrics file survives torn writes."""

import logging

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
