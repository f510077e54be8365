"""Stopping a run cleanly when its machine is taken away, and saving by time.

Preemptible accelerators get SIGTERM and about 30 seconds. `Preemption`
turns SIGTERM (and SIGINT) into a flag that the loop reads after every
step:

* one process: the flag is set by this module's handler (SIGTERM and
  SIGINT);
* several processes (`jax.distributed`): JAX's coordination service hears
  SIGTERM on any host, and `reached_preemption_sync_point` makes every
  process agree on the same stopping step, so they all save that step
  (a save is collective: a process that stopped alone would hang the
  others). SIGINT keeps Python's default there (KeyboardInterrupt).

The loop then writes the stopping step's checkpoint synchronously (with
the data iterator), logs one line saying where to resume, and the program
exits with `PREEMPTED_EXIT` (75, EX_TEMPFAIL: "try again later"). A second
signal while the checkpoint is written is logged and ignored: Orbax writes
a step into a temporary directory and renames it when complete, so a
process killed during the save leaves the previous checkpoints valid.

`SaveClock` adds time-based checkpoints (`checkpoint.every_seconds`): every
process asks it at the same steps, and process 0's clock decides for all.
"""

import signal
import time
from typing import Any, Callable, Optional

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

# Exit status of a run that stopped for a preemption and saved its step.
PREEMPTED_EXIT = 75


class Preempted(Exception):
  """The run stopped at `step` for a signal; its checkpoint is saved."""

  def __init__(self, step: int, where: str):
    super().__init__(
        f"Preempted: stopped at step {step} and saved its checkpoint in "
        f"{where}; run the same command again to resume from it.")
    self.step = step


class Preemption:
  """Signal handling for the training loop (a context manager).

  Attributes:
    signal_name: the first signal received ("SIGTERM", "SIGINT"), or None.
  """

  def __init__(self, multi_process: Optional[bool] = None):
    self.multi_process = (jax.process_count() > 1 if multi_process is None
                          else multi_process)
    self.signal_name = None
    self._previous = {}

  def _signals(self) -> tuple[int, ...]:
    # With several processes SIGTERM belongs to JAX's preemption notifier
    # (replacing its handler would hide the notice from the other hosts),
    # and a SIGINT stopping one process alone would hang the others.
    if self.multi_process:
      return ()
    return (signal.SIGTERM, signal.SIGINT)

  def __enter__(self) -> "Preemption":
    for signum in self._signals():
      try:
        self._previous[signum] = signal.signal(signum, self._handle)
      except ValueError:  # Not the main thread: leave signals alone.
        pass
    return self

  def __exit__(self, *exc: Any) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.signal_name is None:
      self.signal_name = name
      logging.warning("Received %s: stopping after the current step and "
                      "saving its checkpoint.", name)
    else:
      logging.warning("Received %s again while stopping: the checkpoint "
                      "being written completes first.", name)

  def reached(self, step: int) -> bool:
    """Whether to stop after `step` (every process gets the same answer)."""
    if self.multi_process:
      # Every process calls this at every step, as the sync point needs.
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal_name = self.signal_name or "SIGTERM"
    return self.signal_name is not None


class SaveClock:
  """Time-based checkpoints: due when `every_seconds` passed since the last
  save (None: never). Asked only at steps where every process asks, and
  process 0's answer is broadcast, so all processes save together."""

  def __init__(self, every_seconds: Optional[float],
               clock: Callable[[], float] = time.monotonic):
    self.every_seconds = every_seconds
    self.clock = clock
    self.last = clock()

  def due(self) -> bool:
    if self.every_seconds is None:
      return False
    due = self.clock() - self.last >= self.every_seconds
    if jax.process_count() > 1:
      due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
    return due

  def saved(self) -> None:
    self.last = self.clock()
