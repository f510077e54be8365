"""Tests of train.loop and train.py: runs, resume, faults, log rows, meshes."""

import collections
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from unittest import mock

import helpers
import jax
import numpy as np
import process_support
import pytest

from data import pipeline
from kda_lm import logs
from kda_lm.checkpoint import compat, data_item, manifest
from kda_lm.checkpoint import manager as manager_lib
from kda_lm.checkpoint import workdir as workdir_lib
from kda_lm.train import loop as train_loop
from kda_lm.train import metrics
from kda_lm.train import state as state_lib

# Subprocesses (a new process for resuming, SIGKILL, 4 fake CPU devices) run
# `train.py` on a generated config file; they share the TFDS data dir and a
# persistent JAX compilation cache with this process.

# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

# The tiny model (helpers.TINY_TRAIN_OVERRIDES): its overrides and config.
overrides = helpers.tiny_train_overrides
tiny_config = helpers.tiny_train_config
_table_batch = helpers.table_batch
_one_device_sharding = helpers.one_device_batch_sharding
_config_file, _command = helpers.write_config_file, helpers.train_command


def eval_losses(workdir):
  return {r["step"]: r["eval_loss"] for r in metrics.read_metrics(workdir)
          if "eval_loss" in r}


def restore_params(workdir, like_state):
  manager = manager_lib.CheckpointManager(
      os.path.join(workdir, "checkpoints"))
  state = manager.restore(jax.eval_shape(lambda: like_state))
  manager.close()
  return state


@contextlib.contextmanager
def compile_log():
  """Counts the programs lowered ("Compiling jit(f)") and compiled
  ("Finished XLA compilation of jit(f)", a cache hit too) by (what,
  function name, thread name), in every thread: JAX's `jax_log_compiles`
  messages."""
  counts = collections.Counter()
  prefixes = {"lowered": "Compiling jit(",
              "compiled": "Finished XLA compilation of jit("}

  class Handler(logging.Handler):

    def emit(self, record):
      text = record.getMessage()
      for what, prefix in prefixes.items():
        if text.startswith(prefix):
          name = text[len(prefix):].split(")")[0]
          counts[what, name, record.threadName] += 1

  handler, logger = Handler(), logging.getLogger("jax")
  logger.addHandler(handler)
  jax.config.update("jax_log_compiles", True)
  try:
    yield counts
  finally:
    jax.config.update("jax_log_compiles", False)
    logger.removeHandler(handler)


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------
# Runs: one step, resume in a new process or after SIGKILL, a NaN loss.


def test_one_step_smoke(tmp_path, data_dir, cache_dir):
  del cache_dir
  workdir = str(tmp_path / "run")
  config = tiny_config(data_dir, train__num_steps=1, train__tensorboard=True)
  with compile_log() as lowered:
    state = train_loop.train_and_evaluate(config, workdir)
  assert int(state.step) == 1
  # The steps and the state's initialisation were lowered first and
  # compiled in the background; their first calls compiled nothing more.
  steps = {k: n for k, n in lowered.items()
           if k[1] in ("update", "eval_step", "init")}
  assert steps == {
      ("lowered", "update", "MainThread"): 1,
      ("lowered", "init", "MainThread"): 1,
      ("lowered", "eval_step", "MainThread"): 1,
      ("compiled", "update", "kda_lm compile: train step"): 1,
      ("compiled", "init", "kda_lm compile: state init"): 1,
      ("compiled", "eval_step", "kda_lm compile: eval step"): 1}, lowered
  rows = metrics.read_metrics(workdir)
  train_row, eval_row = rows
  assert train_row["step"] == 1 and np.isfinite(train_row["loss"])
  for key in ("accuracy", "grad_norm", "lr", "tokens_per_s", "wall_s"):
    assert key in train_row
  assert eval_row["step"] == 1
  assert 0.0 <= eval_row["eval_accuracy"] <= 1.0
  assert eval_row["eval_loss"] > 0 and eval_row["eval_tokens"] > 0
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["model"]["d_model"] == 32
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["1"]
  assert any(name.startswith("events.out.tfevents") for name in
             os.listdir(os.path.join(workdir, "tensorboard")))
  # Rerunning the finished run restores and does nothing more.
  with compile_log() as lowered:
    again = train_loop.train_and_evaluate(config, workdir)
  assert_trees_equal(again.params, state.params)
  assert len(metrics.read_metrics(workdir)) == 2

  # A different model refuses the checkpoint, naming the parameter.
  bigger = tiny_config(data_dir, train__num_steps=1, model__mlp_hidden_dim=96)
  with compile_log() as lowered_too, pytest.raises(
      compat.IncompatibleCheckpointError,
      match=r"'layer_0/mlp/\w+/w' has shape"):
    train_loop.train_and_evaluate(bigger, workdir)
  # Neither compiled its steps: nothing to train, a refused checkpoint.
  assert not [k for k in lowered + lowered_too if k[1] == "update"]

  # The metrics plot.
  from experiments import plot_metrics  # pylint: disable=g-import-not-at-top
  png = plot_metrics.plot(workdir)
  assert os.path.getsize(png) > 1000


def test_exact_resume_in_a_new_process(tmp_path, data_dir, cache_dir):
  n = 3
  common = dict(eval__every_steps=0, checkpoint__every_steps=n)
  straight = str(tmp_path / "straight")
  state = train_loop.train_and_evaluate(
      tiny_config(data_dir, train__num_steps=2 * n, **common), straight)
  resumed = str(tmp_path / "resumed")
  train_loop.train_and_evaluate(
      tiny_config(data_dir, train__num_steps=n, **common), resumed)
  config_file = _config_file(tmp_path, data_dir, **common)
  result = helpers.run_train(config_file, resumed, cache_dir,
                     f"--config.train.num_steps={2 * n}")
  assert f"Resuming from the checkpoint of step {n}" in result.stderr
  losses = [(r["step"], r["loss"]) for r in helpers.train_rows(straight)]
  assert [s for s, _ in losses] == list(range(1, 2 * n + 1))
  assert [(r["step"], r["loss"]) for r in helpers.train_rows(resumed)] == losses
  restored = restore_params(resumed, state)
  assert int(restored.step) == 2 * n
  assert_trees_equal(restored.params, state.params)
  assert_trees_equal(restored.opt_state, state.opt_state)


def test_sigkill_then_rerun_resumes(tmp_path, data_dir, cache_dir):
  workdir = str(tmp_path / "run")
  config_file = _config_file(
      tmp_path, data_dir, train__num_steps=100_000, train__log_every=50,
      eval__every_steps=0, checkpoint__every_steps=5,
      checkpoint__max_to_keep=2)
  proc = subprocess.Popen(
      _command(config_file, workdir), cwd=process_support.REPO,
      env=process_support.subprocess_env(cache_dir), stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL)
  checkpoints = os.path.join(workdir, "checkpoints")
  deadline = time.time() + 240
  try:
    while time.time() < deadline and proc.poll() is None:
      if os.path.isdir(checkpoints) and any(
          name.isdigit() for name in os.listdir(checkpoints)):
        break
      time.sleep(0.05)
    time.sleep(0.3)  # Let it run on, possibly into the next save.
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert proc.returncode == -signal.SIGKILL
  manager = manager_lib.CheckpointManager(checkpoints)
  last = manager.latest_step()
  manager.close()
  assert last is not None and last >= 5
  # The rerun (a shorter schedule, to finish quickly) resumes and finishes.
  config = tiny_config(data_dir, train__num_steps=last + 3,
                       train__log_every=50, eval__every_steps=0,
                       checkpoint__every_steps=5, checkpoint__max_to_keep=2)
  state = train_loop.train_and_evaluate(config, workdir)
  assert int(state.step) == last + 3
  steps = [r["step"] for r in helpers.train_rows(workdir)]
  assert steps == sorted(set(steps)) and steps[-1] == last + 3


def test_nan_loss_stops_without_saving(tmp_path, data_dir, cache_dir,
                                       monkeypatch):
  del cache_dir
  make = pipeline.make_train_iterator

  class Poisoned:
    """Puts a NaN into the loss mask of the third batch."""

    def __init__(self, iterator):
      self.iterator = iterator
      self.count = 0

    def __iter__(self):
      return self

    def __next__(self):
      batch = next(self.iterator)
      self.count += 1
      if self.count == 3:
        batch["loss_mask"] = batch["loss_mask"].copy()
        batch["loss_mask"][0, 0] = np.nan
      return batch

    def save(self, directory):
      return self.iterator.save(directory)

    def restore(self, directory):
      self.iterator.restore(directory)

  monkeypatch.setattr(pipeline, "make_train_iterator",
                      lambda *a, **k: Poisoned(make(*a, **k)))
  workdir = str(tmp_path / "run")
  config = tiny_config(data_dir, train__num_steps=6, train__log_every=3,
                       checkpoint__every_steps=1, eval__every_steps=0,
                       train__log_update_norm=True)
  with pytest.raises(FloatingPointError,
                     match=r"loss at step 3 \(loss=nan, grad_norm=nan, "
                           r"update_norm=nan\)"):
    train_loop.train_and_evaluate(config, workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [
      "1", "2"]


def test_non_finite_error_names_the_first_bad_metric_it_logs():
  err = train_loop._non_finite_error(  # pylint: disable=protected-access
      4, {"loss": 1.0, "grad_norm": float("inf"), "lr": 0.1}, 2)
  assert "Non-finite grad_norm at step 4 (loss=1.0, grad_norm=inf)." in (
      str(err))
  assert "the latest checkpoint is step 2" in str(err)
  err = train_loop._non_finite_error(  # pylint: disable=protected-access
      5, {"loss": 1.0, "grad_norm": 2.0, "update_norm": float("nan")}, None)
  assert "Non-finite update_norm at step 5" in str(err)
  assert "no checkpoint was saved" in str(err)


# Four fake devices, one process: runs given as JSON
# [[mesh sizes {axis: size}, steps, workdir], ...] in argv[2].
_FOUR_DEVICES = """
import importlib.util
import collections
import contextlib
import json
import logging
import sys

import jax

from kda_lm.parallel import sharding
from kda_lm.train import state as state_lib
from kda_lm.train import loop as train_loop
from kda_lm.train import step as step_lib

spec = importlib.util.spec_from_file_location("tiny", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
assert jax.device_count() == 4, jax.devices()
for sizes, steps, workdir in json.loads(sys.argv[2]):
  config = module.get_config()
  config.mesh.update(sizes)
  config.train.num_steps = steps
  print("mesh", dict(sharding.make_mesh(config.mesh).shape))
  state = train_loop.train_and_evaluate(config, workdir)
  print("devices", len(state.params["embed"]["embeddings"].sharding.device_set))
"""


def _run_four_devices(config_file, runs, cache_dir):
  """Runs `[(data, fsdp, context[, expert]), steps, workdir]` on 4 fake
  devices, one process; checks each run used all of them."""
  axes = ("data", "fsdp", "context", "expert")
  runs = [(dict(zip(axes[:len(mesh)], mesh, strict=True)), steps, workdir)
          for mesh, steps, workdir in runs]
  result = subprocess.run(
      [sys.executable, "-c", _FOUR_DEVICES, config_file, json.dumps(runs)],
      cwd=process_support.REPO, capture_output=True, text=True, timeout=900,
      check=False, env=process_support.subprocess_env(
          cache_dir, "--xla_force_host_platform_device_count=4"))
  assert result.returncode == 0, result.stderr[-4000:]
  meshes = [f"{{'data': {m['data']}, 'fsdp': {m['fsdp']}, 'expert': "
            f"{m.get('expert', 1)}, 'context': {m['context']}}}"
            for m, _, _ in runs]
  assert result.stdout.split("\n")[:2 * len(runs)] == [
      line for mesh in meshes for line in (f"mesh {mesh}", "devices 4")
  ], result.stdout


def _assert_same_rows(workdir, expected, steps):
  rows = helpers.train_rows(workdir)
  assert [r["step"] for r in rows] == steps
  for row, want in zip(rows, expected, strict=True):
    for key in ("loss", "accuracy", "grad_norm"):
      np.testing.assert_allclose(row[key], want[key], rtol=2e-5,
                                 atol=1e-6, err_msg=f"{workdir} {key}")


def test_checkpoints_in_a_directory_of_their_own(tmp_path, data_dir,
                                                cache_dir):
  """`config.checkpoint.directory` holds the checkpoints while the workdir
  keeps config.json and the metrics; a resume and `load_run` find them
  there; a run pointed away from them is refused, naming both places."""
  del cache_dir
  workdir, ckpts = str(tmp_path / "run"), str(tmp_path / "store" / "ckpts")
  config = lambda steps, where: tiny_config(
      data_dir, train__num_steps=steps, eval__every_steps=0,
      checkpoint__every_steps=1, checkpoint__directory=where)
  train_loop.train_and_evaluate(config(1, ckpts), workdir)
  assert os.listdir(ckpts) == ["1"]
  assert workdir_lib.CONFIG_FILE in os.listdir(workdir)
  assert workdir_lib.CHECKPOINT_DIR not in os.listdir(workdir)
  state = train_loop.train_and_evaluate(config(2, ckpts), workdir)
  assert int(state.step) == 2 and sorted(os.listdir(ckpts)) == ["1", "2"]
  assert [r["step"] for r in helpers.train_rows(workdir)] == [1, 2]
  assert state_lib.load_run(workdir).step == 2
  other = str(tmp_path / "other")
  with pytest.raises(ValueError, match=(
      f"keeps its checkpoints in {ckpts}, but config.checkpoint.directory "
      f"now points to {other}, which holds none")):
    train_loop.train_and_evaluate(config(3, other), workdir)


def test_four_devices_match_one(tmp_path, data_dir, cache_dir):
  """A data-parallel run and an FSDP x context-parallel run (resumed onto
  another mesh) reproduce the one-device losses."""
  common = dict(train__num_steps=3, eval__every_steps=3,
                checkpoint__every_steps=2)
  one = str(tmp_path / "one")
  train_loop.train_and_evaluate(tiny_config(data_dir, **common), one)
  workdirs = [str(tmp_path / name) for name in ("four", "fsdp_context")]
  config_file = _config_file(tmp_path, data_dir, **common)
  _run_four_devices(config_file, [((4, 1, 1), 3, workdirs[0]),
                                  ((1, 2, 2), 2, workdirs[1]),
                                  ((4, 1, 1), 3, workdirs[1])], cache_dir)
  expected, expected_eval = helpers.train_rows(one), eval_losses(one)
  assert sorted(expected_eval) == [3]
  for workdir in workdirs:
    _assert_same_rows(workdir, expected, [1, 2, 3])
    np.testing.assert_allclose(eval_losses(workdir)[3], expected_eval[3],
                               rtol=2e-5, err_msg=workdir)


def test_expert_parallel_runs_match_one_device(tmp_path, data_dir,
                                               cache_dir):
  """10 steps with the routed experts split over expert=4 (steps 1-5),
  then, resumed from the step-5 checkpoint, over expert=2 x data=2 (steps
  6-10), reproduce the one-device losses and gradient norms (1e-5)."""
  common = dict(train__num_steps=10, eval__every_steps=0,
                checkpoint__every_steps=5)
  one = str(tmp_path / "one")
  train_loop.train_and_evaluate(tiny_config(data_dir, **common), one)
  workdir = str(tmp_path / "expert")
  _run_four_devices(_config_file(tmp_path, data_dir, **common),
                    [((1, 1, 1, 4), 5, workdir),
                     ((2, 1, 1, 2), 10, workdir)], cache_dir)
  rows = helpers.train_rows(workdir)
  assert [r["step"] for r in rows] == list(range(1, 11))
  for row, want in zip(rows, helpers.train_rows(one), strict=True):
    for key in ("loss", "grad_norm"):
      np.testing.assert_allclose(row[key], want[key], rtol=1e-5,
                                 err_msg=f"step {row['step']} {key}")


# ---------------------------------------------------------------------------
# Log rows of the training loop, with a stand-in run.


def test_log_rows_average_their_steps_and_leave_out_compilation(
    monkeypatch):
  """log_every = 3 over 7 steps: rows at 3, 6 and 7, each the mean of its
  steps' metrics (the first row's includes the compile step); tokens/s
  counts neither the compile step nor checkpoint time."""
  clock = helpers.Clock()
  monkeypatch.setattr(metrics, "time", clock)
  run = helpers.LoopRun(clock, num_steps=7, log_every=3, ckpt_every=3)
  final = train_loop._train_loop(run, 0)  # pylint: disable=protected-access
  assert final == 7
  assert run.checkpoints == [3, 6, 7]
  assert [step for step, _ in run.rows] == [3, 6, 7]
  tokens = 2 * 4   # Per step.
  for (step, row), steps in zip(run.rows, ((1, 2, 3), (4, 5, 6), (7,)),
                                strict=True):
    assert row["loss"] == pytest.approx(np.mean([run.loss(s)
                                                 for s in steps])), step
    assert row["accuracy"] == pytest.approx(np.mean(steps) / 10), step
    assert row["lr"] == pytest.approx(steps[-1] * 1e-3), step
    # 2 s per step after the first; the 100 s compile and the 50 s
    # checkpoints are out.
    assert row["tokens_per_s"] == pytest.approx(tokens / 2.0), (step, row)


# ---------------------------------------------------------------------------
# Faults: nothing lost, nothing silent.


def _largest_file(directory):
  files = [os.path.join(r, n) for r, _, ns in os.walk(directory) for n in ns
           if n != manifest.MANIFEST_FILE]
  return max(files, key=os.path.getsize)


def test_torn_metrics_line_resumes(tmp_path, data_dir, caplog):
  workdir = str(tmp_path / "run")
  common = dict(eval__every_steps=0, checkpoint__every_steps=2)
  train_loop.train_and_evaluate(
      tiny_config(data_dir, train__num_steps=2, **common), workdir)
  path = os.path.join(workdir, metrics.METRICS_FILE)
  with open(path, "a") as f:
    f.write('{"step": 3, "loss": 0.1')   # killed during the write
  with caplog.at_level("WARNING"):
    train_loop.train_and_evaluate(
        tiny_config(data_dir, train__num_steps=4, **common), workdir)
  assert "torn" in caplog.text and path in caplog.text
  assert [r["step"] for r in helpers.train_rows(workdir)] == [1, 2, 3, 4]


def test_changed_data_on_resume_is_refused_unless_allowed(tmp_path,
                                                          data_dir):
  common = dict(eval__every_steps=0, checkpoint__every_steps=2)
  first = str(tmp_path / "first")
  train_loop.train_and_evaluate(
      tiny_config(data_dir, train__num_steps=2, **common), first)
  same, changed = str(tmp_path / "same"), str(tmp_path / "changed")
  shutil.copytree(first, same)
  shutil.copytree(first, changed)
  train_loop.train_and_evaluate(
      tiny_config(data_dir, train__num_steps=4, **common), same)
  new_seed = tiny_config(data_dir, train__num_steps=4,
                         data__dataset_seed=1, **common)
  with pytest.raises(workdir_lib.ConfigChangedError,
                     match=r"data\.dataset_seed: 0 -> 1"):
    train_loop.train_and_evaluate(new_seed, changed)
  with open(os.path.join(changed, "config.json")) as f:
    assert json.load(f)["data"]["dataset_seed"] == 0   # not overwritten
  new_seed.train.allow_config_change = True
  train_loop.train_and_evaluate(new_seed, changed)
  before = [r["loss"] for r in helpers.train_rows(same)]
  after = [r["loss"] for r in helpers.train_rows(changed)]
  assert after[:2] == before[:2] and after[2:] != before[2:]
  with open(os.path.join(changed, "config.json")) as f:
    assert json.load(f)["data"]["dataset_seed"] == 1
  with open(os.path.join(changed, workdir_lib.HISTORY_FILE)) as f:
    history = [json.loads(line) for line in f]
  assert [h["start_step"] for h in history] == [0, 2]
  assert history[1]["changes"] == ["data.dataset_seed: 0 -> 1"]


def test_second_trainer_on_a_locked_workdir_is_refused(tmp_path, data_dir,
                                                       cache_dir):
  workdir = str(tmp_path / "run")
  config_file = _config_file(tmp_path, data_dir, train__num_steps=6,
                                  eval__every_steps=0)
  first = subprocess.Popen(
      _command(config_file, workdir), cwd=process_support.REPO,
      env=process_support.subprocess_env(cache_dir), stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True)
  lock = os.path.join(workdir, workdir_lib.LOCK_FILE)
  try:
    deadline = time.time() + 120
    while not (os.path.exists(lock) and os.path.getsize(lock)):
      assert time.time() < deadline and first.poll() is None
      time.sleep(0.05)
    first.send_signal(signal.SIGSTOP)   # alive, holding the lock
    second = subprocess.run(
        _command(config_file, workdir), cwd=process_support.REPO,
        env=process_support.subprocess_env(cache_dir), capture_output=True,
        text=True, timeout=300, check=False)
    assert second.returncode != 0
    assert f"in use by PID {first.pid}" in second.stderr
  finally:
    first.send_signal(signal.SIGCONT)
  _, stderr = first.communicate(timeout=300)
  assert first.returncode == 0, stderr[-3000:]
  assert [r["step"] for r in helpers.train_rows(workdir)] == list(range(1, 7))


def test_bit_flipped_checkpoint_falls_back_with_exact_losses(
    tmp_path, data_dir, caplog):
  common = dict(eval__every_steps=0, checkpoint__every_steps=2)
  straight = str(tmp_path / "straight")
  train_loop.train_and_evaluate(
      tiny_config(data_dir, train__num_steps=6, **common), straight)
  workdir = str(tmp_path / "run")
  train_loop.train_and_evaluate(
      tiny_config(data_dir, train__num_steps=4, **common), workdir)
  step_4 = os.path.join(workdir, "checkpoints", "4")
  with open(_largest_file(step_4), "r+b") as f:
    data = bytearray(f.read())
    for i in range(min(4096, len(data))):
      data[i] ^= 0xFF
    f.seek(0)
    f.write(bytes(data))
  with caplog.at_level("WARNING"):
    train_loop.train_and_evaluate(
        tiny_config(data_dir, train__num_steps=6, **common), workdir)
  assert "SHA-256" in caplog.text and step_4 in caplog.text
  assert ([(r["step"], r["loss"]) for r in helpers.train_rows(workdir)] ==
          [(r["step"], r["loss"]) for r in helpers.train_rows(straight)])


def test_failed_save_stops_the_run_naming_the_reason(tmp_path, data_dir,
                                                     monkeypatch):
  workdir = str(tmp_path / "run")
  real_save = manager_lib.ocp.CheckpointManager.save

  def save(self, step, *args, **kwargs):
    if step == 4:
      raise OSError(28, "No space left on device")
    return real_save(self, step, *args, **kwargs)

  monkeypatch.setattr(manager_lib.ocp.CheckpointManager, "save", save)
  config = tiny_config(data_dir, train__num_steps=6, eval__every_steps=0,
                       checkpoint__every_steps=2)
  with pytest.raises(manager_lib.CheckpointSaveError,
                     match="No space left on device") as info:
    train_loop.train_and_evaluate(config, workdir)
  assert os.path.join(workdir, "checkpoints", "4") in str(info.value)
  assert manifest.verify_manifest(
      os.path.join(workdir, "checkpoints", "2"))
  # The lock was released: the run can be resumed at once.
  monkeypatch.undo()
  state = train_loop.train_and_evaluate(config, workdir)
  assert int(state.step) == 6


def test_failed_background_save_stops_with_one_line(tmp_path, data_dir,
                                                    caplog):
  """The data item of step 4 fails in Orbax's background thread (a full
  disk): the run stops with a `CheckpointSaveError` naming the step, the
  cause and the free space; Orbax's thread traceback stays out of the log
  (`logs.quiet_library_logs`); step 2 restores."""
  workdir = str(tmp_path / "run")
  real_save = data_item.DataIteratorHandler.save

  def save(self, directory, args):
    if os.path.basename(os.path.dirname(str(directory))).startswith("4."):
      raise OSError(28, "No space left on device")
    return real_save(self, directory, args)

  logger = metrics.logging.get_absl_logger()
  before = list(logger.filters)
  logs.quiet_library_logs()
  config = tiny_config(data_dir, train__num_steps=6, eval__every_steps=0,
                       checkpoint__every_steps=2)
  try:
    with mock.patch.object(data_item.DataIteratorHandler, "save", save), (
        caplog.at_level(logging.DEBUG + 1)), pytest.raises(
            manager_lib.CheckpointSaveError,
            match=r"checkpoints/4 failed: OSError: \[Errno 28\] No space "
            r"left on device \([0-9.]+ MiB free\)"):
      train_loop.train_and_evaluate(config, workdir)
  finally:
    for f in list(logger.filters):
      if f not in before:
        logger.removeFilter(f)
  assert not [r for r in caplog.records if r.exc_info], [
      r.getMessage()[:200] for r in caplog.records if r.exc_info]
  manager = manager_lib.CheckpointManager(workdir_lib.checkpoint_dir(workdir))
  assert manager.latest_step() == 2
  manager.close()
  state = train_loop.train_and_evaluate(config, workdir)
  assert int(state.step) == 6
