"""Checkpoints of the training state and the data iterator, with Orbax.

This is the only module of kda-lm that imports Orbax. A checkpoint of step
`s` is the directory `<directory>/<s>` holding two items:

* `state`: the `TrainState` pytree (parameters, optimizer state, rng, step),
  written asynchronously by Orbax's `StandardCheckpointHandler`;
* `data`: the position of the training data iterator (a `tf.train.Checkpoint`
  of the tf.data iterator, one file set per process), written synchronously
  at the moment of the save by a small custom handler;
* `config`: the run's config as JSON, so a resume can tell whether it is
  about to continue the same run (`kda_lm.workdir.check_resume`).

Once a step is complete, a manifest (`manifest.json` in the step's
directory: the size and SHA-256 of every file) is written beside it, and a
restore verifies it: a step whose bytes changed on disk is moved aside with
one clear line, and the previous complete step is restored instead.

Orbax writes a step into a temporary directory and renames it when every item
is complete, so a process killed mid-save leaves a
`<s>.orbax-checkpoint-tmp-*` directory behind and never a half-written
`<s>`. `CheckpointManager.restore` skips such leftovers (and any finalized step
that fails to read) with a warning in favour of the newest complete step, and
refuses a checkpoint whose parameters do not match the model with an
`IncompatibleCheckpointError` naming the parameter. A failed asynchronous save
(a full disk, lost permissions) is raised by `check_for_errors` (called every
step) as a `CheckpointSaveError` naming the step's path and the OS reason.

Usage:

  manager = checkpointing.CheckpointManager(workdir + "/checkpoints",
                                            max_to_keep=3)
  restored = manager.restore(jax.eval_shape(init, rng), data_iterator)
  if restored is not None:
    state = restored
  ...
  manager.save(step, state, data_iterator)   # asynchronous
  manager.close()                             # waits for pending saves
"""

import dataclasses
import json
import os
import re
import time
from typing import Any, Callable, Protocol

from absl import logging
from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

from kda_lm import workdir as workdir_lib

STATE_ITEM = "state"
DATA_ITEM = "data"
# What `_attempt` returns for a step it skipped.
_FAILED = object()
CONFIG_ITEM = "config"
MANIFEST_FILE = "manifest.json"
_TMP_PATTERN = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


class IncompatibleCheckpointError(ValueError):
  """A checkpoint does not match the model being trained."""


class CheckpointSaveError(OSError):
  """An asynchronous checkpoint save failed."""


class CorruptCheckpointError(ValueError):
  """A checkpoint's files do not match the manifest written with it."""


def _step_files(step_dir: str) -> dict[str, str]:
  """Maps relative paths to absolute paths of a step's files (no manifest)."""
  files = {}
  for root, _, names in os.walk(step_dir):
    for name in names:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir)
      if rel != MANIFEST_FILE:
        files[rel] = path
  return files


def write_manifest(step_dir: str) -> None:
  """Writes `manifest.json`: size and SHA-256 of every file of a step."""
  entries = {rel: {"bytes": os.path.getsize(path),
                    "sha256": workdir_lib.file_sha256(path)}
             for rel, path in sorted(_step_files(step_dir).items())}
  path = os.path.join(step_dir, MANIFEST_FILE)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump({"files": entries}, f, indent=1, sort_keys=True)
  os.replace(path + ".tmp", path)


def verify_manifest(step_dir: str) -> bool:
  """Checks a step's files against its manifest.

  Args:
    step_dir: the step's directory.

  Returns:
    True if verified; False if the step has no manifest (a process stopped
    between the end of the save and the manifest).

  Raises:
    CorruptCheckpointError: a file is missing, extra, or differs in size or
      checksum; the message names the first such file.
  """
  path = os.path.join(step_dir, MANIFEST_FILE)
  if not os.path.exists(path):
    return False
  with open(path, encoding="utf-8") as f:
    expected = json.load(f)["files"]
  found = _step_files(step_dir)
  for rel in sorted(set(expected) | set(found)):
    if rel not in found:
      raise CorruptCheckpointError(f"{rel} is missing")
    if rel not in expected:
      raise CorruptCheckpointError(f"{rel} is not in the manifest")
    size = os.path.getsize(found[rel])
    if size != expected[rel]["bytes"]:
      raise CorruptCheckpointError(
          f"{rel} has {size} bytes, the manifest says "
          f"{expected[rel]['bytes']}")
    if workdir_lib.file_sha256(found[rel]) != expected[rel]["sha256"]:
      raise CorruptCheckpointError(
          f"{rel} does not match its SHA-256 in the manifest (its bytes "
          "changed after the save)")
  return True


def _root_cause(error: BaseException) -> BaseException:
  """The innermost OSError in an exception's cause/context chain, if any."""
  found, seen = error, set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError):
      found = error
    error = error.__cause__ or error.__context__
  return found


class SavableIterator(Protocol):
  """What the data item needs: `save(dir)` and `restore(dir)`."""

  def save(self, directory: str) -> Any:
    ...

  def restore(self, directory: str) -> None:
    ...


class DataIteratorHandler(ocp.CheckpointHandler):
  """Orbax handler that saves/restores an iterator with `save`/`restore`."""

  def save(self, directory: epath.Path, args: "DataIteratorArgs") -> None:
    args.iterator.save(os.fspath(directory))

  def restore(self, directory: epath.Path,
              args: "DataIteratorArgs | None" = None) -> Any:
    if args is None:
      raise ValueError("Restoring the data iterator needs the iterator.")
    args.iterator.restore(os.fspath(directory))
    return args.iterator

  def metadata(self, directory: epath.Path) -> None:
    del directory
    return None

  def finalize(self, directory: epath.Path) -> None:
    del directory


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True,
                                for_restore=True)
@dataclasses.dataclass
class DataIteratorArgs(ocp.args.CheckpointArgs):
  """Save/restore arguments of the data item: the iterator itself."""
  iterator: SavableIterator


def _leaf_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  """Maps `a/b/c` paths of a (metadata) tree to (shape, dtype)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: x is None)
  shapes = {}
  for path, leaf in flat:
    if leaf is None or not hasattr(leaf, "shape"):
      continue
    name = "/".join(
        str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
        for k in path)
    shapes[name] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
  return shapes


def check_compatible(saved_params: Any, target_params: Any, *,
                     where: str = "the checkpoint") -> None:
  """Raises if the saved parameters do not match the target's shapes.

  Args:
    saved_params: parameter tree from the checkpoint metadata (leaves with
      `shape` and `dtype`).
    target_params: the model's parameter tree (arrays or
      `jax.ShapeDtypeStruct`s).
    where: how to name the checkpoint in the message.

  Raises:
    IncompatibleCheckpointError: a parameter is missing, extra, or has a
      different shape or dtype; the message names the first such parameter.
  """
  saved = _leaf_shapes(saved_params)
  target = _leaf_shapes(target_params)
  hint = (" The checkpoint comes from a different model config: use another "
          "--workdir, or delete the checkpoints to start afresh.")
  for name in sorted(target):
    if name not in saved:
      raise IncompatibleCheckpointError(
          f"Incompatible checkpoint {where}: the model has parameter {name!r} "
          f"{target[name][0]} that the checkpoint lacks.{hint}")
    if saved[name] != target[name]:
      raise IncompatibleCheckpointError(
          f"Incompatible checkpoint {where}: parameter {name!r} has shape "
          f"{saved[name][0]} ({saved[name][1]}) in the checkpoint but "
          f"{target[name][0]} ({target[name][1]}) in the model.{hint}")
  extra = sorted(set(saved) - set(target))
  if extra:
    raise IncompatibleCheckpointError(
        f"Incompatible checkpoint {where}: it has parameter {extra[0]!r} "
        f"{saved[extra[0]][0]} that the model lacks.{hint}")


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
      directory: checkpoint directory; made absolute.
      max_to_keep: most recent checkpoints kept (None: all).
      async_save: write the arrays in a background thread.
    """
    self.directory = os.path.abspath(os.path.expanduser(directory))
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
            DATA_ITEM: DataIteratorHandler(),
            CONFIG_ITEM: ocp.JsonCheckpointHandler(),
        },
    )
    self._saving: int | None = None

  def _warn_about_partial_saves(self) -> None:
    if not os.path.isdir(self.directory):
      return
    for name in sorted(os.listdir(self.directory)):
      match = _TMP_PATTERN.match(name)
      if match:
        logging.warning(
            "Skipping the partially written checkpoint of step %s (%s): the "
            "process probably stopped while saving it. It will be deleted.",
            match.group(1), os.path.join(self.directory, name))

  def all_steps(self) -> list[int]:
    """Returns the steps of the complete checkpoints, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """Returns the newest complete checkpoint's step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def save(self, step: int, state: Any,
           data_iterator: SavableIterator | None = None,
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
    items = {STATE_ITEM: ocp.args.StandardSave(state)}
    if data_iterator is not None:
      items[DATA_ITEM] = DataIteratorArgs(data_iterator)
    if config is not None:
      items[CONFIG_ITEM] = ocp.args.JsonSave(config)
    start = time.time()
    try:
      saved = self._manager.save(step, args=ocp.args.Composite(**items),
                                 force=True)
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._save_error(step, e) from e
    logging.info("Saving checkpoint of step %d to %s (%.2f s blocking).",
                 step, self.directory, time.time() - start)
    if saved:
      self._saving = step
    return bool(saved)

  def _save_error(self, step: int | None, error: BaseException
                  ) -> CheckpointSaveError:
    cause = _root_cause(error)
    where = self.directory if step is None else os.path.join(
        self.directory, str(step))
    return CheckpointSaveError(
        f"Saving the checkpoint {where} failed: {type(cause).__name__}: "
        f"{cause}. Training stopped; the last complete checkpoint in "
        f"{self.directory} is intact (steps {self.all_steps()}).")

  def check_for_errors(self) -> None:
    """Raises `CheckpointSaveError` if a background save has failed."""
    try:
      self._manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._save_error(self._saving, e) from e

  def _finish_pending(self) -> None:
    """Waits for the pending save and writes its manifest (process 0)."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._save_error(self._saving, e) from e
    step, self._saving = self._saving, None
    if step is None or jax.process_index() != 0:
      return
    step_dir = os.path.join(self.directory, str(step))
    if os.path.isdir(step_dir):
      write_manifest(step_dir)

  def saved_config(self, step: int) -> dict[str, Any] | None:
    """The config saved with `step` (None for a checkpoint without one)."""
    path = os.path.join(self.directory, str(step), CONFIG_ITEM)
    if not os.path.isdir(path):
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
    """Moves an unreadable step out of the way so it can be saved again."""
    if jax.process_index() != 0:
      return
    source = os.path.join(self.directory, str(step))
    target = os.path.join(self.directory,
                          f"unreadable-{step}-{int(time.time())}")
    try:
      os.rename(source, target)
      logging.warning("Moved the unreadable checkpoint to %s.", target)
    except OSError as e:
      logging.warning("Could not move the unreadable checkpoint %s: %s",
                      source, e)
    self._manager.reload()

  def _verified_params(self, step: int) -> Any:
    """The step's parameter metadata, once its files match its manifest."""
    where = os.path.join(self.directory, str(step))
    if not verify_manifest(where):
      logging.warning("Checkpoint %s has no manifest (the process stopped "
                      "right after saving it): not verified.", where)
    return self._saved_params(step)

  def _attempt(self, strict: bool, candidate: int, what: str,
               fn: Callable[..., Any], *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)`; on an error (unless `strict`, which re-raises)
    warns, sets the step aside and returns `_FAILED`."""
    try:
      return fn(*args, **kwargs)
    except Exception as e:  # pylint: disable=broad-exception-caught
      if strict:
        raise
      logging.warning("Skipping checkpoint %s/%s: %s (%s: %s).",
                      self.directory, candidate, what, type(e).__name__, e)
      self._set_aside(candidate)
      return _FAILED

  def restore(self, abstract_state: Any,
              data_iterator: SavableIterator | None = None,
              *, step: int | None = None,
              on_config: Callable[[int, dict[str, Any] | None], bool]
              | None = None) -> Any | None:
    """Restores the newest complete checkpoint onto `abstract_state`.

    Complete steps are tried newest first; a step that cannot be read, or
    whose files do not match its manifest (a corrupt or truncated
    checkpoint), is moved aside with a warning.

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
      IncompatibleCheckpointError: the newest readable checkpoint's parameters
        do not match `abstract_state.params`.
      FileNotFoundError: `step` was given and does not exist.
    """
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
      check_compatible(saved_params, abstract_state.params, where=where)
      restore_data = True
      if on_config is not None:
        restore_data = on_config(candidate, self.saved_config(candidate))
      items = {STATE_ITEM: ocp.args.StandardRestore(abstract_state)}
      if data_iterator is not None and restore_data:
        items[DATA_ITEM] = DataIteratorArgs(data_iterator)
      restored = self._attempt(
          step is not None, candidate, "restoring it failed",
          self._manager.restore, candidate, args=ocp.args.Composite(**items))
      if restored is _FAILED:
        continue
      logging.info("Restored checkpoint %s.", where)
      return restored[STATE_ITEM]
    return None

  def wait_until_finished(self) -> None:
    """Blocks until pending asynchronous saves are written (and verified)."""
    self._finish_pending()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    try:
      self._finish_pending()
    finally:
      self._manager.close()
