"""Tests of kda_lm/train/preemption.py and the loop's preemption path:
SIGTERM saves the current step and exits with the preemption status, and
the resumed run continues bit for bit; time-based checkpoints."""

import os
import signal
import subprocess
import threading
import time

from absl import logging
import helpers
import numpy as np
import process_support
import pytest

from kda_lm.checkpoint import manager as manager_lib
from kda_lm.checkpoint import workdir as workdir_lib
from kda_lm.train import loop as train_loop
from kda_lm.train import metrics, preemption

pytestmark = pytest.mark.usefixtures("fast_compile")


def test_first_signal_sets_the_flag_and_a_second_is_only_logged(caplog):
  before = signal.getsignal(signal.SIGTERM)
  caplog.set_level(logging.WARNING)
  with preemption.Preemption(multi_process=False) as stop:
    assert not stop.reached(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.reached(2) and stop.signal_name == "SIGTERM"
    os.kill(os.getpid(), signal.SIGINT)       # No KeyboardInterrupt.
    assert stop.signal_name == "SIGTERM"
  assert signal.getsignal(signal.SIGTERM) is before
  text = caplog.text
  assert "Received SIGTERM: stopping after the current step" in text
  assert "Received SIGINT again while stopping" in text


def test_several_processes_leave_sigterm_to_jax():
  """JAX's preemption notifier owns SIGTERM when several processes run (and
  SIGINT keeps its default: one process must not stop alone)."""
  before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
  with preemption.Preemption(multi_process=True) as stop:
    assert [signal.getsignal(s)
            for s in (signal.SIGTERM, signal.SIGINT)] == before
    assert not stop.reached(1)   # No coordination service: never synced.


def test_save_clock_fires_every_interval():
  now = [100.0]
  clock = preemption.SaveClock(30.0, clock=lambda: now[0])
  fired = []
  for t in range(0, 100, 5):
    now[0] = 100.0 + t
    if clock.due():
      fired.append(t)
      clock.saved()
  assert fired == [30, 60, 90]
  assert not preemption.SaveClock(None).due()


def test_the_loop_saves_the_signalled_step_synchronously_and_stops(
    monkeypatch):
  """A signal seen after step 5 of 20: step 5's row is logged, its
  checkpoint written synchronously, no later step runs, and step 5 is not
  evaluated (the grace period goes to the save), although the loop treats
  it as the last step and evaluates every 4 steps and at the last."""
  clock = helpers.Clock()  # pylint: disable=protected-access
  monkeypatch.setattr(metrics, "time", clock)
  run = helpers.LoopRun(clock, num_steps=20, log_every=4,  # pylint: disable=protected-access
                           ckpt_every=4)
  run.cfg.eval.every_steps, run.eval_batches, evaluated = 4, [], []
  run.evaluate = lambda step, state: evaluated.append(step) or False
  monkeypatch.setattr(run.preemption, "reached", lambda step: step == 5)
  with pytest.raises(preemption.Preempted, match="stopped at step 5"):
    train_loop._train_loop(run, 0)  # pylint: disable=protected-access
  assert run.checkpoints == [4, (5, "wait")]
  assert [step for step, _ in run.rows] == [4, 5]
  assert evaluated == [4]


def test_time_based_checkpoints_fire_at_log_steps(monkeypatch):
  """every_seconds = 5 with 2 s per step, checked at every log step (2):
  saves at steps 4, 8, ... besides every_steps (100) and the last step."""
  clock = helpers.Clock()  # pylint: disable=protected-access
  monkeypatch.setattr(metrics, "time", clock)
  run = helpers.LoopRun(clock, num_steps=13, log_every=2,  # pylint: disable=protected-access
                           ckpt_every=100)
  run.save_clock = preemption.SaveClock(5.0, clock=lambda: clock.now)
  train_loop._train_loop(run, 0)  # pylint: disable=protected-access
  # Step 1 takes 100 s (compilation): due at step 2, then every 3rd log.
  assert run.checkpoints == [2, 6, 10, 13]


def _wait_for_rows(workdir, proc, n, timeout=240):
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    try:
      if len(helpers.train_rows(workdir)) >= n:
        return
    except (FileNotFoundError, ValueError):
      pass
    time.sleep(0.05)
  raise AssertionError(f"no {n} metric rows before the deadline or exit "
                       f"(status {proc.poll()})")


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_saves_the_step_and_resumes_bit_for_bit(
    tmp_path, data_dir, cache_dir, signals):  # noqa: F811
  """SIGTERM (once, or again during the save) at some step k: status 75, a
  checkpoint of step k, and the resumed run's losses after k equal an
  uninterrupted run's."""
  n = 60
  common = dict(train__num_steps=n, train__log_every=1, eval__every_steps=0,
                checkpoint__every_steps=1000)
  workdir = str(tmp_path / "run")
  proc = subprocess.Popen(
      helpers.train_command(
          helpers.write_config_file(tmp_path, data_dir, **common), workdir),
      cwd=process_support.REPO, env=process_support.subprocess_env(cache_dir),
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    _wait_for_rows(workdir, proc, 3)
    proc.send_signal(signal.SIGTERM)
    if signals == 2:
      time.sleep(0.05)
      proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == preemption.PREEMPTED_EXIT, stderr[-3000:]
  manager = manager_lib.CheckpointManager(workdir_lib.checkpoint_dir(workdir))
  k = manager.latest_step()
  manager.close()
  assert 3 <= k < n
  assert f"Preempted: stopped at step {k} and saved its checkpoint" in stderr
  assert [r["step"] for r in helpers.train_rows(workdir)][-1] == k
  train_loop.train_and_evaluate(helpers.tiny_train_config(data_dir, **common),
                                workdir)
  straight = str(tmp_path / "straight")
  train_loop.train_and_evaluate(helpers.tiny_train_config(data_dir, **common),
                                straight)
  want = {r["step"]: r["loss"] for r in helpers.train_rows(straight)}
  got = {r["step"]: r["loss"] for r in helpers.train_rows(workdir)}
  assert sorted(got) == list(range(1, n + 1))
  np.testing.assert_array_equal([got[s] for s in range(1, n + 1)],
                                [want[s] for s in range(1, n + 1)])


def test_save_clock_measures_the_interval_from_the_last_save():
  """Due `every_seconds` after the last save, whatever the clock's origin
  (a clock started at 10 s is due at 40 s)."""
  now = [10.0]
  clock = preemption.SaveClock(30.0, clock=lambda: now[0])
  now[0] = 39.0
  assert not clock.due()
  now[0] = 40.0
  assert clock.due()
  clock.saved()
  now[0] = 69.0
  assert not clock.due()


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_several_processes_take_process_0s_answer(monkeypatch, processes):
  """With several processes the clock's answer and the stopping step come
  from the collectives (process 0's clock; JAX's preemption sync point),
  which a single process never calls."""
  calls = []
  monkeypatch.setattr(preemption.jax, "process_count", lambda: processes)

  def broadcast(x):
    calls.append("broadcast")
    return np.logical_not(x)        # Process 0's clock disagrees.

  def sync_point(step):
    calls.append("sync")
    return step == 3

  monkeypatch.setattr(preemption.multihost_utils, "broadcast_one_to_all",
                      broadcast)
  monkeypatch.setattr(preemption.multihost_utils,
                      "reached_preemption_sync_point", sync_point)
  several = processes > 1
  now = [0.0]
  clock = preemption.SaveClock(30.0, clock=lambda: now[0])
  now[0] = 31.0
  assert clock.due() == (not several)
  stop = preemption.Preemption()
  assert stop.multi_process == several
  assert [stop.reached(step) for step in (2, 3)] == (
      [False, True] if several else [False, False])
  assert stop.signal_name == ("SIGTERM" if several else None)
  assert calls == (["broadcast", "sync", "sync"] if several else [])


def test_preemption_outside_the_main_thread_leaves_signals_alone():
  """Python refuses signal handlers outside the main thread; the loop run
  from a thread (a notebook's worker) still works, without them."""
  before = signal.getsignal(signal.SIGTERM)
  errors, flags = [], []

  def run():
    try:
      with preemption.Preemption(multi_process=False) as stop:
        flags.append(stop.reached(1))
    except Exception as e:  # pylint: disable=broad-exception-caught
      errors.append(e)

  thread = threading.Thread(target=run)
  thread.start()
  thread.join()
  assert not errors and flags == [False]
  assert signal.getsignal(signal.SIGTERM) is before


def test_the_preempted_exit_status_is_ex_tempfail():
  """Schedulers and wrappers retry on "try again later": the documented
  status is 75 (`os.EX_TEMPFAIL`), not any number the loop agrees on."""
  assert preemption.PREEMPTED_EXIT == os.EX_TEMPFAIL == 75
