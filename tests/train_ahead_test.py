"""Tests of train.ahead: background jobs, their errors, the abstract batch."""

import threading

import jax
import numpy as np
import pytest

from data import packing
from kda_lm.train import ahead


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


def test_abstract_batch_is_the_global_batch_of_the_pipeline_features():
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  batch = ahead.abstract_batch(4, 16, sharding)
  assert list(batch) == list(packing.FEATURES)
  for key, spec in batch.items():
    assert spec.shape == (4, 16) and spec.sharding == sharding
    assert spec.dtype == np.dtype(packing.FEATURES[key].as_numpy_dtype)
  assert batch["inputs"].dtype == np.int32
  assert batch["loss_mask"].dtype == np.float32
