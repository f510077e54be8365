"""The train and eval steps compiled ahead of their first call.

A run's start-up is mostly compilation of three programs: the state's
initialisation, the update step and the eval step. The steps are traced
and lowered first (`lower_steps`, from their abstract arguments: the
state's shapes and shardings, a global `[B,T]` batch of
`data.packing.FEATURES`); `compile_steps` then compiles them in background
threads while the main thread restores or initialises the state. JAX
keeps each executable, so the first call of a step finds its program
compiled; XLA's compiler releases the GIL, so the compilations share the
host's cores.
"""

import threading
import time
from typing import Any, Callable, Mapping

from absl import logging
import jax
import numpy as np

from data import packing


def abstract_batch(batch_size: int, seq_len: int,
                   batch_sharding: jax.sharding.Sharding
                   ) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch the steps are called with (`sharding.global_batch`
  of the pipeline's `[batch_size, seq_len]` rows)."""
  return {key: jax.ShapeDtypeStruct((batch_size, seq_len),
                                    np.dtype(dtype.as_numpy_dtype),
                                    sharding=batch_sharding)
          for key, dtype in packing.FEATURES.items()}


class Ahead:
  """Named jobs (compilations), each run in its own background thread."""

  def __init__(self, jobs: Mapping[str, Callable[[], Any]]):
    self._seconds: dict[str, float] = {}
    self._errors: dict[str, BaseException] = {}
    self._threads = [
        threading.Thread(target=self._run, args=(name, job),
                         name=f"kda_lm compile: {name}")
        for name, job in jobs.items()]
    for thread in self._threads:
      thread.start()

  def _run(self, name: str, job: Callable[[], Any]) -> None:
    start = time.time()
    try:
      job()
    except BaseException as error:  # pylint: disable=broad-except
      self._errors[name] = error
    self._seconds[name] = time.time() - start

  def join(self) -> None:
    """Waits for every job (their errors are kept for `wait`)."""
    for thread in self._threads:
      thread.join()

  def wait(self) -> dict[str, float]:
    """Waits for every job; returns each one's seconds.

    Raises:
      The first failed job's error (the same error its step's first call
      would raise).
    """
    self.join()
    for error in self._errors.values():
      raise error
    return dict(self._seconds)


def lower_steps(steps: Any, batch_size: int, seq_len: int,
                with_eval: bool) -> dict[str, Any]:
  """`steps.update` (and `steps.eval_step` when `with_eval`) traced and
  lowered for the global batch of `batch_size` rows of `seq_len`, by name;
  `steps` is `loop.Steps` (steps with a `lower` method). Tracing holds the
  GIL, so it runs here, before the compilations share the cores."""
  batch = abstract_batch(batch_size, seq_len, steps.batch_sharding)
  lowered = {"train step": steps.update.lower(steps.abstract, batch)}
  if with_eval:
    lowered["eval step"] = steps.eval_step.lower(steps.abstract.params,
                                                 batch)
  return lowered


def compile_steps(lowered: Mapping[str, Any]) -> Ahead:
  """Starts compiling each of `lower_steps`' programs in its own thread."""
  logging.info("Compiling the %s in the background.", " and ".join(lowered))
  return Ahead({name: program.compile for name, program in lowered.items()})
