"""The train and eval steps compiled ahead of their first call.

A run's start-up is mostly compilation of three programs: the state's
initialisation, the update step and the eval step. Each step is traced
and lowered from its abstract arguments (the state's shapes and
shardings, a global `[B,T]` batch of `data.packing.FEATURES`), then
compiled in a background thread of `Ahead` while the main thread traces
the next step, builds the data and restores or initialises the state. A
fresh run's initialisation is lowered and compiled the same way, after
the train step (whose compilation is the longest) and before the eval
step, so that it is compiled by the time the data is built.
JAX keeps each executable, so the first call of a step finds its program
compiled; XLA's compiler releases the GIL, so the compilations share the
host's cores with the main thread's work. JAX's persistent compilation
cache (`train.compilation_cache`, `use_compilation_cache`) lets a rerun
read the programs back; `CacheCounts` counts what it returned.
"""

import os
import threading
import time
from typing import Any, Callable, Mapping

from absl import logging
import jax
from jax.experimental.compilation_cache import compilation_cache
import numpy as np

from data import packing

# The name of a fresh state's initialisation among the programs compiled
# ahead (`lowerings`).
INIT = "state init"


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

  def __init__(self, jobs: Mapping[str, Callable[[], Any]] | None = None):
    self._seconds: dict[str, float] = {}
    self._errors: dict[str, BaseException] = {}
    self._threads: dict[str, threading.Thread] = {}
    for name, job in (jobs or {}).items():
      self.start(name, job)

  def start(self, name: str, job: Callable[[], Any]) -> None:
    """Runs `job` in a new thread, unless a job of that name was started."""
    if name in self._threads:
      return
    thread = threading.Thread(target=self._run, args=(name, job),
                              name=f"kda_lm compile: {name}")
    self._threads[name] = thread
    thread.start()

  def started(self, name: str) -> bool:
    """Whether a job of that name was started."""
    return name in self._threads

  def _run(self, name: str, job: Callable[[], Any]) -> None:
    start = time.time()
    try:
      job()
    except BaseException as error:  # pylint: disable=broad-except
      self._errors[name] = error
    self._seconds[name] = time.time() - start

  def join(self) -> None:
    """Waits for every job (their errors are kept for `wait`)."""
    for thread in list(self._threads.values()):
      thread.join()

  def wait_for(self, name: str) -> None:
    """Waits for the job `name`, re-raising its error."""
    self._threads[name].join()
    if name in self._errors:
      raise self._errors[name]

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


def lowerings(steps: Any, batch_size: int, seq_len: int,
              with_eval: bool, with_init: bool = False
              ) -> dict[str, Callable[[], Any]]:
  """How to trace and lower `steps.update` (then `steps.init` from
  `steps.rng` when `with_init`, then `steps.eval_step` when `with_eval`)
  for the global batch of `batch_size` rows of `seq_len`, by name, in the
  order to run them; `steps` is `loop.Steps` (steps with a `lower`
  method). Tracing holds the GIL, so each runs in the main thread, the
  train step first: its compilation, the longest, can start while the
  others are traced."""
  batch = abstract_batch(batch_size, seq_len, steps.batch_sharding)
  lowerings_ = {"train step": lambda: steps.update.lower(steps.abstract,
                                                         batch)}
  if with_init:
    lowerings_[INIT] = lambda: steps.init.lower(steps.rng)
  if with_eval:
    lowerings_["eval step"] = lambda: steps.eval_step.lower(
        steps.abstract.params, batch)
  return lowerings_


def compilation_cache_dir(choice: str, workdir: str,
                          configured: str | None) -> str | None:
  """The folder `train.compilation_cache` asks for ("workdir": the run's
  folder; "": none), or None when one is already `configured`."""
  if not choice or configured:
    return None
  return (os.path.join(workdir, "jax_cache") if choice == "workdir"
          else os.path.abspath(os.path.expanduser(choice)))


def use_compilation_cache(choice: str, workdir: str) -> None:
  """Points JAX's persistent compilation cache at `compilation_cache_dir`."""
  path = compilation_cache_dir(choice, workdir,
                               jax.config.jax_compilation_cache_dir)
  if path is None:
    return
  jax.config.update("jax_compilation_cache_dir", path)
  # Every program, not only those that took over a second: a rerun then
  # compiles nothing.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  # Programs compiled before this point (none in train.py) kept the
  # cache's earlier state: start it again.
  compilation_cache.reset_cache()
  logging.info("Compilation cache: %s.", path)


class CacheCounts:
  """Programs that asked the persistent compilation cache, and those it
  returned, since this object was made (JAX's monitoring events)."""

  _REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
  _HIT = "/jax/compilation_cache/cache_hits"
  _counts = {_REQUEST: 0, _HIT: 0}
  _listening = False

  @classmethod
  def _on_event(cls, event: str, **kwargs) -> None:
    del kwargs
    if event in cls._counts:
      cls._counts[event] += 1

  def __init__(self):
    if not CacheCounts._listening:
      jax.monitoring.register_event_listener(CacheCounts._on_event)
      CacheCounts._listening = True
    self._start = dict(self._counts)

  def text(self) -> str:
    """"read back H of N programs", or "" when none asked the cache."""
    asked, hits = (self._counts[k] - self._start[k]
                   for k in (self._REQUEST, self._HIT))
    return f"; compilation cache: read back {hits} of {asked} programs" if (
        asked) else ""
