r"""Multi-process start-up: `jax.distributed.initialize` from `config.mesh`.

Several processes (one per host, or several on one machine) train one model
when each runs the same command with `config.mesh.distributed=True` and its
own `process_id`:

  python train.py --config=configs/ling3_tiny.py \
      --config.mesh.distributed=True \
      --config.mesh.coordinator_address=10.0.0.1:23456 \
      --config.mesh.num_processes=2 --config.mesh.process_id=0   # on host 0
  ... --config.mesh.process_id=1                                 # on host 1

`initialize(config.mesh)` must run before anything touches a JAX backend
(`jax.devices()`, any computation, `jax.default_backend()`), so `train.py`
calls it first thing. It checks the `mesh` fields (all three of
`coordinator_address`, `num_processes`, `process_id`, or none of them to let
JAX detect a cluster such as a Cloud TPU pod or SLURM), selects gloo for CPU
collectives unless `JAX_CPU_COLLECTIVES_IMPLEMENTATION` chooses otherwise,
and turns a coordinator that does not answer within
`coordinator_timeout_s` into a clear `TimeoutError` instead of a hang. (Once
connected, JAX itself enforces the timeout: a process that never arrives makes
the others abort with `DEADLINE_EXCEEDED` after `coordinator_timeout_s`.)

After a run, `train.py` calls `shutdown()` so that every process leaves
together and process 0 stops the coordinator last (see `shutdown`).
"""

import contextlib
import dataclasses
import os
import socket
import sys
import time

from absl import logging
import jax
from jax.experimental import multihost_utils
import ml_collections

_ADDRESS_KEYS = ("coordinator_address", "num_processes", "process_id")
# Seconds process 0 waits, after every process has passed the shutdown
# barrier, before it stops the coordinator (see `shutdown`).
COORDINATOR_GRACE_S = 2.0
# Exit status of a process that stopped because another process died.
PEER_LOST_EXIT = 76
# Words of the errors a collective or the coordination service raises when
# another process of the job is gone.
_LOST_PEER_SIGNS = ("Gloo", "Connection reset", "heartbeat", "unhealthy",
                    "UNAVAILABLE", "barrier")
CPU_COLLECTIVES_ENV = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"
# libtpu's pinned host buffer for transfers (`set_tpu_premapped_buffer`).
PREMAPPED_SIZE_ENV = "TPU_PREMAPPED_BUFFER_SIZE"


@dataclasses.dataclass(frozen=True)
class Options:
  """Validated `jax.distributed.initialize` arguments.

  Attributes:
    coordinator_address: `host:port` of process 0's coordinator; None (with
      the next two None) lets JAX detect the cluster.
    num_processes: processes in the job.
    process_id: this process, in [0, num_processes).
    timeout_s: seconds to wait for every process to reach the coordinator.
    heartbeat_s: seconds without a heartbeat before a process counts as
      dead.
  """
  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None
  timeout_s: int
  heartbeat_s: int = 100


def options(mesh_config: ml_collections.ConfigDict) -> Options | None:
  """Validates the distributed fields of `config.mesh`.

  Args:
    mesh_config: `config.mesh` (None: not distributed).

  Returns:
    The options, or None when `mesh_config.distributed` is False.

  Raises:
    ValueError: only some of `coordinator_address`, `num_processes`,
      `process_id` are set, an address without a port, `num_processes < 1`,
      a `process_id` outside [0, num_processes), or a timeout < 1 s.
  """
  if not mesh_config or not mesh_config.get("distributed"):
    return None
  values = {key: mesh_config.get(key) for key in _ADDRESS_KEYS}
  missing = [key for key, value in values.items() if value is None]
  if missing and len(missing) < len(_ADDRESS_KEYS):
    raise ValueError(
        f"config.mesh.distributed=True needs config.mesh.{missing[0]} "
        f"(missing: {', '.join('config.mesh.' + k for k in missing)}); set "
        f"all of {list(_ADDRESS_KEYS)}, or none of them to detect a "
        f"cluster (Cloud TPU, SLURM, Open MPI).")
  timeout = int(mesh_config.get("coordinator_timeout_s") or 0)
  if timeout < 1:
    raise ValueError(f"config.mesh.coordinator_timeout_s must be >= 1 s, "
                     f"got {mesh_config.get('coordinator_timeout_s')}.")
  heartbeat = int(mesh_config.get("heartbeat_timeout_s") or 100)
  if heartbeat < 1:
    raise ValueError(f"config.mesh.heartbeat_timeout_s must be >= 1 s, "
                     f"got {mesh_config.get('heartbeat_timeout_s')}.")
  if missing:
    return Options(None, None, None, timeout, heartbeat)
  address = str(values["coordinator_address"])
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"config.mesh.coordinator_address must be host:port "
                     f"(process 0's host), got {address!r}.")
  num, pid = int(values["num_processes"]), int(values["process_id"])
  if num < 1:
    raise ValueError(f"config.mesh.num_processes must be >= 1, got {num}.")
  if not 0 <= pid < num:
    raise ValueError(f"config.mesh.process_id must be in [0, {num}) "
                     f"(config.mesh.num_processes={num}), got {pid}.")
  return Options(address, num, pid, timeout, heartbeat)


def _use_gloo_on_cpu() -> None:
  """Gloo CPU collectives, unless the environment chose an implementation."""
  platforms = jax.config.jax_platforms or ""
  if platforms and "cpu" not in platforms.split(","):
    return
  if os.environ.get(CPU_COLLECTIVES_ENV):
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")


def wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Waits until `address` (host:port) accepts TCP connections.

  JAX aborts the whole process, with no Python exception, when its client
  cannot register with the coordinator in time; this check turns the common
  case (process 0 is not running, or the address is wrong) into an error.

  Args:
    address: the coordinator's `host:port`.
    timeout_s: seconds to keep trying.

  Raises:
    TimeoutError: nothing accepted a connection within `timeout_s`.
  """
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  deadline = time.monotonic() + timeout_s
  while True:
    left = deadline - time.monotonic()
    try:
      with socket.create_connection((host, int(port)),
                                    timeout=max(min(left, 1.0), 0.01)):
        return
    except OSError as e:
      if time.monotonic() + 0.2 >= deadline:
        raise TimeoutError(
            f"The coordinator at {address} (config.mesh.coordinator_address) "
            f"did not answer within {timeout_s:g} s "
            f"(config.mesh.coordinator_timeout_s): {e}. Start process 0 on "
            f"that host and port, check the address, or raise the "
            f"timeout.") from e
      time.sleep(0.2)


def _check_port_free(address: str) -> None:
  """Process 0 binds the coordinator's port: fail early if it is taken."""
  port = int(address.rpartition(":")[2])
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    try:
      sock.bind(("", port))
    except OSError as e:
      raise ValueError(
          f"Process 0 cannot serve the coordinator on port {port} "
          f"(config.mesh.coordinator_address={address}): {e}. Pick a free "
          f"port.") from e


def _backends_are_initialized() -> bool:
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  return xla_bridge.backends_are_initialized()


def set_tpu_premapped_buffer(mib: int) -> None:
  """Asks the TPU runtime, before it starts, to pin `mib` MiB of host
  memory for transfers instead of its default (4 GiB on a v5e, seconds of
  every start-up without transparent huge pages). Transfers larger than
  the buffer stay exact but slow: a 1 GiB array moved 7-28x slower with
  256 MiB on a v5e. Nothing when `mib` is 0, when
  `TPU_PREMAPPED_BUFFER_SIZE` is already set (the environment wins), or on
  other backends (the variable is libtpu's); a warning when the TPU
  runtime has already started.

  Raises:
    ValueError: `mib` is not an integer >= 0.
  """
  if isinstance(mib, bool) or not isinstance(mib, int) or mib < 0:
    raise ValueError("config.mesh.tpu_premapped_buffer_mib must be an "
                     f"integer >= 0 (0: libtpu's default), got {mib!r}.")
  if mib == 0 or PREMAPPED_SIZE_ENV in os.environ:
    return
  if _backends_are_initialized():
    if jax.default_backend() == "tpu":
      logging.warning("config.mesh.tpu_premapped_buffer_mib=%d has no "
                      "effect: the TPU runtime has already started.", mib)
    return
  os.environ[PREMAPPED_SIZE_ENV] = str(mib << 20)


def initialize(mesh_config: ml_collections.ConfigDict) -> bool:
  """Joins the job that `config.mesh` describes (once per process), after
  setting the TPU runtime's transfer buffer (`set_tpu_premapped_buffer`).

  Args:
    mesh_config: `config.mesh`.

  Returns:
    Whether this process runs distributed (False: `distributed` is off).

  Raises:
    ValueError: bad `config.mesh` fields (see `options`), no cluster
      detected when the three address fields are unset, or (process 0) the
      coordinator's port is taken.
    RuntimeError: a JAX backend was initialised before this call.
    TimeoutError: (processes other than 0) the coordinator did not accept a
      connection within `config.mesh.coordinator_timeout_s`.
  """
  if mesh_config is not None:
    set_tpu_premapped_buffer(mesh_config.get("tpu_premapped_buffer_mib", 0))
  opts = options(mesh_config)
  if opts is None:
    return False
  if jax.distributed.is_initialized():
    return True
  if _backends_are_initialized():
    raise RuntimeError(
        "config.mesh.distributed=True, but a JAX backend was already "
        "initialised (by jax.devices(), a computation or "
        "jax.default_backend()): call kda_lm.parallel.distributed.initialize("
        "config.mesh) before anything else touches JAX, as train.py does.")
  _use_gloo_on_cpu()
  if opts.coordinator_address is not None:
    if opts.process_id == 0:
      _check_port_free(opts.coordinator_address)
    else:
      wait_for_coordinator(opts.coordinator_address, opts.timeout_s)
  logging.info(
      "jax.distributed.initialize: process %s of %s, coordinator %s; "
      "waiting up to %d s for every process (JAX aborts the process with "
      "DEADLINE_EXCEEDED if one never arrives).", opts.process_id,
      opts.num_processes, opts.coordinator_address, opts.timeout_s)
  try:
    jax.distributed.initialize(
        coordinator_address=opts.coordinator_address,
        num_processes=opts.num_processes, process_id=opts.process_id,
        initialization_timeout=opts.timeout_s,
        heartbeat_timeout_seconds=opts.heartbeat_s)
  except ValueError as e:
    if opts.coordinator_address is not None:
      raise
    raise ValueError(
        f"config.mesh.distributed=True without {list(_ADDRESS_KEYS)} needs "
        f"a cluster JAX can detect, and none was found ({e}); set the three "
        f"config.mesh fields.") from e
  return True


def is_main_process() -> bool:
  """True on process 0, the one that writes config, metrics and progress."""
  return jax.process_index() == 0


@contextlib.contextmanager
def main_process_first(name: str):
  """Runs the body on process 0 first, then on the others.

  For work that must happen once on a shared file system, such as building
  a TFDS dataset: the other processes then find it done instead of racing to
  write it. A barrier that every process must reach.

  Args:
    name: the barrier's name, the same on every process.

  Yields:
    Nothing.
  """
  if jax.process_count() == 1:
    yield
    return
  if not is_main_process():
    multihost_utils.sync_global_devices(name)
  yield
  if is_main_process():
    multihost_utils.sync_global_devices(name)


def shutdown(grace_s: float = COORDINATOR_GRACE_S) -> None:
  """Leaves the job in order; every process calls it after its last step.

  `jax.distributed.shutdown` (which JAX also runs at exit) disconnects this
  process's client, a barrier over all processes, and on process 0 then
  stops the coordinator's gRPC server at once. The other processes are still
  tearing down their own connections at that moment, and a request that
  arrives while the server is destroyed can abort process 0 inside gRPC
  (`Check failed: queue.Pop() == nullptr`) after a run that succeeded. Here
  every process first meets at a barrier (so no checkpoint or metric work is
  in flight anywhere), the clients disconnect, and process 0 waits `grace_s`
  before it stops the coordinator. Does nothing when not distributed.

  Args:
    grace_s: seconds process 0 waits between its client's disconnect and
      stopping the coordinator.
  """
  if not jax.distributed.is_initialized():
    return
  # pylint: disable-next=g-import-not-at-top
  from jax._src import distributed as jax_distributed
  multihost_utils.sync_global_devices("kda_lm: finished")
  state = jax_distributed.global_state
  service, state.service = state.service, None
  jax.distributed.shutdown()  # The shutdown barrier; this client leaves.
  if service is not None:
    logging.info("Stopping the coordinator in %.1f s, once every process "
                 "has disconnected.", grace_s)
    time.sleep(grace_s)
    service.shutdown()


def lost_peer(error: BaseException) -> bool:
  """Whether `error` says that another process of the job is gone."""
  return jax.process_count() > 1 and any(
      sign in str(error) for sign in _LOST_PEER_SIGNS)


def stop_for_lost_peer(error: BaseException) -> None:
  """Logs one line and exits with `PEER_LOST_EXIT` at once.

  `os._exit` skips JAX's exit handler, whose shutdown barrier would wait
  for the dead process until the heartbeat timeout and then abort with a
  fatal-error dump.
  """
  index, count = jax.process_index(), jax.process_count()
  peer = f"process {1 - index}" if count == 2 else "another process"
  first = (str(error).strip().splitlines() or [""])[0][:300]
  logging.error(
      "Process %d of %d lost %s of the run (%s: %s). Stopping; restart "
      "every process to resume from the newest complete checkpoint.",
      index, count, peer, type(error).__name__, first)
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(PEER_LOST_EXIT)  # pylint: disable=protected-access
