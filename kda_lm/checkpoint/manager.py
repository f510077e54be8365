"""Checkpoints of the training state and the data iterator, with Orbax.

With `data_item` (the iterator's handler) the only modules of kda-lm that
import Orbax. A checkpoint of step `s` is the directory `<directory>/<s>`
holding three items:

* `state`: the `TrainState` pytree (parameters, optimizer state, rng, step),
  written asynchronously by Orbax's `StandardCheckpointHandler`;
* `data`: the position of the training data iterator (a `tf.train.Checkpoint`
  of the tf.data iterator, one file set per process), written synchronously
  at the moment of the save by a small custom handler (`data_item`);
* `config`: the run's config as JSON, so a resume can tell whether it is
  about to continue the same run (`kda_lm.checkpoint.workdir.check_resume`).

The directory may be local or a URL such as `gs://bucket/run/checkpoints`:
files are reached through `etils.epath`, as Orbax does (`paths.py`).

Once a step is complete, its manifest (`manifest.py`: the size and SHA-256
of every file of the step) is written beside it by process 0, in a
background thread (hashing a large checkpoint takes minutes; the loop goes
on), and a restore verifies it: a step whose bytes changed on disk is moved
aside with one clear line, and the previous complete step is restored
instead. With several processes each hashes its share of the files (each
file is read once in all) and they agree on the verdict: if one finds a bad
file, every process falls back.

Orbax writes a step into a temporary directory and renames it when every item
is complete, so a process killed mid-save leaves a
`<s>.orbax-checkpoint-tmp-*` directory behind and never a half-written
`<s>`. `CheckpointManager.restore` skips such leftovers (and any finalized step
that fails to read) with a warning in favour of the newest complete step, and
refuses a checkpoint whose parameters do not match the model with a
`compat.IncompatibleCheckpointError` naming the parameter. A failed
asynchronous save (a full disk, lost permissions) is raised by
`check_for_errors` (called every step) as a `CheckpointSaveError` naming
the step's path and the OS reason.

Usage:

  manager = manager_lib.CheckpointManager(
      workdir_lib.checkpoint_dir(workdir), max_to_keep=3)
  restored = manager.restore(jax.eval_shape(init, rng), data_iterator)
  if restored is not None:
    state = restored
  ...
  manager.save(step, state, data_iterator)   # asynchronous
  manager.close()                             # waits for pending saves
"""

import concurrent.futures
import re
import shutil
import time
from typing import Any, Callable

from absl import logging
from etils import epath
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from kda_lm.checkpoint import compat, data_item, manifest, paths
from kda_lm.parallel import distributed

STATE_ITEM = "state"
DATA_ITEM = "data"
# What `_attempt` returns for a step it skipped.
_FAILED = object()
CONFIG_ITEM = "config"
_TMP_PATTERN = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


# Exit status of a run stopped because a checkpoint could not be written
# (EX_IOERR of sysexits.h).
SAVE_FAILED_EXIT = 74
# How long a failed save's partial directory may keep changing (the writes
# Orbax had in flight finish or fail) before it is removed anyway.
_SETTLE_S, _SETTLE_MAX_S = 0.5, 30.0
# `config.checkpoint.async_save = None` saves in the background only a
# state at least this large per process. A smaller one is written faster
# than the loop loses to the background thread (on a TPU v5e a 23 MB state
# saved asynchronously blocked 0.25 s, then slowed the next 20 steps by
# 0.65 s: the thread's Python work contends with the loop's dispatch).
ASYNC_MIN_BYTES = 256 << 20


def use_async(async_save: bool | None, state: Any) -> bool:
  """Whether to save `state` (arrays or their abstract shapes) in the
  background: `async_save` when set, else by its bytes per process
  (`ASYNC_MIN_BYTES`)."""
  if async_save is not None:
    return bool(async_save)
  total = sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(state)
              if hasattr(a, "dtype"))
  return total // jax.process_count() >= ASYNC_MIN_BYTES


# tensorstore's JSON spec, appended to its errors: thousands of characters
# that say nothing about the failure.
_TS_SPEC = re.compile(r"\s*\[tensorstore_spec='.*?'\]", re.S)


class CheckpointSaveError(OSError):
  """An asynchronous checkpoint save failed."""


def _root_cause(error: BaseException) -> BaseException:
  """The innermost OSError in an exception's cause/context chain, if any."""
  found, seen = error, set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError):
      found = error
    error = error.__cause__ or error.__context__
  return found


def _tree_bytes(path: epath.Path) -> int:
  """The bytes of the files under `path`. Files that vanish while it is
  walked (the manifest's temporary file, written beside it in the
  background, is renamed) are skipped."""
  total = 0
  for _, file in paths.files(path):
    try:
      total += paths.size(file)
    except OSError:
      pass
  return total


def _write_manifest(step_dir: epath.Path) -> None:
  """`manifest.write_manifest`, unless the step was deleted meanwhile (an
  older step past `max_to_keep`)."""
  try:
    manifest.write_manifest(step_dir)
  except FileNotFoundError:
    if step_dir.is_dir():
      raise


class PeerCheckpointError(RuntimeError):
  """Another process failed to verify or read a checkpoint."""


# What a process reports of its attempt at a step (`_agreed`).
_OK, _CORRUPT, _UNREADABLE = 0, 1, 2


def _agreed(error: Exception | None) -> Exception | None:
  """Every process's verdict on a step, once all have tried it.

  With several processes this is a collective: all must call it.

  Args:
    error: what this process's attempt raised, or None.

  Returns:
    `error` if this process failed; else, if another one failed, an error
    naming the first such process (its own log names the file or the
    reason); else None.
  """
  count = jax.process_count()
  if count == 1:
    return error
  if error is None:
    code = _OK
  elif isinstance(error, manifest.CorruptCheckpointError):
    code = _CORRUPT
  else:
    code = _UNREADABLE
  codes = np.asarray(multihost_utils.process_allgather(
      np.array([code], np.int32))).reshape(-1)
  failed = np.flatnonzero(codes)
  if error is not None or not failed.size:
    return error
  peer = int(failed[0])
  if codes[peer] == _CORRUPT:
    return manifest.CorruptCheckpointError(
        f"process {peer} of {count} found a corrupt file (its log names it)")
  return PeerCheckpointError(
      f"process {peer} of {count} failed (its log says why)")


def _agreed_call(fn: Callable[..., Any], *args, **kwargs) -> Any:
  """`fn(*args, **kwargs)`, called by every process (a collective when
  there are several): its result, or in every process an error if it
  raised in any (`_agreed`)."""
  try:
    result, error = fn(*args, **kwargs), None
  except Exception as e:  # pylint: disable=broad-exception-caught
    result, error = None, e
  error = _agreed(error)
  if error is not None:
    raise error
  return result


class CheckpointManager:
  """Saves and restores `(TrainState, data iterator)` checkpoints.

  Saves are asynchronous: `save` returns once the device arrays are copied to
  host memory and the data iterator is written; the arrays are written in a
  background thread. `close` (or `wait_until_finished`) waits for them.
  """

  def __init__(self, directory: str, *, max_to_keep: int | None = 3,
               async_save: bool = True):
    """Opens (creating it if needed) the checkpoint directory.

    Args:
      directory: checkpoint directory: local (made absolute) or a URL such
        as `gs://bucket/run/checkpoints`.
      max_to_keep: most recent checkpoints kept (None: all).
      async_save: write the arrays in a background thread.
    """
    self.directory = paths.absolute(directory)
    self._root = epath.Path(self.directory)
    self._warn_about_partial_saves()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=True,
        cleanup_tmp_directories=True,
        enable_async_checkpointing=async_save,
    )
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=options,
        item_handlers={
            STATE_ITEM: ocp.StandardCheckpointHandler(),
            DATA_ITEM: data_item.DataIteratorHandler(),
            CONFIG_ITEM: ocp.JsonCheckpointHandler(),
        },
    )
    self._saving: int | None = None
    self._failed: CheckpointSaveError | None = None
    # The newest step's manifest is hashed here, off the caller's thread
    # (hashlib releases the GIL): for a large checkpoint that is minutes.
    self._hasher = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="kda_lm_manifest")
    self._manifest: tuple[int, concurrent.futures.Future] | None = None

  def _warn_about_partial_saves(self) -> None:
    for path in self._partial_dirs():
      logging.warning(
          "Skipping the partially written checkpoint of step %s (%s): the "
          "process probably stopped while saving it. It will be deleted.",
          _TMP_PATTERN.match(path.name).group(1), path)

  def all_steps(self) -> list[int]:
    """Returns the steps of the complete checkpoints, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """Returns the newest complete checkpoint's step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def save(self, step: int, state: Any,
           data_iterator: data_item.SavableIterator | None = None,
           config: dict[str, Any] | None = None) -> bool:
    """Starts saving `state` (and the iterator position, and the config).

    The previous save is finished first (its manifest written, its errors
    raised).

    Args:
      step: the step number (the directory name).
      state: the `TrainState` pytree.
      data_iterator: optional iterator with `save(dir)`/`restore(dir)`.
      config: optional JSON-able config the state was trained with.

    Returns:
      Whether a save was started (False when `step` already exists).

    Raises:
      CheckpointSaveError: the previous asynchronous save failed.
    """
    self._finish_pending()
    step = int(step)
    if step in self._manager.all_steps():
      logging.info("Checkpoint of step %d already exists; not saving.", step)
      return False
    self._warn_if_short_of_space(step)
    items = {STATE_ITEM: ocp.args.StandardSave(state)}
    if data_iterator is not None:
      items[DATA_ITEM] = data_item.DataIteratorArgs(data_iterator)
    if config is not None:
      items[CONFIG_ITEM] = ocp.args.JsonSave(config)
    start = time.time()
    try:
      saved = self._manager.save(step, args=ocp.args.Composite(**items),
                                 force=True)
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._fail(step, e) from e
    logging.info("Saving checkpoint of step %d to %s (%.2f s blocking).",
                 step, self.directory, time.time() - start)
    if saved:
      self._saving = step
    return bool(saved)

  def _free_bytes(self) -> int | None:
    """Free bytes of the local disk; None for an object store."""
    if paths.is_remote(self.directory):
      return None
    try:
      return shutil.disk_usage(self.directory).free
    except OSError:
      return None

  def _warn_if_short_of_space(self, step: int) -> None:
    """Warns when the disk has less room than the newest checkpoint took."""
    last, free = self.latest_step(), self._free_bytes()
    if last is None or free is None:
      return
    size = self._step_bytes(last)
    if free < size:
      logging.warning(
          "Only %.1f MiB free in %s, and the checkpoint of step %d took "
          "%.1f MiB: saving step %d will probably fail. Free space, or "
          "lower config.checkpoint.max_to_keep.", free / 2**20,
          self.directory, last, size / 2**20, step)

  def _save_error(self, step: int | None, error: BaseException
                  ) -> CheckpointSaveError:
    """The one message of a failed save: cause, room, what is intact."""
    cause = _root_cause(error)
    where = self.directory if step is None else self._root / str(step)
    free = self._free_bytes()
    room = "" if free is None else f" ({free / 2**20:.1f} MiB free)"
    steps = self.all_steps()
    need = self._step_bytes(steps[-1]) if steps else 0
    resume = (f"; a checkpoint takes {need / 2**20:.1f} MiB: free that, "
              f"and the same command resumes from step {steps[-1]}"
              if steps else "")
    detail = _TS_SPEC.sub("", str(cause))
    return CheckpointSaveError(
        f"Saving the checkpoint {where} failed: {type(cause).__name__}: "
        f"{detail}{room}. Training stopped; the last complete checkpoint in "
        f"{self.directory} is intact (steps {steps}){resume}.")

  def _step_bytes(self, step: int) -> int:
    return _tree_bytes(self._root / str(step))

  def _fail(self, step: int | None, error: BaseException
            ) -> CheckpointSaveError:
    """Records a failed save: its partial directory is removed once the
    writes Orbax had in flight are over, and `close` will not wait on it
    again. Returns the error to raise.

    When another process is gone (`distributed.lost_peer`) nothing waits:
    the loop must stop before the job's heartbeat timeout aborts this
    process, and the next run removes the partial directory.
    """
    if self._failed is None:
      if not distributed.lost_peer(error):
        self._discard_partial()
      self._failed = self._save_error(step, error)
      self._saving = None
    return self._failed

  def _partial_dirs(self) -> list[epath.Path]:
    if not self._root.is_dir():
      return []
    return sorted(path for path in self._root.iterdir()
                  if _TMP_PATTERN.match(path.name))

  def _discard_partial(self) -> None:
    """Waits until the partial directories stop changing (bounded), then
    removes them (process 0)."""
    def size():
      return sum(_tree_bytes(path) for path in self._partial_dirs())

    deadline = time.time() + _SETTLE_MAX_S
    last = size()
    while time.time() < deadline:
      time.sleep(_SETTLE_S)
      now = size()
      if now == last:
        break
      last = now
    if jax.process_index() != 0:
      return
    for path in self._partial_dirs():
      try:
        path.rmtree()
        logging.info("Removed the partial checkpoint %s.", path)
      except OSError as e:
        logging.warning("Could not remove the partial checkpoint %s: %s",
                        path, e)

  def check_for_errors(self) -> None:
    """Raises `CheckpointSaveError` if a background save has failed."""
    if self._failed is not None:
      raise self._failed
    try:
      self._manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._fail(self._saving, e) from e

  def _finish_pending(self) -> None:
    """Waits for the pending save and writes its manifest (process 0)."""
    if self._failed is not None:
      raise self._failed
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._fail(self._saving, e) from e
    step, self._saving = self._saving, None
    if step is None or jax.process_index() != 0:
      return
    step_dir = self._root / str(step)
    if step_dir.is_dir():
      self._manifest_written()
      self._manifest = (step, self._hasher.submit(_write_manifest, step_dir))

  def _manifest_written(self) -> None:
    """Waits for the manifest being written in the background, if any.

    Raises:
      CheckpointSaveError: writing it failed.
    """
    if self._manifest is None:
      return
    (step, future), self._manifest = self._manifest, None
    try:
      future.result()
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._fail(step, e) from e

  def saved_config(self, step: int) -> dict[str, Any] | None:
    """The config saved with `step` (None for a checkpoint without one)."""
    if not (self._root / str(step) / CONFIG_ITEM).is_dir():
      return None
    restored = self._manager.restore(
        step, args=ocp.args.Composite(
            **{CONFIG_ITEM: ocp.args.JsonRestore()}))
    return restored[CONFIG_ITEM]

  def _saved_params(self, step: int) -> Any:
    metadata = self._manager.item_metadata(step)
    state = metadata[STATE_ITEM]
    tree = getattr(state, "tree", state)
    if tree is None or "params" not in tree:
      raise ValueError(f"no state metadata in checkpoint {step}")
    return tree["params"]

  def _set_aside(self, step: int) -> None:
    """Moves an unreadable step out of the way so it can be saved again:
    process 0 moves it, then every process (all call this) reloads the
    list of steps."""
    if jax.process_index() == 0:
      source = self._root / str(step)
      target = self._root / f"unreadable-{step}-{int(time.time())}"
      try:
        source.rename(target)
        logging.warning("Moved the unreadable checkpoint to %s.", target)
      except OSError as e:
        logging.warning("Could not move the unreadable checkpoint %s: %s",
                        source, e)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"kda_lm: set aside {step}")
    self._manager.reload()

  def _verified_params(self, step: int) -> Any:
    """The step's parameter metadata, once its files match its manifest:
    each process hashes its share of the files, and none reads the step
    if any found a bad one."""
    where = self._root / str(step)
    share = (jax.process_index(), jax.process_count())
    if not _agreed_call(manifest.verify_manifest, where, share=share):
      logging.warning("Checkpoint %s has no manifest (the process stopped "
                      "right after saving it): not verified.", where)
    return self._saved_params(step)

  def _attempt(self, strict: bool, candidate: int, what: str,
               fn: Callable[..., Any], *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)`, agreed between processes; on an error in any
    process (unless `strict`, which raises it) warns, sets the step aside
    and returns `_FAILED`, in every process."""
    try:
      return _agreed_call(fn, *args, **kwargs)
    except Exception as e:  # pylint: disable=broad-exception-caught
      if strict:
        raise
      logging.warning("Skipping checkpoint %s/%s: %s (%s: %s).",
                      self.directory, candidate, what, type(e).__name__, e)
      self._set_aside(candidate)
      return _FAILED

  def restore(self, abstract_state: Any,
              data_iterator: data_item.SavableIterator | None = None,
              *, step: int | None = None,
              on_config: Callable[[int, dict[str, Any] | None], bool]
              | None = None) -> Any | None:
    """Restores the newest complete checkpoint onto `abstract_state`.

    Complete steps are tried newest first; a step that cannot be read, or
    whose files do not match its manifest (a corrupt or truncated
    checkpoint), is moved aside with a warning. With several processes
    each hashes its share of the step's files, and a step any of them finds
    damaged is skipped by all.

    Args:
      abstract_state: the target's structure, e.g.
        `jax.eval_shape(init, rng)`, with `sharding` set on its leaves; the
        restored arrays get these types, dtypes and shardings.
      data_iterator: the iterator to move to the saved position (None: the
        data item is not restored).
      step: restore exactly this step (no fallback).
      on_config: called with the chosen step and its saved config (None if
        it has none) before anything is restored; may raise to refuse the
        resume; returns whether to restore the data iterator's position.

    Returns:
      The restored state, or None when there is no complete checkpoint.

    Raises:
      compat.IncompatibleCheckpointError: the newest readable checkpoint's
        parameters do not match `abstract_state.params`.
      FileNotFoundError: `step` was given and does not exist.
    """
    self._manifest_written()    # A step is verified against its manifest.
    steps = self.all_steps()
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(
            f"No complete checkpoint of step {step} in {self.directory}; "
            f"found {steps}.")
      steps = [step]
    for candidate in reversed(steps):
      where = f"{self.directory}/{candidate}"
      saved_params = self._attempt(
          step is not None, candidate, "it is unreadable or damaged",
          self._verified_params, candidate)
      if saved_params is _FAILED:
        continue
      compat.check_compatible(saved_params, abstract_state.params, where=where)
      restore_data = True
      if on_config is not None:
        restore_data = on_config(candidate, self.saved_config(candidate))
      items = {STATE_ITEM: ocp.args.StandardRestore(abstract_state)}
      if data_iterator is not None and restore_data:
        items[DATA_ITEM] = data_item.DataIteratorArgs(data_iterator)
      restored = self._attempt(
          step is not None, candidate, "restoring it failed",
          self._manager.restore, candidate, args=ocp.args.Composite(**items))
      if restored is _FAILED:
        continue
      logging.info("Restored checkpoint %s.", where)
      return restored[STATE_ITEM]
    return None

  def wait_until_finished(self) -> None:
    """Blocks until pending asynchronous saves and their manifests are
    written."""
    self._finish_pending()
    self._manifest_written()

  def close(self) -> None:
    """Waits for pending saves and their manifests and releases the
    manager. After a failed save (already raised) it only releases it."""
    try:
      if self._failed is None:
        self._finish_pending()
        self._manifest_written()
    finally:
      self._hasher.shutdown(wait=True)
      try:
        self._manager.close()
      except Exception:  # pylint: disable=broad-exception-caught
        if self._failed is None:
          raise
