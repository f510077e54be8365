"""Tests of kda_lm.parallel.distributed and of multi-process training.

The end-to-end test starts two real `train.py` processes on localhost (CPU
backend, gloo collectives, one CPU device each) and checks their losses
against one process with two fake CPU devices fed the same global batch.
"""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import helpers
import jax
import ml_collections
import numpy as np
import process_support
import pytest

from kda_lm.parallel import distributed
from kda_lm.train import metrics, preemption

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ling3_tiny shrunk to one KDA layer with a dense feed-forward, 4 x 32 tokens
# per global batch, no eval: compilation dominates on 2 CPU cores.
OVERRIDES = {
    **helpers.TINY_TRAIN_OVERRIDES,
    "model.attention_pattern": "K",
    "model.num_experts": 0,
    "train.num_steps": 10,
    "eval.every_steps": 0,
    "checkpoint.every_steps": 5,
}

# One process, two fake devices, the global batch of two processes: rows of
# process 0's data shard, then rows of process 1's (`make_train_iterator`
# shards the data by process).
_REFERENCE = """
import json, sys
import kda_lm
import jax
import numpy as np
from configs import ling3_tiny
from data import pipeline
from kda_lm.train import state as state_lib
from kda_lm.train import loop as train_loop
from kda_lm.train import step as step_lib

overrides, workdir = json.loads(sys.argv[1]), sys.argv[2]
config = ling3_tiny.get_config()
for key, value in overrides.items():
  section, name = key.split(".")
  config[section][name] = value
assert jax.device_count() == 2 and jax.process_count() == 1


def concat(batches):
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def train_iterator(data_config, **kwargs):
  shards = [make_train(data_config, process_index=i, process_count=2,
                       **kwargs) for i in range(2)]
  while True:
    yield concat([next(s) for s in shards])


class EvalBatches:
  def __init__(self, data_config, **kwargs):
    self.shards = [make_eval(data_config, process_index=i, process_count=2,
                             **kwargs) for i in range(2)]

  def __iter__(self):
    for batches in zip(*self.shards, strict=True):
      yield concat(list(batches))


make_train = pipeline.make_train_iterator
make_eval = pipeline.make_eval_iterator
pipeline.make_train_iterator, pipeline.make_eval_iterator = (
    train_iterator, EvalBatches)
train_loop.train_and_evaluate(config, workdir)
"""


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _mesh(**fields) -> ml_collections.ConfigDict:
  mesh = ml_collections.ConfigDict(dict(
      data=-1, fsdp=1, distributed=True, coordinator_address="127.0.0.1:1234",
      num_processes=2, process_id=0, coordinator_timeout_s=300))
  mesh.update(fields)
  return mesh


def _run_all(commands: list[list[str]], env: dict[str, str], logdir: str,
             timeout_s: float) -> list[str]:
  """Runs the commands at once; on a failure or timeout kills them all.

  Returns:
    Each command's output (stdout and stderr).
  """
  os.makedirs(logdir, exist_ok=True)
  logs = [os.path.join(logdir, f"process_{i}.log")
          for i in range(len(commands))]
  procs = []
  try:
    for command, log in zip(commands, logs, strict=True):
      with open(log, "w") as f:
        procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=f,
                                      stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
      failed = any(p.poll() not in (None, 0) for p in procs)
      if failed or time.monotonic() > deadline:
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for p in procs:
      p.wait()
  outputs = []
  for log in logs:
    with open(log) as f:
      outputs.append(f.read())
  for i, p in enumerate(procs):
    assert p.returncode == 0, (
        f"process {i} exited with {p.returncode} (killed after "
        f"{timeout_s} s or after another process failed):\n"
        f"{outputs[i][-3000:]}")
  return outputs


def _train_flags(workdir: str, data_dir: str) -> list[str]:
  flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  return [sys.executable, os.path.join(REPO, "train.py"),
          "--config=configs/ling3_tiny.py", f"--workdir={workdir}",
          f"--config.data.data_dir={data_dir}", *flags]


def _two_processes(workdir: str, data_dir: str, env: dict[str, str]
                   ) -> list[str]:
  address = f"127.0.0.1:{_free_port()}"
  commands = [
      _train_flags(workdir, data_dir) + [
          "--config.mesh.distributed=True",
          f"--config.mesh.coordinator_address={address}",
          "--config.mesh.num_processes=2", f"--config.mesh.process_id={i}",
          "--config.mesh.coordinator_timeout_s=60"]
      for i in range(2)]
  # About a minute on 2 idle cores; generous for a loaded machine.
  return _run_all(commands, env, workdir + "_logs", timeout_s=600)


def _assert_rows_close(rows, expected, keys):
  assert [r["step"] for r in rows] == [r["step"] for r in expected]
  for row, want in zip(rows, expected, strict=True):
    for key in keys:
      if key in want:
        np.testing.assert_allclose(row[key], want[key], rtol=1e-5,
                                   err_msg=f"{key} at step {row['step']}")


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["coordinator_address", "num_processes",
                                     "process_id"])
def test_missing_field_is_named(missing):
  with pytest.raises(ValueError,
                     match=rf"needs config\.mesh\.{missing} \(missing"):
    distributed.options(_mesh(**{missing: None}))


def test_the_first_missing_field_is_named_first():
  with pytest.raises(ValueError, match=r"needs config\.mesh\.num_processes "
                     r"\(missing: config\.mesh\.num_processes, "
                     r"config\.mesh\.process_id\)"):
    distributed.options(_mesh(num_processes=None, process_id=None))


@pytest.mark.parametrize("fields, message", [
    (dict(process_id=2), r"process_id must be in \[0, 2\).*got 2"),
    (dict(process_id=-1), r"process_id must be in \[0, 2\).*got -1"),
    (dict(num_processes=0, process_id=0), r"num_processes must be >= 1"),
    (dict(coordinator_address="localhost"), r"must be host:port"),
    (dict(process_id=3), r"process_id must be in \[0, 2\).*got 3"),
    (dict(coordinator_address=":1234"), r"must be host:port"),
    (dict(coordinator_address="localhost:port"), r"must be host:port"),
    (dict(coordinator_timeout_s=0), r"coordinator_timeout_s must be >= 1"),
    (dict(heartbeat_timeout_s=-1), r"heartbeat_timeout_s must be >= 1"),
])
def test_bad_fields(fields, message):
  with pytest.raises(ValueError, match=message):
    distributed.options(_mesh(**fields))


def test_options():
  assert distributed.options(_mesh(distributed=False)) is None
  assert distributed.options(None) is None
  assert distributed.options(_mesh(process_id=1)) == distributed.Options(
      "127.0.0.1:1234", 2, 1, 300)
  # None of the three: JAX detects the cluster.
  auto = _mesh(coordinator_address=None, num_processes=None, process_id=None)
  assert distributed.options(auto) == distributed.Options(None, None, None,
                                                          300)
  assert not distributed.initialize(_mesh(distributed=False))
  # One process alone is a job.
  assert distributed.options(_mesh(num_processes=1)) == distributed.Options(
      "127.0.0.1:1234", 1, 0, 300)
  # One second is the shortest timeout and heartbeat accepted.
  assert distributed.options(_mesh(coordinator_timeout_s=1,
                                   heartbeat_timeout_s=1)) == (
      distributed.Options("127.0.0.1:1234", 2, 0, 1, 1))


def test_process_0_checks_the_port_and_the_others_wait(monkeypatch):
  calls = []
  monkeypatch.setattr(distributed, "_backends_are_initialized", lambda: False)
  monkeypatch.setattr(distributed, "_use_gloo_on_cpu", lambda: None)
  monkeypatch.setattr(distributed, "_check_port_free",
                      lambda address: calls.append(("port", address)))
  monkeypatch.setattr(distributed, "wait_for_coordinator",
                      lambda address, s: calls.append(("wait", address, s)))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(jax.distributed, "initialize",
                      lambda **kw: calls.append(("join", kw["process_id"])))
  for process_id in (0, 1):
    assert distributed.initialize(_mesh(process_id=process_id))
  assert calls == [("port", "127.0.0.1:1234"), ("join", 0),
                   ("wait", "127.0.0.1:1234", 300), ("join", 1)]
  # Once joined, a second call joins nothing more and says it runs
  # distributed.
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  assert distributed.initialize(_mesh())
  assert len(calls) == 4


def test_a_taken_coordinator_port_is_named():
  with socket.socket() as sock:
    sock.bind(("", 0))
    sock.listen()
    port = sock.getsockname()[1]
    with pytest.raises(ValueError, match=f"cannot serve the coordinator on "
                       f"port {port} "):
      distributed._check_port_free(f"127.0.0.1:{port}")  # pylint: disable=protected-access
  distributed._check_port_free(f"127.0.0.1:{_free_port()}")  # pylint: disable=protected-access


def test_lost_peer_needs_another_process_and_a_sign_of_it(monkeypatch):
  gone = RuntimeError("Gloo: Connection reset by peer")
  monkeypatch.setattr(jax, "process_count", lambda: 1)
  assert not distributed.lost_peer(gone)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert distributed.lost_peer(gone)
  assert not distributed.lost_peer(ValueError("a bad shape"))


def test_initialize_after_backend_start_is_refused():
  jax.devices()
  with pytest.raises(RuntimeError, match="before anything else touches JAX"):
    distributed.initialize(_mesh())


def test_no_cluster_detected(monkeypatch):
  def fail(**kwargs):
    del kwargs
    raise ValueError("coordinator_address should be defined.")
  monkeypatch.setattr(distributed, "_backends_are_initialized", lambda: False)
  monkeypatch.setattr(jax.distributed, "initialize", fail)
  auto = _mesh(coordinator_address=None, num_processes=None, process_id=None)
  with pytest.raises(ValueError, match="needs a cluster JAX can detect"):
    distributed.initialize(auto)


def test_shutdown_stops_the_coordinator_last(monkeypatch):
  """The barrier, then every client leaves, then (after the grace) the
  coordinator stops; nothing at all when not distributed."""
  # pylint: disable-next=g-import-not-at-top
  from jax._src import distributed as jax_distributed
  events = []

  class Service:
    def shutdown(self):
      events.append("service")

  class State:
    service = Service()

    def shutdown(self):
      events.append(f"client (service attached: {self.service is not None})")

  monkeypatch.setattr(jax_distributed, "global_state", State())
  monkeypatch.setattr(distributed.multihost_utils, "sync_global_devices",
                      lambda name: events.append(f"barrier {name}"))
  monkeypatch.setattr(distributed.time, "sleep",
                      lambda s: events.append(f"sleep {s}"))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  distributed.shutdown()
  assert not events
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  distributed.shutdown(grace_s=0.5)
  assert events == ["barrier kda_lm: finished",
                    "client (service attached: False)", "sleep 0.5",
                    "service"]


@pytest.mark.parametrize("count,index,want", [
    (2, 0, ["body", "barrier data"]),     # The main process: body first.
    (2, 1, ["barrier data", "body"]),     # The others wait for it.
    (3, 2, ["barrier data", "body"]),
    (1, 0, ["body"]),                     # One process: no barrier.
], ids=["main", "other", "third_of_3", "single"])
def test_main_process_first_orders_body_and_barrier(monkeypatch, count,
                                                    index, want):
  events = []
  monkeypatch.setattr(jax, "process_count", lambda: count)
  monkeypatch.setattr(jax, "process_index", lambda: index)
  monkeypatch.setattr(distributed.multihost_utils, "sync_global_devices",
                      lambda name: events.append(f"barrier {name}"))
  with distributed.main_process_first("data"):
    events.append("body")
  assert events == want


def test_main_process_first_runs_the_main_body_before_the_others(
    monkeypatch):
  """Three threads stand for three processes, a `threading.Barrier` for the
  global one: the main process's body ends before any other body starts;
  the others then run theirs."""
  events, errors = [], []
  barrier = threading.Barrier(3, timeout=10)
  monkeypatch.setattr(jax, "process_count", lambda: 3)
  monkeypatch.setattr(distributed, "is_main_process",
                      lambda: threading.current_thread().name == "p0")
  monkeypatch.setattr(distributed.multihost_utils, "sync_global_devices",
                      lambda name: barrier.wait())

  def process():
    name = threading.current_thread().name
    try:
      with distributed.main_process_first("data"):
        events.append(f"{name} starts")
        time.sleep(0.2 if name == "p0" else 0.0)
        events.append(f"{name} ends")
    except Exception as e:  # pylint: disable=broad-exception-caught
      errors.append(e)

  threads = [threading.Thread(target=process, name=f"p{i}")
             for i in (2, 1, 0)]   # The others first: they must wait.
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(timeout=60)
  assert not errors, errors
  assert events[:2] == ["p0 starts", "p0 ends"], events
  assert sorted(events[2:]) == ["p1 ends", "p1 starts", "p2 ends",
                                "p2 starts"], events


def test_wait_for_coordinator_times_out():
  address = f"127.0.0.1:{_free_port()}"  # Nothing listens there.
  start = time.monotonic()
  with pytest.raises(TimeoutError, match=rf"coordinator at {address} .*did "
                     r"not answer within 1\.5 s"):
    distributed.wait_for_coordinator(address, 1.5)
  assert 1.2 < time.monotonic() - start < 10


class _FakeNetwork:
  """A clock, `time.sleep` and `socket.create_connection` for
  `wait_for_coordinator`: the clock starts at `start`; the i-th sleep
  moves it by `steps[i]` (default: the time asked); the coordinator
  accepts connections from `opens_at` on (never when None)."""

  def __init__(self, start, steps=(), opens_at=None):
    self.now, self.steps, self.opens_at = start, list(steps), opens_at
    self.attempts, self.sleeps = [], []
    self.time = types.SimpleNamespace(monotonic=lambda: self.now,
                                      sleep=self._sleep)
    self.socket = types.SimpleNamespace(create_connection=self._connect)

  def _sleep(self, seconds):
    self.sleeps.append(seconds)
    self.now += self.steps.pop(0) if self.steps else seconds

  def _connect(self, address, timeout):
    self.attempts.append((address, timeout, self.now))
    if self.opens_at is None or self.now < self.opens_at:
      raise ConnectionRefusedError(111, "Connection refused")
    return contextlib.nullcontext()


def _on_fake_network(monkeypatch, network):
  monkeypatch.setattr(distributed, "time", network.time)
  monkeypatch.setattr(distributed, "socket", network.socket)
  return network


def test_wait_for_coordinator_retries_until_the_port_opens(monkeypatch):
  """Attempts every 0.2 s, each waiting at most 1 s, to the bracketed
  IPv6 host and the integer port, until the coordinator accepts."""
  net = _on_fake_network(monkeypatch, _FakeNetwork(
      start=1000.0, steps=[0.5, 2.0], opens_at=1002.5))
  assert distributed.wait_for_coordinator("[::1]:23456", 5) is None
  assert net.attempts == [(("::1", 23456), 1.0, 1000.0),
                          (("::1", 23456), 1.0, 1000.5),
                          (("::1", 23456), 1.0, 1002.5)]
  assert all(type(port) is int for (_, port), _, _ in net.attempts)
  assert net.sleeps == [0.2, 0.2]


def test_wait_for_coordinator_gives_up_at_its_deadline(monkeypatch):
  """Each attempt waits the time left (at most 1 s, at least 0.01 s); the
  wait stops once another 0.2 s would reach the deadline, with the last
  connection error as the cause."""
  address = "".join(["10.0.0.1:", "80"])
  net = _on_fake_network(monkeypatch, _FakeNetwork(
      start=8.0, steps=[0.25, 0.25, 0.25, 0.25, 0.5]))
  with pytest.raises(TimeoutError) as info:
    distributed.wait_for_coordinator(address, 1.5)
  assert str(info.value) == (
      "The coordinator at 10.0.0.1:80 (config.mesh.coordinator_address) "
      "did not answer within 1.5 s (config.mesh.coordinator_timeout_s): "
      "[Errno 111] Connection refused. Start process 0 on that host and "
      "port, check the address, or raise the timeout.")
  assert isinstance(info.value.__cause__, ConnectionRefusedError)
  assert [(a, t, now) for a, t, now in net.attempts] == [
      (("10.0.0.1", 80), 1.0, 8.0), (("10.0.0.1", 80), 1.0, 8.25),
      (("10.0.0.1", 80), 1.0, 8.5), (("10.0.0.1", 80), 0.75, 8.75),
      (("10.0.0.1", 80), 0.5, 9.0), (("10.0.0.1", 80), 0.01, 9.5)]
  assert net.sleeps == [0.2] * 5
  # An attempt exactly 0.2 s before the deadline is the last one.
  assert 0.8 + 0.2 == 1.0
  net = _on_fake_network(monkeypatch, _FakeNetwork(start=0.0, steps=[0.8]))
  with pytest.raises(TimeoutError, match="within 1 s"):
    distributed.wait_for_coordinator("localhost:1", 1)
  assert [now for _, _, now in net.attempts] == [0.0, 0.8]


def test_wait_for_coordinator_returns_once_a_real_port_listens():
  """A port bound but not yet listening refuses connections; the wait
  returns soon after it starts listening."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    timer = threading.Timer(0.5, sock.listen)
    start = time.monotonic()
    timer.start()
    try:
      distributed.wait_for_coordinator(address, 30)
    finally:
      timer.join()
    assert 0.4 < time.monotonic() - start < 10


class _Exited(Exception):
  pass


@pytest.mark.parametrize("count,index,error,line", [
    (2, 0, RuntimeError("  Gloo: Connection reset by peer\nat op 3\n"),
     "Process 0 of 2 lost process 1 of the run (RuntimeError: Gloo: "
     "Connection reset by peer)."),
    (2, 1, ValueError("UNAVAILABLE"),
     "Process 1 of 2 lost process 0 of the run (ValueError: UNAVAILABLE)."),
    (3, 2, RuntimeError(""),
     "Process 2 of 3 lost another process of the run (RuntimeError: )."),
    (4, 0, RuntimeError("barrier " + "x" * 300),
     "Process 0 of 4 lost another process of the run (RuntimeError: "
     "barrier " + "x" * 292 + ")."),
], ids=["first_of_2", "second_of_2", "no_message", "long_message"])
def test_stop_for_lost_peer_logs_one_line_flushes_and_exits(
    monkeypatch, count, index, error, line):
  """One error line naming the lost process (of 2) and the error's first
  line (300 characters at most), the logs and streams flushed, then
  `os._exit(PEER_LOST_EXIT)` (JAX's exit handler would wait for the dead
  process)."""
  events = []
  stream = lambda name: types.SimpleNamespace(
      flush=lambda: events.append(f"flush {name}"))
  monkeypatch.setattr(jax, "process_count", lambda: count)
  monkeypatch.setattr(jax, "process_index", lambda: index)
  monkeypatch.setattr(distributed.logging, "error",
                      lambda message, *args: events.append(message % args))
  monkeypatch.setattr(distributed.logging, "flush",
                      lambda: events.append("flush log"))
  monkeypatch.setattr(distributed, "sys", types.SimpleNamespace(
      stdout=stream("stdout"), stderr=stream("stderr")))

  def exit_now(status):
    events.append(f"exit {status}")
    raise _Exited()

  monkeypatch.setattr(distributed.os, "_exit", exit_now)
  with pytest.raises(_Exited):
    distributed.stop_for_lost_peer(error)
  assert events == [
      line + " Stopping; restart every process to resume from the newest "
      "complete checkpoint.", "flush log", "flush stdout", "flush stderr",
      "exit 76"]
  assert distributed.PEER_LOST_EXIT == 76


@pytest.mark.parametrize("platforms,env,chosen", [
    (None, None, True), ("", None, True), ("cpu", None, True),
    ("tpu,cpu", None, True), ("tpu", None, False), ("cuda,tpu", None, False),
    ("cpu", "mpi", False), (None, "gloo", False), ("cpu", "", True),
])
def test_gloo_is_chosen_for_cpu_unless_the_environment_chose(
    monkeypatch, platforms, env, chosen):
  """Gloo CPU collectives when the CPU backend may run (no platform list,
  or one naming cpu) and JAX_CPU_COLLECTIVES_IMPLEMENTATION is unset or
  empty."""
  updates = []
  config = types.SimpleNamespace(
      jax_platforms=platforms,
      update=lambda name, value: updates.append((name, value)))
  monkeypatch.setattr(distributed, "jax", types.SimpleNamespace(
      config=config))
  if env is None:
    monkeypatch.delenv(distributed.CPU_COLLECTIVES_ENV, raising=False)
  else:
    monkeypatch.setenv(distributed.CPU_COLLECTIVES_ENV, env)
  distributed._use_gloo_on_cpu()  # pylint: disable=protected-access
  want = [("jax_cpu_collectives_implementation", "gloo")] if chosen else []
  assert updates == want


def test_backends_are_initialized_asks_jax(monkeypatch):
  """The answer of JAX's own check, whichever it is."""
  # pylint: disable-next=g-import-not-at-top
  from jax._src import xla_bridge
  # pylint: disable-next=protected-access
  check = distributed._backends_are_initialized
  for answer in (False, True):
    monkeypatch.setattr(xla_bridge, "backends_are_initialized",
                        lambda answer=answer: answer)
    assert check() is answer


@pytest.fixture
def no_premapped_env(monkeypatch):
  """No TPU_PREMAPPED_BUFFER_SIZE in the environment, restored after."""
  monkeypatch.delenv(distributed.PREMAPPED_SIZE_ENV, raising=False)
  return monkeypatch


def test_premapped_buffer_is_set_before_the_runtime_starts(no_premapped_env):
  """initialize() sets libtpu's buffer from config.mesh (MiB to bytes)
  before the backends start, distributed or not; 0 leaves libtpu's
  default."""
  monkeypatch = no_premapped_env
  monkeypatch.setattr(distributed, "_backends_are_initialized", lambda: False)
  mesh = ml_collections.ConfigDict({"distributed": False,
                                    "tpu_premapped_buffer_mib": 0})
  assert distributed.initialize(mesh) is False
  assert distributed.PREMAPPED_SIZE_ENV not in os.environ
  mesh.tpu_premapped_buffer_mib = 256
  assert distributed.initialize(mesh) is False
  assert os.environ[distributed.PREMAPPED_SIZE_ENV] == str(256 << 20)


def test_premapped_buffer_leaves_the_environment_and_a_started_runtime(
    no_premapped_env):
  """A value already in the environment wins; after the backends started
  the setting cannot act: the environment is unchanged, with a warning on
  a TPU (elsewhere the setting means nothing anyway)."""
  monkeypatch = no_premapped_env
  monkeypatch.setattr(distributed, "_backends_are_initialized", lambda: False)
  monkeypatch.setenv(distributed.PREMAPPED_SIZE_ENV, "1234")
  distributed.set_tpu_premapped_buffer(64)
  assert os.environ[distributed.PREMAPPED_SIZE_ENV] == "1234"
  monkeypatch.delenv(distributed.PREMAPPED_SIZE_ENV)
  monkeypatch.setattr(distributed, "_backends_are_initialized", lambda: True)
  warnings = []
  monkeypatch.setattr(distributed.logging, "warning",
                      lambda msg, *args: warnings.append(msg % args))
  for backend in ("cpu", "tpu"):
    monkeypatch.setattr(distributed.jax, "default_backend",
                        lambda backend=backend: backend)
    distributed.set_tpu_premapped_buffer(64)
    assert distributed.PREMAPPED_SIZE_ENV not in os.environ
  assert warnings == ["config.mesh.tpu_premapped_buffer_mib=64 has no "
                      "effect: the TPU runtime has already started."]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "256"])
def test_premapped_buffer_refuses_what_is_not_a_size(bad, no_premapped_env):
  with pytest.raises(ValueError, match="tpu_premapped_buffer_mib must be an "
                     "integer >= 0"):
    distributed.set_tpu_premapped_buffer(bad)
  assert distributed.PREMAPPED_SIZE_ENV not in os.environ


def test_options_are_frozen_with_a_100_s_heartbeat():
  """The fields in order, the heartbeat's default, no assignment."""
  opts = distributed.Options("h:1", 2, 1, 30)
  assert opts.heartbeat_s == 100
  assert [f.name for f in dataclasses.fields(opts)] == [
      "coordinator_address", "num_processes", "process_id", "timeout_s",
      "heartbeat_s"]
  with pytest.raises(dataclasses.FrozenInstanceError):
    opts.timeout_s = 60  # pytype: disable=attribute-error


def test_train_py_without_coordinator_fails_in_time(tmp_path):
  """A process > 0 whose coordinator never answers stops with a clear error."""
  address = f"127.0.0.1:{_free_port()}"
  command = [sys.executable, os.path.join(REPO, "train.py"),
             "--config=configs/ling3_tiny.py", f"--workdir={tmp_path}",
             "--config.mesh.distributed=True",
             f"--config.mesh.coordinator_address={address}",
             "--config.mesh.num_processes=2", "--config.mesh.process_id=1",
             "--config.mesh.coordinator_timeout_s=3"]
  start = time.monotonic()
  result = subprocess.run(command, cwd=REPO,
                          env=process_support.subprocess_env(str(tmp_path)),
                          capture_output=True, text=True, timeout=120,
                          check=False)
  assert result.returncode != 0
  assert f"TimeoutError: The coordinator at {address}" in result.stderr, (
      result.stderr[-3000:])
  assert time.monotonic() - start < 120
  assert not os.path.exists(tmp_path / "config.json")


def test_two_processes_match_one_and_resume(tmp_path, data_dir, cache_dir):
  # The single-process reference (building the module's dataset unless
  # an earlier test did; the module's compilation cache serves later runs
  # of the same programs, here and in the two-process tests below).
  reference = str(tmp_path / "reference")
  result = subprocess.run(
      [sys.executable, "-c", _REFERENCE, json.dumps(
          {**OVERRIDES, "data.data_dir": data_dir,
           "checkpoint.enabled": False}), reference],
      cwd=REPO, env=process_support.subprocess_env(
          cache_dir, "--xla_force_host_platform_device_count=2"),
      capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  expected = metrics.read_metrics(reference)
  assert [r["step"] for r in expected] == list(range(1, 11))

  env = process_support.subprocess_env(cache_dir)
  first = str(tmp_path / "first")
  logs = _two_processes(first, data_dir, env)
  for i, log in enumerate(logs):
    assert "2 devices (cpu), 2 processes" in log, log[-3000:]
    assert f"process {i} of 2" in log
  # Process 0 alone writes the metrics: one row per step.
  _assert_rows_close(metrics.read_metrics(first), expected,
                     ("loss", "accuracy", "grad_norm"))
  assert sorted(os.listdir(os.path.join(first, "checkpoints"))) == ["10", "5"]

  # A second two-process run resumes from the first one's step-5 checkpoint.
  second = str(tmp_path / "second")
  shutil.copytree(os.path.join(first, "checkpoints", "5"),
                  os.path.join(second, "checkpoints", "5"))
  logs = _two_processes(second, data_dir, env)
  for log in logs:
    assert "Resuming from the checkpoint of step 5" in log, log[-3000:]
  _assert_rows_close(metrics.read_metrics(second), expected[5:],
                     ("loss", "accuracy", "grad_norm"))


def _mesh_flags(address: str, process_id: int) -> list[str]:
  return ["--config.mesh.distributed=True",
          f"--config.mesh.coordinator_address={address}",
          "--config.mesh.num_processes=2",
          f"--config.mesh.process_id={process_id}",
          "--config.mesh.coordinator_timeout_s=60"]


def _start_two(tmp_path, workdir, data_dir, env, *flags):
  """Starts both processes of an endless run; returns (procs, log paths)."""
  address = f"127.0.0.1:{_free_port()}"
  logs = [str(tmp_path / f"process_{i}.log") for i in range(2)]
  procs = []
  for i, log in enumerate(logs):
    with open(log, "w") as f:
      procs.append(subprocess.Popen(
          _train_flags(workdir, data_dir) + _mesh_flags(address, i)
          + ["--config.train.num_steps=100000", *flags],
          cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT))
  return procs, logs


def test_sigterm_to_one_process_stops_both_at_the_same_step(
    tmp_path, data_dir, cache_dir):
  """SIGTERM to process 1 of 2: JAX's preemption sync point makes both stop
  at one step k, both save it and exit with the preemption status, and a
  rerun of both resumes from step k."""
  env = process_support.subprocess_env(cache_dir)
  workdir = str(tmp_path / "run")
  procs, logs = _start_two(tmp_path, workdir, data_dir, env)
  try:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and all(
        p.poll() is None for p in procs):
      if os.path.exists(os.path.join(workdir, metrics.METRICS_FILE)) and (
          len(metrics.read_metrics(workdir)) >= 3):
        break
      time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
    for p in procs:
      p.wait(timeout=120)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  steps = []
  for p, log in zip(procs, logs, strict=True):
    with open(log) as f:
      out = f.read()
    assert p.returncode == preemption.PREEMPTED_EXIT, out[-3000:]
    found = re.findall(r"Preempted: stopped at step (\d+)", out)
    assert found, out[-3000:]
    steps.append(int(found[-1]))
  k = steps[0]
  assert steps == [k, k] and k >= 3
  assert str(k) in os.listdir(os.path.join(workdir, "checkpoints"))
  address = f"127.0.0.1:{_free_port()}"
  commands = [_train_flags(workdir, data_dir) + _mesh_flags(address, i)
              + [f"--config.train.num_steps={k + 2}"] for i in range(2)]
  for out in _run_all(commands, env, str(tmp_path / "rerun"), 600):
    assert f"Resuming from the checkpoint of step {k}" in out, out[-3000:]


def test_a_killed_process_stops_the_other_with_one_line(
    tmp_path, data_dir, cache_dir):
  """SIGKILL to process 1 of 2 mid-run: process 0 exits with
  PEER_LOST_EXIT within 60 s (its next collective fails), naming the lost
  process in one line, with no fatal-error dump; a rerun of both resumes
  from the newest complete checkpoint."""
  env = process_support.subprocess_env(cache_dir)
  workdir = str(tmp_path / "run")
  procs, logs = _start_two(tmp_path, workdir, data_dir, env,
                          "--config.mesh.heartbeat_timeout_s=30")
  try:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and all(
        p.poll() is None for p in procs):
      if os.path.isdir(os.path.join(workdir, "checkpoints", "5")):
        break
      time.sleep(0.1)
    procs[1].kill()
    killed = time.monotonic()
    procs[0].wait(timeout=120)
    took = time.monotonic() - killed
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  with open(logs[0]) as f:
    out = f.read()
  assert procs[0].returncode == distributed.PEER_LOST_EXIT, out[-3000:]
  assert took < 60, (took, out[-3000:])
  assert "Process 0 of 2 lost process 1 of the run" in out, out[-3000:]
  assert "Fatal Python error" not in out and "Check failure" not in out
  address = f"127.0.0.1:{_free_port()}"
  commands = [_train_flags(workdir, data_dir) + _mesh_flags(address, i)
              for i in range(2)]
  for out in _run_all(commands, env, str(tmp_path / "rerun"), 600):
    assert "Resuming from the checkpoint of step" in out, out[-3000:]


# Two processes restore steps [1, 2] of a checkpoint whose step 2 has a
# changed file in process 1's share: each hashes its share of the files,
# both fall back to step 1. Prints the files it hashed, as JSON.
_SHARED_VERIFY = """
import json, os, sys
from typing import Any, NamedTuple
import kda_lm
import jax
address, index, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(address, num_processes=2, process_id=index,
                           initialization_timeout=60)
import numpy as np
from jax.experimental import multihost_utils
from kda_lm.checkpoint import manager as manager_lib, manifest, paths


class State(NamedTuple):
  params: Any
  step: Any


mesh = jax.make_mesh((2,), ("data",))
spec = jax.sharding.PartitionSpec
split = jax.sharding.NamedSharding(mesh, spec("data"))
whole = jax.sharding.NamedSharding(mesh, spec())


def state(step):
  w = np.arange(64, dtype=np.float32) + step
  return State({"w": jax.make_array_from_callback((64,), split,
                                                   lambda i: w[i])},
               jax.make_array_from_callback((), whole,
                                            lambda i: np.int32(step)))


manager = manager_lib.CheckpointManager(directory, async_save=False)
for step in (1, 2):
  manager.save(step, state(step))
manager.close()
multihost_utils.sync_global_devices("saved")
step_dir = os.path.join(directory, "2")
files = sorted(rel for rel, _ in paths.files(step_dir)
               if rel != manifest.MANIFEST_FILE)
if index == 0:   # The last file of process 1's share: one byte changed.
  target = files[1::2][-1]
  with open(os.path.join(step_dir, target), "r+b") as f:
    byte = f.read(1)
    f.seek(0)
    f.write(bytes([byte[0] ^ 1]))
multihost_utils.sync_global_devices("corrupted")
hashed, sha256 = [], manifest._sha256
manifest._sha256 = lambda path: hashed.append(str(path)) or sha256(path)
manager = manager_lib.CheckpointManager(directory)
restored = manager.restore(State(
    {"w": jax.ShapeDtypeStruct((64,), np.float32, sharding=split)},
    jax.ShapeDtypeStruct((), np.int32, sharding=whole)))
manager.close()
print(json.dumps({"step": int(restored.step.addressable_data(0)),
                  "files": files, "hashed": [
                      os.path.relpath(p, step_dir) for p in hashed
                      if p.startswith(step_dir + os.sep)]}))
jax.distributed.shutdown()
"""


def test_two_processes_share_the_verification_and_fall_back(tmp_path):
  """Each process hashes half of step 2's files (every file once in all);
  process 1 finds the changed one and names it, process 0 names process 1,
  and both restore step 1."""
  address = f"127.0.0.1:{_free_port()}"
  directory = str(tmp_path / "ckpt")
  commands = [[sys.executable, "-c", _SHARED_VERIFY, address, str(i),
               directory] for i in range(2)]
  # About 20 s on 2 loaded cores; a process that skips the agreement
  # leaves the other waiting in a collective until the timeout.
  outputs = _run_all(commands, process_support.subprocess_env(),
                     str(tmp_path / "logs"), timeout_s=120)
  results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
  assert [r["step"] for r in results] == [1, 1], outputs
  files = results[0]["files"]
  assert [r["hashed"] for r in results] == [files[0::2], files[1::2]]
  assert re.search(r"/2: it is unreadable or damaged \(CorruptCheckpointError"
                   r": state/\S+ does not match its SHA-256", outputs[1]), (
                       outputs[1][-3000:])
  assert ("(CorruptCheckpointError: process 1 of 2 found a corrupt file "
          "(its log names it))") in outputs[0], outputs[0][-3000:]
  assert [n for n in os.listdir(directory) if n.startswith("unreadable-2-")]
