"""Tests of kda_lm.train.metrics: the metrics file survives torn writes; the
window of steps behind each logged row."""

# pylint: disable=protected-access

import io
import logging
import os
import sys
import types

import numpy as np
import pytest

from kda_lm import logs
from kda_lm.train import metrics


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
  """Stands in for the `time` module inside kda_lm.train.metrics. It starts at
  1 s, below every interval it is advanced by, so an interval computed as
  anything but `now - start` comes out wrong."""

  def __init__(self):
    self.now = 1.0

  def time(self):
    return self.now


def step_metrics(step):
  # Keys sorting before and after "lr", which alone is not averaged.
  return {"loss": np.float32(10.0 * step), "accuracy": np.float32(step / 10),
          "lr": np.float32(step * 1e-3), "mtp_loss": np.float32(step)}


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
  assert row["mtp_loss"] == pytest.approx(2.0)
  assert row["lr"] == pytest.approx(3e-3)      # The last step's.
  assert row["tokens_per_s"] == pytest.approx(200 / 4.0)
  assert row["steps_averaged"] == 3
  window.reset()
  for step in (4, 5, 6):
    window.add(step, step_metrics(step))
    clock.now += 1.5
  window.fetch()
  row = window.row()
  assert row["loss"] == pytest.approx(50.0)
  assert row["tokens_per_s"] == pytest.approx(300 / 4.5)


def test_window_of_the_first_step_alone(monkeypatch):
  """log_every = 1: the first row has only the compile step, whose tokens/s
  (compilation included) is all there is."""
  clock = FakeClock()
  monkeypatch.setattr(metrics, "time", clock)
  window = metrics.Window(tokens_per_step=100)
  window.add(1, step_metrics(1))
  clock.now += 40.0
  window.time_first_step()
  window.fetch()
  row = window.row()
  assert row["loss"] == pytest.approx(10.0)
  assert row["tokens_per_s"] == pytest.approx(100 / 40.0)


# The log filter: libraries' INFO lines and TFDS warnings are dropped.


def _record(level, path):
  return logging.LogRecord("absl", level, path, 1, "message", None, None)


@pytest.mark.parametrize("lib", ["orbax", "tensorflow", "tensorflow_datasets",
                                 "jax"])
def test_library_info_lines_are_dropped(lib):
  keep = logs._LibraryInfoFilter().filter
  path = f"/venv/site-packages/{lib}/module.py"
  assert not keep(_record(logging.INFO, path))
  assert not keep(_record(logging.DEBUG, path))
  assert keep(_record(logging.ERROR, path))
  assert keep(_record(logging.CRITICAL, path))
  # Warnings stay, except TFDS's; so does a custom level between the two.
  want_warnings = lib != "tensorflow_datasets"
  assert keep(_record(logging.WARNING, path)) == want_warnings
  assert keep(_record(logging.WARNING + 5, path)) == want_warnings


def test_orbax_thread_tracebacks_go_to_the_debug_log():
  """A failed background save: Orbax's thread logs an ERROR with its
  traceback; shown only at debug verbosity (as DEBUG), never dropped for
  other libraries or without a traceback."""
  keep = logs._LibraryInfoFilter().filter
  try:
    raise OSError(28, "No space left on device")
  except OSError:
    exc_info = sys.exc_info()

  def traced(path, level=logging.ERROR):
    return logging.LogRecord("absl", level, path, 1, "save failed", None,
                             exc_info)

  orbax = "/venv/site-packages/orbax/checkpoint/future.py"
  logger = metrics.logging.get_absl_logger()
  level = logger.level
  try:
    logger.setLevel(logging.INFO)
    assert not keep(traced(orbax))
    assert not keep(traced(orbax, logging.CRITICAL))
    assert keep(_record(logging.ERROR, orbax))          # No traceback.
    assert keep(traced("/work/kda_lm/train/loop.py"))
    assert keep(traced("/venv/site-packages/jax/api.py"))
    logger.setLevel(logging.DEBUG)
    record = traced(orbax)
    assert keep(record) and record.levelname == "DEBUG"
    assert record.levelno == logging.DEBUG and record.exc_info
  finally:
    logger.setLevel(level)


def test_own_code_logs_at_every_level():
  keep = logs._LibraryInfoFilter().filter
  for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
    assert keep(_record(level, "/work/kda_lm/train_loop.py"))


def test_quiet_library_logs_adds_its_filter_once():
  logger = metrics.logging.get_absl_logger()
  before = list(logger.filters)
  try:
    logs.quiet_library_logs()
    logs.quiet_library_logs()
    added = [f for f in logger.filters if f not in before]
    owned = [f for f in logger.filters
             if isinstance(f, logs._LibraryInfoFilter)]
    assert len(owned) == 1
    assert added == owned or not added   # Already there before: none added.
    assert not logger.filter(_record(logging.INFO, "/x/jax/y.py"))
    assert logger.filter(_record(logging.INFO, "/x/kda_lm/y.py"))
  finally:
    for f in list(logger.filters):
      if f not in before:
        logger.removeFilter(f)


# The metrics file.


def test_rows_are_written_as_exact_json_lines(tmp_path):
  workdir = tmp_path / "a" / "b"              # Created by the writer.
  old_umask = os.umask(0o022)
  try:
    writer = metrics.MetricsWriter(str(workdir))
    writer.write(np.int64(3), {"loss": np.float32(0.5), "n": np.int32(7),
                               "bad": float("nan"), "up": float("inf"),
                               "down": -np.inf, "note": "x"})
    writer.write(4, {"loss": 0.25})
  finally:
    os.umask(old_umask)
  assert writer.path == str(workdir / "metrics.jsonl")
  with open(writer.path) as f:
    assert f.read() == (
        '{"step": 3, "loss": 0.5, "n": 7, "bad": "nan", "up": "inf", '
        '"down": "-inf", "note": "x"}\n{"step": 4, "loss": 0.25}\n')
  assert os.stat(writer.path).st_mode & 0o777 == 0o644
  assert sorted(os.listdir(workdir)) == ["metrics.jsonl"]  # No TensorBoard.
  writer.flush()                     # Without TensorBoard: nothing to do.
  writer.close()
  writer.close()


def test_clean_values():
  clean = metrics._clean
  assert clean(np.float32(0.5)) == 0.5
  assert type(clean(np.float32(0.5))) is float
  assert type(clean(np.int32(3))) is int
  assert clean(2) == 2 and clean(1.5) == 1.5 and clean("text") == "text"
  assert clean(None) is None
  assert clean(float("nan")) == "nan" and clean(np.float64(-np.inf)) == "-inf"


def test_disabled_writer_does_nothing(tmp_path):
  workdir = tmp_path / "run"
  writer = metrics.MetricsWriter(str(workdir), tensorboard=True,
                                 enabled=False)
  writer.write(1, {"loss": 1.0})
  writer.truncate_after(0)
  writer.flush()
  writer.close()
  assert not workdir.exists()
  assert writer.path == str(workdir / "metrics.jsonl")
  # The options are keyword-only: a bare True is refused, not read as one.
  with pytest.raises(TypeError):
    metrics.MetricsWriter(  # pylint: disable=too-many-function-args
        str(workdir), True)
  assert metrics.MetricsWriter(workdir=str(workdir), enabled=False).path == (
      writer.path)


class FakeSummaryWriter:
  """Records the calls a `tensorboardX.SummaryWriter` gets."""

  def __init__(self, logdir):
    self.logdir = logdir
    self.calls = []

  def add_scalar(self, *args):
    self.calls.append(("add_scalar",) + args)

  def flush(self):
    self.calls.append(("flush",))

  def close(self):
    self.calls.append(("close",))


def test_tensorboard_gets_every_numeric_scalar(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorboardX",
                      types.SimpleNamespace(SummaryWriter=FakeSummaryWriter))
  writer = metrics.MetricsWriter(str(tmp_path), tensorboard=True)
  tb = writer._tb
  assert tb.logdir == os.path.join(str(tmp_path), "tensorboard")
  writer.write(np.int64(5), {"loss": np.float32(1.5), "tokens": 7,
                             "bad": float("nan"), "note": "x"})
  writer.flush()
  writer.close()
  writer.close()
  writer.flush()
  assert tb.calls == [("add_scalar", "loss", 1.5, 5),
                      ("add_scalar", "tokens", 7, 5), ("flush",), ("close",)]
  assert type(tb.calls[0][3]) is int
  assert metrics.read_metrics(str(tmp_path)) == [
      {"step": 5, "loss": 1.5, "tokens": 7, "bad": "nan", "note": "x"}]


def test_tensorboard_writes_event_files(tmp_path):
  writer = metrics.MetricsWriter(str(tmp_path), tensorboard=True)
  writer.write(1, {"loss": 1.0})
  writer.close()
  assert os.listdir(tmp_path / "tensorboard")


def _write_lines(path, text):
  with open(path, "w") as f:
    f.write(text)


def test_read_metrics_skips_blank_and_unreadable_lines(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  _write_lines(path, '{"step": 1}\n\n  \n[1, 2]\n7\nnot json\n{"step": 2}\n'
               '{"step": 3}')          # The last line lacks its newline.
  with caplog.at_level(logging.WARNING):
    assert metrics.read_metrics(str(path)) == [{"step": 1}, {"step": 2}]
    assert metrics.read_metrics(str(tmp_path)) == [{"step": 1}, {"step": 2}]
  assert caplog.messages == [
      f"Skipping 4 torn or unreadable line(s) of {path}."] * 2


def test_read_metrics_of_a_clean_or_missing_file(tmp_path, caplog):
  with caplog.at_level(logging.DEBUG):
    assert metrics.read_metrics(str(tmp_path)) == []
    assert metrics.read_metrics(str(tmp_path / "none.jsonl")) == []
    _write_lines(tmp_path / "metrics.jsonl", '{"step": 1}\n{"step": 2}\n')
    assert metrics.read_metrics(str(tmp_path)) == [{"step": 1}, {"step": 2}]
  assert not caplog.messages


def test_truncate_after_keeps_the_resumed_step(tmp_path, caplog):
  writer = metrics.MetricsWriter(str(tmp_path))
  writer.write(0, {"loss": 3.0})
  for step in (10, 20, 30, 40):
    writer.write(step, {"loss": 1.0})
  with open(writer.path, "a") as f:
    f.write('{"note": "no step"}\n')     # Counts as step 0: kept.
  with caplog.at_level(logging.INFO):
    writer.truncate_after(20)
  assert [r.get("step") for r in metrics.read_metrics(writer.path)] == [
      0, 10, 20, None]
  assert caplog.messages == [
      f"Dropping 2 rows after step 20 from {writer.path}."]
  assert not os.path.exists(writer.path + ".tmp")
  caplog.clear()
  with caplog.at_level(logging.INFO):
    writer.truncate_after(0)
  assert [r.get("step") for r in metrics.read_metrics(writer.path)] == [
      0, None]
  assert caplog.messages == [
      f"Dropping 2 rows after step 0 from {writer.path}."]


def test_truncate_after_leaves_a_clean_file_alone(tmp_path, caplog):
  writer = metrics.MetricsWriter(str(tmp_path))
  writer.truncate_after(5)                   # No file yet.
  assert not os.path.exists(writer.path)
  for step in range(300):                    # More rows than small ints.
    writer.write(step // 150 + 1, {"loss": 1.0})
  with open(writer.path, "a") as f:
    f.write('{"step":  2}\n')                 # Not json.dumps's spacing.
  with open(writer.path) as f:
    text = f.read()
  with caplog.at_level(logging.DEBUG):
    writer.truncate_after(2)
  assert not caplog.messages
  with open(writer.path) as f:
    assert f.read() == text                   # Not rewritten.


def test_truncate_after_drops_a_torn_line_alone(tmp_path, caplog):
  writer = metrics.MetricsWriter(str(tmp_path))
  writer.write(1, {"loss": 1.0})
  with open(writer.path, "a") as f:
    f.write('{"step": 2, "lo')
  with caplog.at_level(logging.INFO):
    writer.truncate_after(5)
  with open(writer.path) as f:
    assert f.read() == '{"step": 1, "loss": 1.0}\n'
  assert caplog.messages == [
      f"Dropping 1 torn or unreadable line(s) from {writer.path}.",
      f"Dropping 0 rows after step 5 from {writer.path}."]


def test_first_reaching():
  rows = [{"step": 1, "eval_accuracy": "nan"}, {"step": 2},
          {"step": 3, "eval_accuracy": 0.5, "acc": 2},
          {"step": 4, "eval_accuracy": None, "acc": 1},
          {"step": 5, "eval_accuracy": 0.9}, {"step": 6, "eval_accuracy": 1}]
  assert metrics.first_reaching(rows, 0.5)["step"] == 3     # >=, not >.
  assert metrics.first_reaching(rows, 0.6)["step"] == 5
  assert metrics.first_reaching(rows, 0.95)["step"] == 6     # An int.
  assert metrics.first_reaching(rows, 1.5) is None
  assert metrics.first_reaching(rows, 1, key="acc")["step"] == 3
  assert metrics.first_reaching([], 0.0) is None


# The console display.


def test_format_of_each_kind_of_value():
  format_ = metrics._format
  scalars = {"tokens_per_s": 1234567.6, "lr": 3e-4, "loss": 1.23456,
             "accuracy": 0.5, "other": 9.0}
  assert format_(scalars, metrics._TRAIN_KEYS) == (
      "loss=1.2346 accuracy=0.5000 lr=3.00e-04 tokens_per_s=1,234,568")
  assert format_({"eval_accuracy": 0.25}, metrics._EVAL_KEYS) == (
      "eval_accuracy=0.2500")
  assert format_({}, metrics._EVAL_KEYS) == ""


class FakeBar:
  """Records what a `tqdm.tqdm` bar is given."""

  def __init__(self, **kwargs):
    self.kwargs = kwargs
    self.n = kwargs["initial"]
    self.calls = []

  def update(self, n):
    self.calls.append(("update", n))
    self.n += n

  def set_postfix(self, postfix, refresh):
    self.calls.append(("postfix", dict(postfix), refresh))

  def write(self, text):
    self.calls.append(("write", text))

  def close(self):
    self.calls.append(("close",))


@pytest.fixture(name="fake_tqdm")
def fixture_fake_tqdm(monkeypatch):
  monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=FakeBar))


class FakeStderr:

  def __init__(self, tty):
    self.tty = tty

  def isatty(self):
    return self.tty

  def write(self, text):
    del text


@pytest.mark.usefixtures("fake_tqdm")
def test_progress_bar_on_a_terminal(monkeypatch, caplog):
  monkeypatch.setattr(sys, "stderr", FakeStderr(True))
  progress = metrics.Progress(100, 4)
  bar = progress._bar
  assert bar.kwargs == dict(total=100, initial=4, unit="step",
                            dynamic_ncols=True, smoothing=0.1)
  with caplog.at_level(logging.INFO):
    progress.train(15, {"loss": 2.0, "accuracy": 0.5, "lr": 1e-3,
                        "tokens_per_s": 12345.6})
    progress.eval(15, {"eval_loss": 1.5, "eval_accuracy": 0.75})
    progress.train(20, {"loss": 1.0})
    progress.eval(20, {"eval_loss": 1.25})
    progress.train(22, {"tokens_per_s": 10.0})
    progress.message("saved")
  assert caplog.messages == ["saved"]
  progress.close()
  progress.close()
  assert bar.calls == [
      ("update", 11),
      ("postfix", {"loss": 2.0, "accuracy": 0.5, "tok/s": "12,346"}, True),
      ("write", "step 15: eval_loss=1.5000 eval_accuracy=0.7500"),
      ("update", 5),
      ("postfix", {"loss": 1.0, "eval_acc": "0.7500"}, True),
      ("write", "step 20: eval_loss=1.2500"),
      ("update", 2),
      ("postfix", {"tok/s": "10", "eval_acc": "0.0000"}, True),
      ("close",)]


@pytest.mark.usefixtures("fake_tqdm")
def test_progress_logs_lines_off_a_terminal(monkeypatch, caplog):
  monkeypatch.setattr(sys, "stderr", FakeStderr(False))
  progress = metrics.Progress(100)
  assert progress._bar is None
  with caplog.at_level(logging.INFO):
    progress.train(5, {"loss": 2.0, "lr": 1e-3})
    progress.eval(5, {"eval_accuracy": 0.5})
    progress.message("note")
  progress.close()
  assert caplog.messages == ["step 5/100: loss=2.0000 lr=1.00e-03",
                             "step 5/100 eval: eval_accuracy=0.5000", "note"]


@pytest.mark.usefixtures("fake_tqdm")
@pytest.mark.parametrize("use_bar", [True, False, None])
def test_disabled_progress_shows_nothing(monkeypatch, caplog, use_bar):
  monkeypatch.setattr(sys, "stderr", FakeStderr(True))
  progress = metrics.Progress(100, enabled=False, use_bar=use_bar)
  assert progress._bar is None
  with caplog.at_level(logging.DEBUG):
    progress.train(5, {"loss": 2.0})
    progress.eval(5, {"eval_accuracy": 0.5})
    progress.message("note")
  progress.close()
  assert not caplog.messages


@pytest.mark.usefixtures("fake_tqdm")
def test_use_bar_overrides_the_terminal(monkeypatch):
  """Also: `enabled` and `use_bar` are keyword-only, the rest is not."""
  monkeypatch.setattr(sys, "stderr", FakeStderr(True))
  assert metrics.Progress(10, use_bar=False)._bar is None
  monkeypatch.setattr(sys, "stderr", FakeStderr(False))
  bar = metrics.Progress(10, use_bar=True)._bar
  assert bar.kwargs["initial"] == 0
  bar = metrics.Progress(total=10, initial=3, use_bar=True)._bar
  assert bar.kwargs["total"] == 10 and bar.kwargs["initial"] == 3
  with pytest.raises(TypeError):
    metrics.Progress(10, 0, True)    # pylint: disable=too-many-function-args


# The window's row arithmetic at its edges.


def test_window_fetch_and_has_rows(monkeypatch):
  monkeypatch.setattr(metrics, "time", FakeClock())
  window = metrics.Window(tokens_per_step=10)
  assert window.fetch() == [] and not window.has_rows()
  window.add(1, {"loss": np.float32(1.5), "lr": np.float32(0.5)})
  assert not window.has_rows()
  fetched = window.fetch()
  assert fetched == [(1, {"loss": 1.5, "lr": 0.5})]
  assert type(fetched[0][1]["loss"]) is float
  assert window.has_rows() and window.fetch() == []
  window.reset()
  assert not window.has_rows()


def test_window_two_pauses_and_no_elapsed_time(monkeypatch):
  clock = FakeClock()
  monkeypatch.setattr(metrics, "time", clock)
  window = metrics.Window(tokens_per_step=10)
  window.add(1, step_metrics(1))
  assert window.time_first_step() == 0.0     # No time passed at all.
  window.fetch()
  assert window.row()["tokens_per_s"] == pytest.approx(10 / 1e-9)
  window.add(2, step_metrics(2))
  clock.now += 5.0
  for _ in range(2):
    with window.paused():           # Longer than the clock's reading.
      clock.now += 20.0
  window.fetch()
  # 45 s, of which 40 s paused.
  assert window.row()["tokens_per_s"] == pytest.approx(10 / 5.0)
  window.reset()
  window.add(3, step_metrics(3))
  window.fetch()
  assert window.row()["tokens_per_s"] == pytest.approx(10 / 1e-9)


def test_window_of_steps_without_tokens(monkeypatch):
  clock = FakeClock()
  monkeypatch.setattr(metrics, "time", clock)
  window = metrics.Window(tokens_per_step=0)
  window.add(1, step_metrics(1))
  clock.now += 3.0
  window.fetch()
  assert window.row()["tokens_per_s"] == 0.0


def test_noise_filter_drops_only_the_abandoned_writes_tracebacks():
  """The two forms an abandoned Orbax save prints are dropped and counted;
  other lines and tracebacks pass through whole, even when written in
  pieces."""
  out = io.StringIO()
  noise = metrics.NoiseFilter(out)
  closed = ("Traceback (most recent call last):\n"
            '  File "base_events.py", line 806, in call_soon_threadsafe\n'
            "    self._check_closed()\n"
            "RuntimeError: Event loop is closed\n")
  ignored = ("Exception ignored in: <coroutine object async_serialize_from_"
             "host.<locals>.write_fragment at 0x7f>\n"
             "Traceback (most recent call last):\n"
             '  File "limits.py", line 72, in release_bytes\n'
             "ImportError: sys.meta_path is None, Python is likely shutting "
             "down\n")
  real = ("Traceback (most recent call last):\n"
          '  File "train.py", line 62, in <module>\n'
          "ValueError: a real error\n")
  text = ("I1206 a log line\n" + closed + real + ignored + closed
          + "Exception ignored in: <function f at 0x1>\nplain\n")
  for i in range(0, len(text), 7):            # written in small pieces
    noise.write(text[i:i + 7])
  noise.flush()
  assert noise.dropped == 3
  assert out.getvalue() == ("I1206 a log line\n" + real
                            + "Exception ignored in: <function f at 0x1>\n"
                              "plain\n")


def test_window_rows_carry_tflops_per_device_and_mfu(monkeypatch):
  """tokens/s x analytic FLOPs per token / devices, and its share of the
  devices' peak; without a known peak (a CPU) no `mfu`."""
  clock = FakeClock()
  monkeypatch.setattr(metrics, "time", clock)
  window = metrics.Window(tokens_per_step=1000, flops_per_token=6e9,
                          devices=4, peak_flops=5e12)
  window.add(1, step_metrics(1))
  clock.now += 30.0
  window.time_first_step()
  window.add(2, step_metrics(2))
  clock.now += 2.0
  window.fetch()
  row = window.row()
  assert row["tokens_per_s"] == pytest.approx(500.0)
  assert row["tflops_per_device"] == pytest.approx(500 * 6e9 / 4 / 1e12)
  assert row["mfu"] == pytest.approx(500 * 6e9 / 4 / 5e12)
  assert "mfu=15.0%" in metrics._format(row, metrics._TRAIN_KEYS)  # pylint: disable=protected-access
  plain = metrics.Window(tokens_per_step=10, flops_per_token=1e6)
  plain.add(1, step_metrics(1))
  clock.now += 1.0
  plain.time_first_step()
  plain.fetch()
  assert "mfu" not in plain.row() and "tflops_per_device" in plain.row()
