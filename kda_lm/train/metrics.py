"""Training output: `metrics.jsonl`, TensorBoard events, progress display.

`MetricsWriter` appends one JSON object per logged step to
`<workdir>/metrics.jsonl` (train rows, means over the steps since the
previous row, `steps_averaged` of them: `step`, `loss`, `accuracy`,
`grad_norm`, `lr`, `tokens_per_s`, `tflops_per_device`, `mfu` (on devices
with a known peak), ...; eval rows: `step`, `eval_loss`,
`eval_accuracy`, ...) and optionally mirrors every scalar to TensorBoard
event files (tensorboardX) under `<workdir>/tensorboard`. Only process 0
writes; other processes get a writer that does nothing.

`NoiseFilter` drops from stderr the tracebacks Orbax's abandoned writes
print after a failed save (`kda_lm.logs` quiets the libraries' INFO lines).

`Progress` shows a tqdm bar with the latest loss, accuracy and tokens/s when
stderr is a terminal, and plain absl log lines otherwise.

`Window` gathers the device metrics of the steps since the last row and
times them (tokens/s without compilation, eval or checkpoint time).
"""

import contextlib
import json
import math
import os
import sys
import time
from typing import Any, Iterable, Mapping

from absl import logging
import jax
import numpy as np

METRICS_FILE = "metrics.jsonl"

class NoiseFilter:
  """A stderr wrapper that drops the tracebacks of a failed save's writes.

  When a checkpoint write fails (a full disk), Orbax's other writes of that
  save are abandoned: their completion callbacks find the save's event
  loop closed ("RuntimeError: Event loop is closed") and their coroutines
  are collected unfinished at exit ("Exception ignored in: <coroutine ..."),
  hundreds of tracebacks around the one error that matters. Those two forms
  are dropped (and counted); every other line and traceback passes
  through, a traceback once it is complete.
  """

  _STARTS = ("Traceback (most recent call last):",
             "Exception ignored in: <coroutine")

  def __init__(self, stream):
    self.stream = stream
    self.dropped = 0
    self._partial = ""
    self._block = None

  def write(self, text: str) -> int:
    self._partial += text
    while "\n" in self._partial:
      line, self._partial = self._partial.split("\n", 1)
      self._line(line + "\n")
    return len(text)

  def _line(self, line: str) -> None:
    if self._block is None:
      if line.startswith(self._STARTS):
        self._block = [line]
      else:
        self.stream.write(line)
      return
    self._block.append(line)
    if line[:1] in (" ", "\t", "\n") or line.startswith(self._STARTS[0]):
      return                       # frames, or the traceback that follows
    block, self._block = "".join(self._block), None
    if block.startswith(self._STARTS[1]) or line.startswith(
        "RuntimeError: Event loop is closed"):
      self.dropped += 1
    else:
      self.stream.write(block)

  def flush(self) -> None:
    if self._block is not None:
      self.stream.write("".join(self._block))
      self._block = None
    self.stream.flush()

  def __getattr__(self, name: str) -> Any:
    return getattr(self.stream, name)


def _clean(value: Any) -> Any:
  """Makes a metric value JSON-friendly (numpy scalars -> Python)."""
  if hasattr(value, "item"):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)  # "nan", "inf": JSON has no literal for them.
  return value


def _parse_lines(path: str) -> tuple[list[dict[str, Any]], int]:
  """Parses a metrics file; returns (rows, number of unreadable lines)."""
  rows, bad = [], 0
  with open(path, encoding="utf-8", errors="replace") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        row = None
      if isinstance(row, dict) and line.endswith("\n"):
        rows.append(row)
      else:
        bad += 1
  return rows, bad


def read_metrics(path: str) -> list[dict[str, Any]]:
  """Reads a `metrics.jsonl` file (or the one in a workdir).

  A torn line (a write cut short by a kill or a full disk) is skipped with
  a warning naming the file.

  Args:
    path: the file, or a workdir containing `metrics.jsonl`.

  Returns:
    The rows in file order; an empty list if the file does not exist.
  """
  if os.path.isdir(path):
    path = os.path.join(path, METRICS_FILE)
  if not os.path.exists(path):
    return []
  rows, bad = _parse_lines(path)
  if bad:
    logging.warning("Skipping %d torn or unreadable line(s) of %s.", bad,
                    path)
  return rows


def first_reaching(rows: list[dict[str, Any]], target: float,
                   key: str = "eval_accuracy") -> dict[str, Any] | None:
  """Returns the first row whose `key` is >= `target`, or None.

  Args:
    rows: metrics rows, e.g. from `read_metrics`.
    target: the threshold, e.g. 0.99.
    key: the metric.

  Returns:
    The row (with its `step` and `wall_s`), or None if never reached.
  """
  for row in rows:
    value = row.get(key)
    if isinstance(value, (int, float)) and value >= target:
      return row
  return None


class MetricsWriter:
  """Appends metric rows to `metrics.jsonl` and optional TensorBoard events."""

  def __init__(self, workdir: str, *, tensorboard: bool = False,
               enabled: bool = True):
    """Opens the writer.

    Args:
      workdir: the run directory (created if needed).
      tensorboard: also write tensorboardX event files to
        `<workdir>/tensorboard`.
      enabled: False makes every method a no-op (non-zero processes).
    """
    self.path = os.path.join(workdir, METRICS_FILE)
    self.enabled = enabled
    self._tb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    if tensorboard:
      import tensorboardX  # pylint: disable=g-import-not-at-top
      self._tb = tensorboardX.SummaryWriter(os.path.join(workdir,
                                                         "tensorboard"))

  def truncate_after(self, step: int) -> None:
    """Drops rows with `step > step` (rows logged after the resumed checkpoint).

    A run that resumes from the checkpoint of `step` recomputes the later
    steps, so their old rows would otherwise appear twice. A torn line (a
    write cut short by a kill or a full disk) is dropped too, with a warning.

    Args:
      step: the step training resumes from.
    """
    if not self.enabled or not os.path.exists(self.path):
      return
    rows, bad = _parse_lines(self.path)
    kept = [row for row in rows if row.get("step", 0) <= step]
    if bad:
      logging.warning("Dropping %d torn or unreadable line(s) from %s.",
                      bad, self.path)
    if len(kept) == len(rows) and not bad:
      return
    logging.info("Dropping %d rows after step %d from %s.",
                 len(rows) - len(kept), step, self.path)
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      for row in kept:
        f.write(json.dumps(row) + "\n")
    os.replace(tmp, self.path)

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Appends one row `{"step": step, **scalars}`.

    Args:
      step: the training step the row belongs to.
      scalars: metric name -> number.
    """
    if not self.enabled:
      return
    row = {"step": int(step)}
    row.update({k: _clean(v) for k, v in scalars.items()})
    line = (json.dumps(row) + "\n").encode("utf-8")
    # One write(2) per row on an O_APPEND file: rows are never interleaved,
    # and a kill leaves at most one torn last line (dropped on resume).
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      os.write(fd, line)
    finally:
      os.close(fd)
    if self._tb is not None:
      for key, value in row.items():
        if key != "step" and isinstance(value, (int, float)):
          self._tb.add_scalar(key, value, int(step))

  def flush(self) -> None:
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def _format(scalars: Mapping[str, Any], keys: Iterable[str]) -> str:
  parts = []
  for key in keys:
    if key in scalars:
      value = scalars[key]
      if key == "tokens_per_s":
        parts.append(f"{key}={value:,.0f}")
      elif key == "mfu":
        parts.append(f"{key}={100 * value:.1f}%")
      elif key == "tflops_per_device":
        parts.append(f"tflops/dev={value:.2f}")
      elif key == "lr":
        parts.append(f"{key}={value:.2e}")
      else:
        parts.append(f"{key}={value:.4f}")
  return " ".join(parts)


_TRAIN_KEYS = ("loss", "accuracy", "grad_norm", "lr", "tokens_per_s",
               "tflops_per_device", "mfu")
_EVAL_KEYS = ("eval_loss", "eval_accuracy")


class Progress:
  """A tqdm progress bar on a terminal, plain log lines otherwise."""

  def __init__(self, total: int, initial: int = 0, *, enabled: bool = True,
               use_bar: bool | None = None):
    """Starts the display.

    Args:
      total: the last step.
      initial: the step training starts from.
      enabled: False disables all output (non-zero processes).
      use_bar: force (True) or disable (False) the bar; None: a bar iff
        stderr is a terminal.
    """
    self.total = total
    self.enabled = enabled
    if use_bar is None:
      use_bar = sys.stderr.isatty()
    self._bar = None
    self._eval = {}
    if enabled and use_bar:
      import tqdm  # pylint: disable=g-import-not-at-top
      self._bar = tqdm.tqdm(total=total, initial=initial, unit="step",
                            dynamic_ncols=True, smoothing=0.1)

  def train(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Shows a train row."""
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.update(step - self._bar.n)
      postfix = {k: scalars[k] for k in ("loss", "accuracy") if k in scalars}
      if "tokens_per_s" in scalars:
        postfix["tok/s"] = f"{scalars['tokens_per_s']:,.0f}"
      postfix.update(self._eval)
      self._bar.set_postfix(postfix, refresh=True)
    else:
      # The train loss is the mean over the row's steps (changing
      # parameters); an eval row's is that of one step's parameters.
      n = scalars.get("steps_averaged")
      logging.info("step %d/%d%s: %s", step, self.total,
                   f" (mean of {int(n)} steps)" if n and n > 1 else "",
                   _format(scalars, _TRAIN_KEYS))

  def eval(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Shows an eval row."""
    if not self.enabled:
      return
    if self._bar is not None:
      self._eval = {"eval_acc": f"{scalars.get('eval_accuracy', 0):.4f}"}
      self._bar.write(f"step {step}: {_format(scalars, _EVAL_KEYS)}")
    else:
      logging.info("step %d/%d eval: %s", step, self.total,
                   _format(scalars, _EVAL_KEYS))

  def message(self, text: str) -> None:
    """Logs a line (without breaking the bar)."""
    if not self.enabled:
      return
    logging.info("%s", text)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None


class Window:
  """Device metrics and token throughput of the steps since the last row.

  With `flops_per_token` (the model's analytic training FLOPs per token,
  `kda_lm.flops.step_flops`) a row also carries `tflops_per_device`, over
  `devices` devices, and, given the devices' `peak_flops`, `mfu`.
  """

  def __init__(self, tokens_per_step: int, flops_per_token: float = 0.0,
               devices: int = 1, peak_flops: float | None = None):
    self._tokens_per_step = tokens_per_step
    self._flops_per_token = flops_per_token
    self._devices = devices
    self._peak = peak_flops
    self._pending: list[tuple[int, dict[str, jax.Array]]] = []
    self._fetched: list[dict[str, float]] = []
    self._first_tokens = 0
    self._first_s = 0.0
    self.reset()

  def reset(self) -> None:
    """Starts a new row: drops the fetched metrics, restarts the clock."""
    self._fetched = []
    self._tokens = 0
    self._start = time.time()
    self._paused = 0.0

  def add(self, step: int, step_metrics: dict[str, jax.Array]) -> None:
    """Records a dispatched step (its metrics stay on the device)."""
    self._pending.append((step, step_metrics))
    self._tokens += self._tokens_per_step

  def time_first_step(self) -> float:
    """Syncs once after the first step, whose time includes compilation and
    is left out of tokens/s; returns that time in seconds."""
    first = self._fetch()
    self._first_s = time.time() - self._start
    self._first_tokens = self._tokens
    self.reset()
    self._fetched = [m for _, m in first]
    return self._first_s

  def _fetch(self) -> list[tuple[int, dict[str, float]]]:
    if not self._pending:
      return []
    values = jax.device_get([m for _, m in self._pending])
    new = [(s, {k: float(v) for k, v in m.items()})
           for (s, _), m in zip(self._pending, values, strict=True)]
    self._pending = []
    return new

  def fetch(self) -> list[tuple[int, dict[str, float]]]:
    """Copies pending metrics to the host (the only device sync)."""
    new = self._fetch()
    self._fetched.extend(m for _, m in new)
    return new

  def has_rows(self) -> bool:
    return bool(self._fetched)

  def row(self) -> dict[str, float]:
    """The mean of the fetched steps' metrics, the last `lr`, tokens/s."""
    rows = self._fetched
    out = {k: float(np.mean([m[k] for m in rows]))
           for k in rows[-1] if k != "lr"}
    out["lr"] = rows[-1]["lr"]
    out["steps_averaged"] = len(rows)
    if self._tokens:
      elapsed = max(time.time() - self._start - self._paused, 1e-9)
      out["tokens_per_s"] = self._tokens / elapsed
    else:  # Only the first step, whose time includes compilation.
      out["tokens_per_s"] = self._first_tokens / max(self._first_s, 1e-9)
    if self._flops_per_token:
      per_device = (out["tokens_per_s"] * self._flops_per_token
                    / self._devices)
      out["tflops_per_device"] = per_device / 1e12
      if self._peak:
        out["mfu"] = per_device / self._peak
    return out

  @contextlib.contextmanager
  def paused(self):
    """Leaves the time spent inside (eval, checkpoints) out of tokens/s."""
    start = time.time()
    try:
      yield
    finally:
      self._paused += time.time() - start
