"""The run directory: one trainer at a time, and an honest config record.

A workdir holds one run: its checkpoints, `metrics.jsonl`, `config.json` (the
config the run is training with now) and `config_history.jsonl` (every config
the run has been started with, and the step it started from). This module
owns the rules that keep that record true:

* `WorkdirLock`: a second trainer on a workdir held by a live process is
  refused at once, naming the holder (PID, host, start time). The lock is an
  OS file lock (`fcntl.flock`) on `<workdir>/lock`, so it dies with its
  process; a clean exit (or an error) deletes the file, and a lock file
  left by a process that died is taken over with a
  warning that names that process.
* `meaning_changes`: on resume, the config keys that change what the saved
  state means (the model's shape, the data set and its stream) are compared
  with the checkpoint's; safe keys (learning-rate schedule values, intervals,
  kernel choice) may change freely and are logged.
"""

import dataclasses
import datetime
import fcntl
import json
import os
import socket
from typing import Any, Iterable, Mapping, Optional

from absl import logging

from data import pipeline
from kda_lm import config as config_lib
from kda_lm.checkpoint import paths

LOCK_FILE = "lock"
CONFIG_FILE = "config.json"
HISTORY_FILE = "config_history.jsonl"
CHECKPOINT_DIR = "checkpoints"

# Config keys (dotted, or whole sections ending in ".") that change what a
# checkpoint means. A resume that changes one is refused unless
# `config.train.allow_config_change` is set, in which case the data iterator
# starts a fresh stream under the new settings.
MEANING_KEYS = ("model.", "data.")
# Keys inside those sections that may change on resume without changing the
# meaning of the saved state (where the data and tokenizer live, kernel
# choice and settings, the activations' dtype; skipping bad records, so that
# a run stopped by one resumes past it). A tokenizer is identified by its
# checksum, `data.tokenizer_sha256`, a meaning key: another file, or a
# rebuilt one, is refused.
SAFE_KEYS = ("data.data_dir", "data.tokenizer_path", "data.skip_bad_records",
             "model.kda_impl", "model.moe_impl",
             "model.kda_chunk_size", "model.kda_kernel.",
             "model.compute_dtype")


class WorkdirLockedError(RuntimeError):
  """Another live process trains in this workdir."""


class ConfigChangedError(ValueError):
  """A resume would silently change what the checkpoint means."""


def _now() -> str:
  return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _holder() -> dict[str, Any]:
  return {"pid": os.getpid(), "host": socket.gethostname(), "since": _now()}


def _describe(info: Mapping[str, Any]) -> str:
  return (f"PID {info.get('pid', '?')} on host {info.get('host', '?')}, "
          f"started {info.get('since', '?')}")


def _read_holder(fd: int) -> dict[str, Any] | None:
  os.lseek(fd, 0, os.SEEK_SET)
  text = os.read(fd, 4096).decode("utf-8", "replace").strip()
  if not text:
    return None
  try:
    info = json.loads(text)
  except json.JSONDecodeError:
    return {"pid": "?", "host": "?", "since": f"unreadable lock {text!r}"}
  return info if isinstance(info, dict) else None


class WorkdirLock:
  """An exclusive lock on a workdir, held while training.

  Usage:

    with workdir.WorkdirLock(path):
      ...   # train

  Raises `WorkdirLockedError` on entry when a live process holds the lock.
  """

  def __init__(self, directory: str):
    self.path = os.path.join(directory, LOCK_FILE)
    self._fd: int | None = None

  def acquire(self) -> "WorkdirLock":
    """Takes the lock (see the class docstring).

    Returns:
      self.

    Raises:
      WorkdirLockedError: a live process holds the lock; the message names
        its PID, host and start time.
    """
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = self._locked_fd()
    stale = _read_holder(fd)
    if stale is not None:
      logging.warning(
          "Taking over the lock %s left by %s, which is no longer running "
          "(it stopped without releasing it).", self.path, _describe(stale))
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(_holder()).encode())
    os.fsync(fd)
    self._fd = fd
    return self

  def _locked_fd(self) -> int:
    """An open, exclusively locked descriptor of the lock file that is the
    one at `path` (a releasing holder deletes its file while it still
    holds it: a lock taken on that deleted file is dropped and taken
    again on the new one)."""
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _read_holder(fd) or {}
        os.close(fd)
        raise WorkdirLockedError(
            f"The workdir {os.path.dirname(self.path)} is in use by "
            f"{_describe(holder)} (lock file {self.path}). Wait for it to "
            "finish or stop it, or use another --workdir.") from None
      try:
        if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
          return fd
      except FileNotFoundError:
        pass
      os.close(fd)

  def release(self) -> None:
    """Deletes the lock file (a clean exit leaves none) and unlocks it."""
    if self._fd is None:
      return
    os.ftruncate(self._fd, 0)
    try:
      os.unlink(self.path)
    except FileNotFoundError:
      pass
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """`{"a": {"b": 1}}` -> `{"a.b": 1}` (lists and scalars are leaves)."""
  out = {}
  for key, value in config.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(flatten(value, name + "."))
    else:
      out[name] = value
  return out


def default_keys() -> dict[str, Any]:
  """Every key of the typed config sections at its default, flattened
  ("model.num_experts"), with JSON values as a run's recorded config holds
  them: `config_changes`' `defaults`."""
  out = {}
  for name, cls in config_lib.SECTIONS.items():
    out.update(flatten(json.loads(config_lib.config_dict(
        cls).to_json_best_effort()), name + "."))
  return out


def with_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
  """A recorded config (nested dicts) with the typed sections' keys it
  lacks, added to kda-lm after it was written, at their defaults: what
  the run was trained with. A copy; present keys are kept as recorded."""
  out = json.loads(json.dumps(config, default=str))
  for key, value in default_keys().items():
    *path, leaf = key.split(".")
    node = out
    for part in path:
      node = node.setdefault(part, {})
      if not isinstance(node, dict):
        break
    else:
      node.setdefault(leaf, value)
  return out


def _is_meaning_key(key: str) -> bool:
  if key in SAFE_KEYS:
    return False
  return any(key.startswith(k) if k.endswith(".") else key == k
             for k in MEANING_KEYS)


@dataclasses.dataclass(frozen=True)
class Change:
  """One config key that differs between a checkpoint and this run."""
  key: str
  saved: Any
  given: Any

  def __str__(self) -> str:
    return f"{self.key}: {self.saved!r} -> {self.given!r}"


def config_changes(saved: Mapping[str, Any], given: Mapping[str, Any],
                   defaults: Mapping[str, Any] = None
                   ) -> tuple[list[Change], list[Change]]:
  """Splits the differences between two configs by what they change.

  Args:
    saved: the config a checkpoint was trained with (nested dicts).
    given: this run's config (nested dicts).
    defaults: flattened default values of keys (`flatten`, JSON values): a
      key the saved config lacks (added to kda-lm after the checkpoint was
      written) is no change when this run leaves it at its default, which
      is what the checkpoint was trained with.

  Returns:
    `(meaning, safe)`: changes of keys that change what the saved state means
    (model shape, data set, data stream: the keys of config.data that
    either run's dataset reads), and all other changes.
  """
  old, new = flatten(saved), flatten(given)
  defaults = defaults or {}
  added = {k for k in set(new) - set(old)
           if k in defaults and new[k] == defaults[k]}
  changes = [Change(k, old.get(k), new.get(k))
             for k in sorted((set(old) | set(new)) - added)
             if old.get(k) != new.get(k)]
  # A key of config.data that neither run's dataset reads (another
  # dataset's setting) changes nothing it means.
  read = {f"data.{k}" for k in pipeline.dataset_keys(old.get("data.name"))
          | pipeline.dataset_keys(new.get("data.name"))}
  means = lambda c: _is_meaning_key(c.key) and not (
      c.key.startswith("data.") and c.key not in read)
  meaning = [c for c in changes if means(c)]
  safe = [c for c in changes if not means(c)]
  return meaning, safe


def check_resume(saved: Mapping[str, Any], given: Mapping[str, Any], *,
                 step: int, allow_change: bool,
                 defaults: Mapping[str, Any] = None) -> list[Change]:
  """Refuses a resume that would silently change the checkpoint's meaning.

  Args:
    saved: the checkpoint's config.
    given: this run's config.
    step: the checkpoint's step (for messages).
    allow_change: the user's explicit opt-in
      (`config.train.allow_config_change`).
    defaults: see `config_changes`.

  Returns:
    The meaning-changing keys that were allowed (empty unless
    `allow_change`); the caller must make them take effect.

  Raises:
    ConfigChangedError: a meaning-changing key differs and `allow_change` is
      off; the message lists every such `key: saved -> given`.
  """
  meaning, safe = config_changes(saved, given, defaults)
  for change in safe:
    logging.info("Config change on resume from step %d: %s", step, change)
  if meaning and not allow_change:
    lines = "\n  ".join(str(c) for c in meaning)
    raise ConfigChangedError(
        f"The checkpoint of step {step} was trained with a different config; "
        f"these keys change what it means:\n  {lines}\nResume with the "
        "saved values, use another --workdir, or pass "
        "--config.train.allow_config_change=True to continue training the "
        "saved state under the new settings (the data stream then restarts "
        "under them).")
  for change in meaning:
    logging.warning("Config change on resume from step %d (allowed by "
                    "config.train.allow_config_change): %s", step, change)
  return meaning


def write_config(workdir: str, config: Mapping[str, Any], *, step: int,
                 changes: Iterable[Change] = ()) -> None:
  """Writes `config.json` and appends the start to `config_history.jsonl`.

  Call this only once the config has been checked against the checkpoint
  it resumes from, so `config.json` never claims settings the run did not
  use.

  Args:
    workdir: the run directory.
    config: the config this run trains with (nested dicts).
    step: the step the run starts from (0 for a new run).
    changes: meaning-changing keys allowed on this resume.
  """
  path = os.path.join(workdir, CONFIG_FILE)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, sort_keys=True, default=str)
  os.replace(path + ".tmp", path)
  entry = {"start_step": step, "time": _now(),
           "changes": [str(c) for c in changes], "config": config}
  with open(os.path.join(workdir, HISTORY_FILE), "a", encoding="utf-8") as f:
    f.write(json.dumps(entry, sort_keys=True, default=str) + "\n")


def read_config(workdir: str) -> dict[str, Any] | None:
  """The config recorded in `<workdir>/config.json`, or None (no run yet)."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def checkpoint_dir(workdir: str, directory: Optional[str] = None) -> str:
  """Where a run's checkpoints live: `directory`
  (`config.checkpoint.directory`: a URL such as `gs://bucket/run` as given,
  a relative local path taken from the workdir, so that it means the same
  from any working directory), or `<workdir>/checkpoints` without one."""
  if directory and paths.is_remote(directory):
    return directory
  return paths.absolute(os.path.join(
      workdir, os.path.expanduser(directory or CHECKPOINT_DIR)))


def recorded_checkpoint_dir(workdir: str) -> Optional[str]:
  """Where the run recorded in `<workdir>/config.json` keeps its
  checkpoints, or None (no run recorded yet)."""
  recorded = read_config(workdir)
  if recorded is None:
    return None
  section = recorded.get("checkpoint") or {}
  return checkpoint_dir(workdir, section.get("directory"))
