"""Tests of kda_lm.checkpoint.workdir: the lock, the resume checks and a
recorded config read back."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import helpers
import ml_collections
import pytest

from kda_lm import config as config_lib
from kda_lm.checkpoint import workdir
from kda_lm.train import state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hold_lock_in_subprocess(directory: str) -> subprocess.Popen:
  """Starts a process that takes the lock, prints 'locked', then waits."""
  code = textwrap.dedent(f"""
      import sys, time
      from kda_lm.checkpoint import workdir
      lock = workdir.WorkdirLock({directory!r}).acquire()
      print("locked", flush=True)
      sys.stdin.readline()
      lock.release()
  """)
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True)
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_second_holder_is_refused_naming_the_first(tmp_path):
  proc = _hold_lock_in_subprocess(str(tmp_path))
  try:
    with pytest.raises(workdir.WorkdirLockedError) as info:
      workdir.WorkdirLock(str(tmp_path)).acquire()
    assert f"PID {proc.pid}" in str(info.value)
  finally:
    proc.communicate("\n", timeout=30)
  # Released on a clean exit: free to take, with no stale-lock warning.
  with workdir.WorkdirLock(str(tmp_path)):
    pass


def test_lock_of_a_dead_process_is_taken_over(tmp_path, caplog):
  proc = _hold_lock_in_subprocess(str(tmp_path))
  proc.kill()
  proc.wait(timeout=30)
  with caplog.at_level(logging.WARNING):
    lock = workdir.WorkdirLock(str(tmp_path)).acquire()
  try:
    assert f"PID {proc.pid}" in caplog.text
    assert "no longer running" in caplog.text
    with open(lock.path) as f:
      assert json.load(f)["pid"] == os.getpid()
  finally:
    lock.release()


def test_exception_inside_the_locked_region_releases_the_lock(tmp_path,
                                                            caplog):
  """An error while training propagates, and the lock is released on the
  way out: a second trainer then takes it at once, with no stale-lock
  warning (the file was emptied)."""

  class Crash(Exception):
    pass

  with pytest.raises(Crash):
    with workdir.WorkdirLock(str(tmp_path)):
      # Held: another acquire (a new open file, as another process) fails.
      with pytest.raises(workdir.WorkdirLockedError):
        workdir.WorkdirLock(str(tmp_path)).acquire()
      raise Crash("the training step failed")
  # Released: no lock file is left behind.
  assert not os.path.exists(tmp_path / workdir.LOCK_FILE)
  with caplog.at_level(logging.WARNING):
    second = workdir.WorkdirLock(str(tmp_path)).acquire()
  try:
    assert "no longer running" not in caplog.text
  finally:
    second.release()
  # And in another process too.
  proc = _hold_lock_in_subprocess(str(tmp_path))
  proc.communicate("\n", timeout=30)
  assert proc.returncode == 0


SAVED = {"model": {"d_model": 64, "kda_impl": "auto"},
         "data": {"seed": 0, "dataset_seed": 0, "seq_len": 128,
                  "data_dir": "/a"},
         "opt": {"peak_lr": 1e-3}, "train": {"log_every": 10}}


def _given(**changes):
  config = json.loads(json.dumps(SAVED))
  for key, value in changes.items():
    section, name = key.split("__")
    config[section][name] = value
  return config


def test_meaning_changes_are_refused_with_every_key_listed():
  given = _given(data__dataset_seed=1, data__seq_len=64, model__d_model=32,
                 opt__peak_lr=2e-3)
  with pytest.raises(workdir.ConfigChangedError) as info:
    workdir.check_resume(SAVED, given, step=40, allow_change=False)
  message = str(info.value)
  for line in ("data.dataset_seed: 0 -> 1", "data.seq_len: 128 -> 64",
               "model.d_model: 64 -> 32"):
    assert line in message
  assert "peak_lr" not in message
  assert "step 40" in message and "allow_config_change" in message


def test_safe_changes_and_opt_in_pass():
  safe = _given(opt__peak_lr=2e-3, train__log_every=5,
                model__kda_impl="xla", data__data_dir="/b")
  assert workdir.check_resume(SAVED, safe, step=1, allow_change=False) == []
  changed = workdir.check_resume(SAVED, _given(data__seed=3), step=1,
                                 allow_change=True)
  assert [str(c) for c in changed] == ["data.seed: 0 -> 3"]


def test_write_config_keeps_a_history(tmp_path):
  workdir.write_config(str(tmp_path), SAVED, step=0)
  change = workdir.Change("data.seed", 0, 3)
  workdir.write_config(str(tmp_path), _given(data__seed=3), step=40,
                       changes=[change])
  with open(tmp_path / workdir.CONFIG_FILE) as f:
    assert json.load(f)["data"]["seed"] == 3
  with open(tmp_path / workdir.HISTORY_FILE) as f:
    history = [json.loads(line) for line in f]
  assert [h["start_step"] for h in history] == [0, 40]
  assert history[1]["changes"] == ["data.seed: 0 -> 3"]


def test_keys_added_since_the_checkpoint_are_no_change_at_their_defaults():
  """A run recorded before a key existed (here the SwiGLU clamps and the
  kernel settings) resumes when the key is left at its default, and is
  refused when it is set: the saved state was trained without it."""
  defaults = workdir.default_keys()
  given = {"model": {"num_experts": 4, "expert_swiglu_limits": [],
                     "kda_kernel": {"family": "", "heads_per_program": 0}}}
  saved = {"model": {"num_experts": 4}}
  assert workdir.config_changes(saved, given, defaults) == ([], [])
  meaning, _ = workdir.config_changes(saved, given)   # without defaults
  assert [c.key for c in meaning] == [
      "model.expert_swiglu_limits", "model.kda_kernel.family",
      "model.kda_kernel.heads_per_program"]
  given["model"]["expert_swiglu_limits"] = [4.0, 4.0]
  meaning, _ = workdir.config_changes(saved, given, defaults)
  assert [str(c) for c in meaning] == [
      "model.expert_swiglu_limits: None -> [4.0, 4.0]"]
  with pytest.raises(workdir.ConfigChangedError, match="swiglu"):
    workdir.check_resume(saved, given, step=3, allow_change=False,
                         defaults=defaults)


def test_a_lock_taken_on_a_deleted_file_is_taken_again(tmp_path,
                                                       monkeypatch):
  """A releasing holder deletes its file while it still holds it. A
  trainer that opened the file just before locks the deleted file: it must
  notice and lock the file now at the path, else a third trainer could
  hold the workdir at the same time."""
  opened = []
  real_open = os.open

  def open_then_lose_the_race(path, *args):
    fd = real_open(path, *args)
    if not opened:            # The holder deletes it right after.
      os.unlink(path)
    opened.append(fd)
    return fd

  monkeypatch.setattr(os, "open", open_then_lose_the_race)
  lock = workdir.WorkdirLock(str(tmp_path)).acquire()
  monkeypatch.undo()
  try:
    assert len(opened) == 2   # The deleted file's lock was dropped.
    assert os.stat(lock.path).st_ino == os.fstat(opened[1]).st_ino
    with pytest.raises(workdir.WorkdirLockedError):
      workdir.WorkdirLock(str(tmp_path)).acquire()
  finally:
    lock.release()


def test_another_datasets_key_is_no_change_of_meaning():
  """`data.vocab_size` is the delayed-copy task's: on a text_files run it
  means nothing, so a run recorded with another value resumes (the
  `:text` variant now records its BPE size there); on a delayed-copy run
  it is the data, and a change is refused."""
  saved = {"data": {"name": "text_files", "vocab_size": 32,
                    "bpe_vocab_size": 4096}}
  given = {"data": {"name": "text_files", "vocab_size": 4096,
                    "bpe_vocab_size": 4096}}
  meaning, safe = workdir.config_changes(saved, given)
  assert not meaning and [c.key for c in safe] == ["data.vocab_size"]
  given["data"]["bpe_vocab_size"] = 512
  meaning, _ = workdir.config_changes(saved, given)
  assert [c.key for c in meaning] == ["data.bpe_vocab_size"]
  copy = {"data": {"name": "delayed_copy", "vocab_size": 32}}
  meaning, _ = workdir.config_changes(
      copy, {"data": {"name": "delayed_copy", "vocab_size": 64}})
  assert [c.key for c in meaning] == ["data.vocab_size"]


def test_a_recorded_config_gets_the_keys_added_since(data_dir, tmp_path):
  """A config.json written before keys were added (an imported run being
  fine-tuned, a run being evaluated) reads back with them at their
  defaults, and passes the check it would fail as recorded."""
  config = json.loads(helpers.tiny_train_config(data_dir).to_json_best_effort())
  del config["train"]["init_rng"], config["opt"]["moment_dtype"]
  config["train"]["log_every"] = 7
  with pytest.raises(ValueError, match="Missing config keys"):
    config_lib.check_config(ml_collections.ConfigDict(config))
  filled = workdir.with_defaults(config)
  assert filled["train"]["init_rng"] == "auto"
  assert filled["opt"]["moment_dtype"] == "float32"
  assert filled["train"]["log_every"] == 7       # recorded values kept
  assert "init_rng" not in config["train"]       # a copy
  config_lib.check_config(ml_collections.ConfigDict(filled))
  workdir.write_config(str(tmp_path), config, step=0)
  loaded = state.load_config(str(tmp_path))
  assert loaded.train.init_rng == "auto" and loaded.train.log_every == 7
  config_lib.check_config(loaded)


def test_checkpoint_dir_default_relative_absolute_and_url(tmp_path):
  """`config.checkpoint.directory`: none is <workdir>/checkpoints, a
  relative path is taken from the workdir (the same from any working
  directory), an absolute path and a URL as given."""
  w = str(tmp_path / "run")
  assert workdir.checkpoint_dir(w) == os.path.join(w, "checkpoints")
  assert workdir.checkpoint_dir(w, "../store/c") == str(
      tmp_path / "store" / "c")
  assert workdir.checkpoint_dir(w, "/abs/c") == "/abs/c"
  assert workdir.checkpoint_dir(w, "gs://b/run/c") == "gs://b/run/c"
  assert workdir.recorded_checkpoint_dir(w) is None
