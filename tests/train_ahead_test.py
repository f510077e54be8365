"""Tests of train.ahead: background jobs, their errors, the abstract batch,
and the order in which the loop lowers and compiles the steps."""

import os
import threading
import types

import jax
import numpy as np
import pytest

from data import packing
from kda_lm.train import ahead
from kda_lm.train import loop as train_loop


def test_wait_gives_each_jobs_seconds_and_runs_them_in_threads():
  names = {}

  def job(name):
    return lambda: names.update({name: threading.current_thread().name})

  seconds = ahead.Ahead({"a": job("a"), "b": job("b")}).wait()
  assert sorted(seconds) == ["a", "b"] and min(seconds.values()) >= 0
  assert names == {"a": "kda_lm compile: a", "b": "kda_lm compile: b"}


def test_a_failed_job_raises_at_wait_not_at_join():
  release = threading.Event()

  def fails():
    release.wait()
    raise ValueError("bad step")

  jobs = ahead.Ahead({"ok": lambda: None, "bad": fails})
  release.set()
  jobs.join()   # Waits, raises nothing.
  with pytest.raises(ValueError, match="bad step"):
    jobs.wait()


def test_wait_for_one_job_leaves_the_others_running():
  release, done = threading.Event(), []

  def slow():
    release.wait(timeout=30)
    done.append("slow")

  jobs = ahead.Ahead({"slow": slow, "fast": lambda: None})
  jobs.wait_for("fast")
  assert done == []   # "slow" still runs.
  release.set()
  failing = ahead.Ahead({"bad": lambda: 1 / 0})
  with pytest.raises(ZeroDivisionError):
    failing.wait_for("bad")
  assert sorted(jobs.wait()) == ["fast", "slow"]


def test_abstract_batch_is_the_global_batch_of_the_pipeline_features():
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  batch = ahead.abstract_batch(4, 16, sharding)
  assert list(batch) == list(packing.FEATURES)
  for key, spec in batch.items():
    assert spec.shape == (4, 16) and spec.sharding == sharding
    assert spec.dtype == np.dtype(packing.FEATURES[key].as_numpy_dtype)
  assert batch["inputs"].dtype == np.int32
  assert batch["loss_mask"].dtype == np.float32


def test_a_job_name_starts_once():
  calls = []
  jobs = ahead.Ahead()
  assert not jobs.started("a")
  jobs.start("a", lambda: calls.append(1))
  jobs.start("a", lambda: calls.append(2))
  assert jobs.started("a") and sorted(jobs.wait()) == ["a"]
  assert calls == [1]


class _Program:
  """A lowered step whose compilation is recorded."""

  def __init__(self, name, events):
    self.name, self.events = name, events

  def compile(self):
    self.events.append(("compiled", self.name))


def _run_with_fake_steps(monkeypatch, events, num_steps=3):
  """A `loop._Run` with only what `lower_steps` reads, whose lowerings
  record which steps had started compiling when each was lowered."""
  run = object.__new__(train_loop._Run)  # pylint: disable=protected-access
  run.cfg = types.SimpleNamespace(
      train=types.SimpleNamespace(num_steps=num_steps),
      eval=types.SimpleNamespace(every_steps=1),
      data=types.SimpleNamespace(batch_size=2, seq_len=8))
  run.steps, run.lowered, run.ahead, run.phases = None, {}, None, []

  def lowerings(steps, batch_size, seq_len, with_eval, with_init):
    del steps, batch_size, seq_len
    assert with_eval
    names = ["train step"] + [ahead.INIT] * with_init + ["eval step"]

    def lower(name):
      def traced():
        started = [n for n in names
                   if run.ahead is not None and run.ahead.started(n)]
        events.append(("lowered", name, started))
        return _Program(name, events)
      return traced
    return {name: lower(name) for name in names}

  monkeypatch.setattr(train_loop.ahead_lib, "lowerings", lowerings)
  return run


def test_a_fresh_run_compiles_each_step_once_it_is_lowered(monkeypatch):
  events = []
  run = _run_with_fake_steps(monkeypatch, events)
  run.lower_steps(None)
  run.ahead.wait()
  # The train step compiled while the state's initialisation and the eval
  # step were traced.
  assert [e for e in events if e[0] == "lowered"] == [
      ("lowered", "train step", []),
      ("lowered", "state init", ["train step"]),
      ("lowered", "eval step", ["train step", "state init"])]
  assert sorted(e for e in events if e[0] == "compiled") == [
      ("compiled", "eval step"), ("compiled", "state init"),
      ("compiled", "train step")]
  assert [name for name, _ in run.phases] == ["steps traced"]


def test_a_resumed_run_compiles_only_after_its_checks(monkeypatch):
  events = []
  run = _run_with_fake_steps(monkeypatch, events)
  run.lower_steps(1)
  assert run.ahead is None and [e[0] for e in events] == ["lowered"] * 2
  run.compile_ahead(1)
  run.compile_ahead(1)   # Once.
  run.ahead.wait()
  assert sorted(events[2:]) == [("compiled", "eval step"),
                                ("compiled", "train step")]


def test_nothing_is_lowered_or_compiled_past_the_last_step(monkeypatch):
  events = []
  run = _run_with_fake_steps(monkeypatch, events, num_steps=3)
  run.lower_steps(3)
  run.compile_ahead(3)
  assert events == [] and run.ahead is None and run.phases == []


def test_cache_counts_name_the_programs_read_back():
  """The start-up line's count: requests to the persistent cache since the
  run began, and the hits among them (JAX's monitoring events)."""
  record = jax.monitoring.record_event
  record("/jax/compilation_cache/compile_requests_use_cache")
  counts = ahead.CacheCounts()
  assert not counts.text()
  for _ in range(3):
    record("/jax/compilation_cache/compile_requests_use_cache")
  record("/jax/compilation_cache/cache_hits")
  assert counts.text() == "; compilation cache: read back 1 of 3 programs"


def test_compilation_cache_key_points_jax_at_the_workdir(tmp_path):
  """"workdir" -> <workdir>/jax_cache; a folder; "" none; a folder already
  configured (JAX_COMPILATION_CACHE_DIR) wins."""
  wd = str(tmp_path)
  assert ahead.compilation_cache_dir("workdir", wd, None) == (
      os.path.join(wd, "jax_cache"))
  assert ahead.compilation_cache_dir("~/c", wd, "") == (
      os.path.expanduser("~/c"))
  assert ahead.compilation_cache_dir("", wd, None) is None
  assert ahead.compilation_cache_dir("workdir", wd, "/elsewhere") is None
