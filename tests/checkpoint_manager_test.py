"""Tests of kda_lm.checkpoint.manager: round trip, partial and corrupt saves."""

import json
import logging
import os
import shutil
import threading
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from kda_lm import config as config_lib
from kda_lm.checkpoint import compat, manifest, paths
from kda_lm.checkpoint import manager as manager_lib


class State(NamedTuple):
  params: Any
  opt_state: Any
  rng: jax.Array
  step: jax.Array


class FakeIterator:
  """Position-only iterator with the `save`/`restore` interface."""

  def __init__(self, position: int = 0):
    self.position = position

  def save(self, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "position.json"), "w") as f:
      json.dump(self.position, f)

  def restore(self, directory: str) -> None:
    with open(os.path.join(directory, "position.json")) as f:
      self.position = json.load(f)


def make_state(width: int = 3, step: int = 0, seed: int = 0) -> State:
  rng = np.random.default_rng(seed)
  params = {
      "linear": {"w": jnp.asarray(rng.normal(size=(width, 4)), jnp.float32),
                 "b": jnp.zeros((4,), jnp.float32)},
      "norm": {"weight": jnp.ones((4,), jnp.float32)},
  }
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  return State(params, tx.init(params), jax.random.PRNGKey(seed),
               jnp.asarray(step, jnp.int32))


def abstract(width: int = 3) -> State:
  return jax.eval_shape(lambda: make_state(width))


def save_steps(directory: str, steps, **kwargs) -> None:
  manager = manager_lib.CheckpointManager(directory, **kwargs)
  for step in steps:
    manager.save(step, make_state(step=step, seed=step), FakeIterator(step))
  manager.close()


def assert_trees_equal(a, b) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_keeps_types_and_iterator(tmp_path):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1, 2])
  manager = manager_lib.CheckpointManager(directory)
  assert manager.all_steps() == [1, 2]
  iterator = FakeIterator()
  restored = manager.restore(abstract(), iterator)
  manager.close()
  assert isinstance(restored, State)
  assert isinstance(restored.opt_state[1][0], optax.ScaleByAdamState)
  assert_trees_equal(restored, make_state(step=2, seed=2))
  assert iterator.position == 2


def test_restore_keeps_sharding(tmp_path):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [3])
  mesh = jax.make_mesh((1,), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  target = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
      abstract())
  manager = manager_lib.CheckpointManager(directory)
  restored = manager.restore(target)
  manager.close()
  for leaf in jax.tree.leaves(restored):
    assert leaf.sharding == sharding


def test_empty_directory_restores_nothing(tmp_path):
  manager = manager_lib.CheckpointManager(str(tmp_path / "none"))
  assert manager.latest_step() is None
  assert manager.restore(abstract(), FakeIterator()) is None
  manager.close()


def test_relative_path_is_made_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  manager = manager_lib.CheckpointManager("rel/ckpt")
  assert manager.directory == str(tmp_path / "rel" / "ckpt")
  manager.save(1, make_state())
  manager.close()
  assert os.path.isdir(tmp_path / "rel" / "ckpt" / "1")


def test_max_to_keep_and_existing_step(tmp_path):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1, 2, 3, 4], max_to_keep=2)
  manager = manager_lib.CheckpointManager(directory, max_to_keep=2)
  assert manager.all_steps() == [3, 4]
  assert not manager.save(4, make_state())  # Already there: nothing done.
  manager.close()


def test_partial_latest_checkpoint_is_skipped(tmp_path, caplog):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [2, 4])
  # What a process killed while saving step 4 leaves behind.
  os.rename(os.path.join(directory, "4"),
            os.path.join(directory, "4.orbax-checkpoint-tmp-1234"))
  with caplog.at_level(logging.WARNING):
    manager = manager_lib.CheckpointManager(directory)
  assert "partially written checkpoint of step 4" in caplog.text
  iterator = FakeIterator()
  restored = manager.restore(abstract(), iterator)
  assert int(restored.step) == 2 and iterator.position == 2
  # Step 4 can be saved again.
  assert manager.save(4, make_state(step=4), FakeIterator(4))
  manager.close()
  assert sorted(os.listdir(directory)) == ["2", "4"]


@pytest.mark.parametrize("damage", ["state_dir", "array_files"])
def test_unreadable_latest_checkpoint_falls_back(tmp_path, caplog, damage):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [2, 4])
  state_dir = os.path.join(directory, "4", manager_lib.STATE_ITEM)
  if damage == "state_dir":
    shutil.rmtree(state_dir)
  else:
    for root, _, files in os.walk(state_dir):
      for name in files:
        if "metadata" not in name:
          os.remove(os.path.join(root, name))
  manager = manager_lib.CheckpointManager(directory)
  iterator = FakeIterator()
  with caplog.at_level(logging.WARNING):
    restored = manager.restore(abstract(), iterator)
  assert "Skipping checkpoint" in caplog.text and "/4" in caplog.text
  assert int(restored.step) == 2 and iterator.position == 2
  assert manager.all_steps() == [2]
  manager.close()


def test_incompatible_checkpoint_is_refused(tmp_path):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1])
  manager = manager_lib.CheckpointManager(directory)
  with pytest.raises(compat.IncompatibleCheckpointError,
                     match=r"'linear/w' has shape \(3, 4\).*\(5, 4\)"):
    manager.restore(abstract(width=5))
  # Nothing was moved aside: the checkpoint is fine, just not this model's.
  assert manager.all_steps() == [1]
  manager.close()


def test_check_compatible_names_missing_and_extra():
  saved = {"a": {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}}
  target = {"a": {"w": jax.ShapeDtypeStruct((2,), jnp.float32)},
            "b": {"w": jax.ShapeDtypeStruct((3,), jnp.float32)}}
  with pytest.raises(compat.IncompatibleCheckpointError,
                     match="'b/w'.*lacks"):
    compat.check_compatible(saved, target)
  with pytest.raises(compat.IncompatibleCheckpointError,
                     match="'b/w'.*the model lacks"):
    compat.check_compatible(target, saved)
  compat.check_compatible(saved, saved)


def _flip_bytes(path: str, count: int = 4096) -> None:
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    start = max(0, len(data) // 2 - count // 2)
    for i in range(start, min(len(data), start + count)):
      data[i] ^= 0xFF
    f.seek(0)
    f.write(bytes(data))


def _largest_file(directory: str) -> str:
  files = [os.path.join(r, n) for r, _, ns in os.walk(directory) for n in ns
           if n != manifest.MANIFEST_FILE]
  return max(files, key=os.path.getsize)


def test_every_complete_step_gets_a_manifest(tmp_path):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1, 2])
  for step in (1, 2):
    step_dir = os.path.join(directory, str(step))
    assert os.path.exists(os.path.join(step_dir, manifest.MANIFEST_FILE))
    assert manifest.verify_manifest(step_dir)


def test_bit_flipped_checkpoint_falls_back_to_previous(tmp_path, caplog):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1, 2])
  _flip_bytes(_largest_file(os.path.join(directory, "2")))
  with pytest.raises(manifest.CorruptCheckpointError, match="SHA-256"):
    manifest.verify_manifest(os.path.join(directory, "2"))
  _assert_restores_step_1_and_sets_2_aside(directory, caplog)
  assert "SHA-256" in caplog.text and "/2" in caplog.text


def _assert_restores_step_1_and_sets_2_aside(directory, caplog):
  """The restore of steps [1, 2] with step 2 damaged: step 1 comes back,
  the data position with it, and step 2 is moved aside."""
  manager = manager_lib.CheckpointManager(directory)
  iterator = FakeIterator()
  with caplog.at_level(logging.WARNING):
    restored = manager.restore(abstract(), iterator)
  manager.close()
  assert_trees_equal(restored, make_state(step=1, seed=1))
  assert iterator.position == 1
  assert any(n.startswith("unreadable-2-") for n in os.listdir(directory))


def test_config_rides_with_the_checkpoint(tmp_path):
  directory = str(tmp_path / "ckpt")
  manager = manager_lib.CheckpointManager(directory)
  config = {"model": {"d_model": 8}, "data": {"seed": 3}}
  manager.save(1, make_state(step=1), FakeIterator(1), config=config)
  manager.save(2, make_state(step=2), FakeIterator(2))
  manager.close()
  manager = manager_lib.CheckpointManager(directory)
  assert manager.saved_config(1) == config
  assert manager.saved_config(2) is None
  seen = []

  def on_config(step, saved):
    seen.append((step, saved))
    return False   # keep the iterator where it is (a new stream)

  iterator = FakeIterator(-1)
  manager.restore(abstract(), iterator, step=1, on_config=on_config)
  manager.close()
  assert seen == [(1, config)]
  assert iterator.position == -1


def test_failed_async_save_names_path_and_os_reason(tmp_path, monkeypatch):
  directory = str(tmp_path / "ckpt")
  manager = manager_lib.CheckpointManager(directory)
  manager.save(1, make_state(step=1), FakeIterator(1))
  manager.wait_until_finished()

  def full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")

  # The failure surfaces from the background thread's result.
  monkeypatch.setattr(manager._manager, "check_for_errors", full_disk)
  with pytest.raises(manager_lib.CheckpointSaveError,
                     match=r"No space left on device \([0-9.]+ MiB free\)"
                     ) as info:
    manager.check_for_errors()
  assert directory in str(info.value)
  monkeypatch.undo()
  manager.close()
  assert manifest.verify_manifest(os.path.join(directory, "1"))


def test_a_save_warns_when_the_disk_has_less_room_than_the_last_step(
    tmp_path, monkeypatch, caplog):
  directory = str(tmp_path / "ckpt")
  manager = manager_lib.CheckpointManager(directory)
  usage = shutil.disk_usage(str(tmp_path))
  with caplog.at_level(logging.WARNING):
    manager.save(1, make_state(step=1))       # No earlier step: no check.
    manager.wait_until_finished()
    size = sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(os.path.join(directory, "1"))
               for name in names)
    for free, warned in ((size, False), (size - 1, True)):
      caplog.clear()
      monkeypatch.setattr(manager_lib.shutil, "disk_usage",
                          lambda _, free=free: usage._replace(free=free))
      manager._warn_if_short_of_space(2)  # pylint: disable=protected-access
      assert ("saving step 2 will probably fail" in caplog.text) == warned
  assert f"took {size / 2**20:.1f} MiB" in caplog.text
  monkeypatch.undo()
  manager.close()


@pytest.mark.parametrize("change,message", [
    # A marker file Orbax does not read back: only the manifest notices.
    ("delete", "state/commit_success.txt is missing"),
    ("add", "state/extra.bin is not in the manifest"),
])
def test_deleted_or_added_file_is_named_by_the_manifest_check(
    tmp_path, caplog, change, message):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1, 2])
  step_dir = os.path.join(directory, "2")
  path = os.path.join(step_dir, "state",
                      "commit_success.txt" if change == "delete"
                      else "extra.bin")
  if change == "delete":
    os.remove(path)
  else:
    with open(path, "wb") as f:
      f.write(b"\0" * 8)
  with pytest.raises(manifest.CorruptCheckpointError) as info:
    manifest.verify_manifest(step_dir)
  assert str(info.value) == message
  # The restore sets step 2 aside for that reason (at the manifest check,
  # before any read) and falls back to step 1.
  _assert_restores_step_1_and_sets_2_aside(directory, caplog)
  skipped = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("Skipping checkpoint")]
  assert len(skipped) == 1, skipped
  assert skipped[0].endswith(
      f"/2: it is unreadable or damaged (CorruptCheckpointError: "
      f"{message}).")


# The restore's fallback, step by step.


class OtherProcess:
  """`jax` as seen by process 1 of a multi-process run."""

  def __getattr__(self, name):
    return getattr(jax, name)

  def process_index(self):
    return 1


def test_set_aside_moves_the_step_or_says_why_not(tmp_path, monkeypatch,
                                                  caplog):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [7, 8])
  manager = manager_lib.CheckpointManager(directory)
  monkeypatch.setattr(manager_lib, "time", types.SimpleNamespace(
      time=lambda: 1234.5))

  def messages():
    return [r.getMessage() for r in caplog.records
            if r.pathname == manager_lib.__file__]

  with caplog.at_level(logging.WARNING):
    manager._set_aside(7)
  target = os.path.join(directory, "unreadable-7-1234")
  assert messages() == [f"Moved the unreadable checkpoint to {target}."]
  assert manifest.verify_manifest(target)
  assert manager.all_steps() == [8]
  caplog.clear()
  os.makedirs(os.path.join(directory, "7", "x"))
  with caplog.at_level(logging.WARNING):
    manager._set_aside(7)      # The target exists and is not empty.
  assert len(messages()) == 1
  assert messages()[0].startswith(
      f"Could not move the unreadable checkpoint {directory}/7: ")
  monkeypatch.setattr(manager_lib, "jax", OtherProcess())
  manager._set_aside(8)        # Only process 0 moves files.
  assert os.path.isdir(os.path.join(directory, "8"))
  assert not [n for n in os.listdir(directory) if n.startswith("unreadable-8")]
  manager.close()


def test_only_process_0_writes_the_manifest(tmp_path, monkeypatch):
  directory = str(tmp_path / "ckpt")
  manager = manager_lib.CheckpointManager(directory)
  monkeypatch.setattr(manager_lib, "jax", OtherProcess())
  manager.save(1, make_state(step=1))
  manager.close()
  assert not os.path.exists(
      os.path.join(directory, "1", manifest.MANIFEST_FILE))


def test_failed_wait_names_path_and_os_reason(tmp_path, monkeypatch):
  directory = str(tmp_path / "ckpt")
  manager = manager_lib.CheckpointManager(directory)
  manager.save(1, make_state(step=1))

  def full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(manager._manager, "wait_until_finished", full_disk)
  with pytest.raises(manager_lib.CheckpointSaveError,
                     match=f"{directory}/1 failed: OSError: .*No space"):
    manager.wait_until_finished()
  monkeypatch.undo()
  manager.close()


def test_a_save_failed_by_a_lost_process_does_not_wait_for_its_writes(
    tmp_path, monkeypatch):
  """A save that fails because another process is gone raises at once
  (the job's heartbeat timeout would abort this process meanwhile); any
  other failure first waits for Orbax's writes to settle."""
  manager = manager_lib.CheckpointManager(str(tmp_path / "ckpt"))
  waits = []
  monkeypatch.setattr(manager, "_discard_partial", lambda: waits.append(1))
  monkeypatch.setattr(manager_lib.distributed, "lost_peer",
                      lambda error: "heartbeat" in str(error))
  for reason, waited in (("peer stopped sending heartbeats", []),
                         ("No space left on device", [1])):
    manager._failed = None
    error = manager._fail(1, OSError(reason))
    assert reason in str(error) and waits == waited, (reason, waits)
  manager._failed = None
  manager.close()


def test_step_without_manifest_restores_with_a_warning(tmp_path, caplog):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1, 2])
  os.remove(os.path.join(directory, "2", manifest.MANIFEST_FILE))
  manager = manager_lib.CheckpointManager(directory)
  with caplog.at_level(logging.WARNING):
    restored = manager.restore(abstract())
    assert caplog.messages == [
        f"Checkpoint {directory}/2 has no manifest (the process stopped "
        "right after saving it): not verified."]
    caplog.clear()
    assert int(manager.restore(abstract(), step=1).step) == 1
    assert not caplog.messages             # Verified: nothing to say.
  manager.close()
  assert int(restored.step) == 2


def test_a_requested_step_is_never_replaced(tmp_path):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1, 2])
  _flip_bytes(_largest_file(os.path.join(directory, "2")))
  manager = manager_lib.CheckpointManager(directory)
  with pytest.raises(manifest.CorruptCheckpointError, match="SHA-256"):
    manager.restore(abstract(), step=2)
  with pytest.raises(FileNotFoundError,
                     match=r"No complete checkpoint of step 3 in .*\[1, 2\]"):
    manager.restore(abstract(), step=3)
  with pytest.raises(TypeError):            # `step` is keyword-only.
    manager.restore(  # pylint: disable=too-many-function-args
        abstract(), None, 2)
  assert manager.all_steps() == [1, 2]      # Nothing set aside.
  manager.close()


def test_every_step_damaged_restores_nothing(tmp_path, caplog):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1, 2, 3])
  for step in (1, 3):
    _flip_bytes(_largest_file(os.path.join(directory, str(step))))
  shutil.rmtree(os.path.join(directory, "2", manager_lib.STATE_ITEM))
  manager = manager_lib.CheckpointManager(directory)
  with caplog.at_level(logging.WARNING):
    assert manager.restore(abstract(), FakeIterator()) is None
  skipped = [m for m in caplog.messages if m.startswith("Skipping")]
  assert [m.split(":")[0] for m in skipped] == [
      f"Skipping checkpoint {directory}/{s}" for s in (3, 2, 1)]
  assert manager.all_steps() == []
  manager.close()


def test_restore_without_an_iterator_leaves_the_data_item(tmp_path):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1])
  manager = manager_lib.CheckpointManager(directory)
  seen = []
  restored = manager.restore(
      abstract(), on_config=lambda step, config: seen.append(step) or True)
  manager.close()
  assert seen == [1] and int(restored.step) == 1



def test_step_failing_to_restore_after_its_checks_falls_back(
    tmp_path, monkeypatch, caplog):
  """Step 2 passes the manifest and metadata checks, then its read fails:
  step 1 comes back with its data position, and step 2 is set aside."""
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1, 2])
  manager = manager_lib.CheckpointManager(directory)
  read = manager._manager.restore

  def failing_read(step, *args, **kwargs):
    if step == 2:
      raise OSError("read error")
    return read(step, *args, **kwargs)

  monkeypatch.setattr(manager._manager, "restore", failing_read)
  iterator = FakeIterator()
  with caplog.at_level(logging.WARNING):
    restored = manager.restore(abstract(), iterator)
  monkeypatch.undo()
  manager.close()
  assert_trees_equal(restored, make_state(step=1, seed=1))
  assert iterator.position == 1
  assert f"{directory}/2: restoring it failed (OSError: read error)." in (
      caplog.text)
  assert any(n.startswith("unreadable-2-") for n in os.listdir(directory))


def test_manifest_is_hashed_off_the_callers_thread(tmp_path, monkeypatch):
  """The manifest of a finished save is written in a background thread:
  the next `save` returns while it is still hashing; `close` waits for it,
  and the step verifies."""
  started, release, threads = threading.Event(), threading.Event(), []
  write = manifest.write_manifest

  def slow_write(step_dir):
    threads.append(threading.current_thread().name)
    started.set()
    assert release.wait(60)
    write(step_dir)

  monkeypatch.setattr(manifest, "write_manifest", slow_write)
  mgr = manager_lib.CheckpointManager(str(tmp_path / "ckpt"))
  state = {"w": np.arange(4, dtype=np.float32)}
  mgr.save(1, state)
  mgr.save(2, state)                # finishes step 1: its manifest starts
  assert started.wait(60)
  step1 = tmp_path / "ckpt" / "1"
  assert not (step1 / manifest.MANIFEST_FILE).exists()   # still hashing
  release.set()
  mgr.close()
  assert threads and all(t.startswith("kda_lm_manifest") for t in threads)
  assert manifest.verify_manifest(str(step1))
  assert manifest.verify_manifest(str(tmp_path / "ckpt" / "2"))


def test_the_space_check_skips_a_file_renamed_while_it_walks(
    tmp_path, monkeypatch):
  """The previous step's manifest is written in the background beside the
  next save's space check: its temporary file may vanish mid-walk."""
  directory = str(tmp_path / "ckpt")
  manager = manager_lib.CheckpointManager(directory)
  manager.save(1, make_state(step=1))
  manager.wait_until_finished()
  vanishing = os.path.join(directory, "1", "manifest.json.tmp")
  with open(vanishing, "w") as f:
    f.write("{}")
  size = paths.size

  def renamed_meanwhile(path):
    if os.fspath(path) == vanishing:
      raise FileNotFoundError(path)
    return size(path)

  monkeypatch.setattr(paths, "size", renamed_meanwhile)
  manager._warn_if_short_of_space(2)  # pylint: disable=protected-access
  monkeypatch.undo()
  os.remove(vanishing)
  manager.close()


def test_async_save_none_chooses_by_the_states_bytes():
  """None: in the background only from `ASYNC_MIN_BYTES` per process (a
  small state is written faster than the loop loses to the thread); a
  set value wins."""
  big = manager_lib.ASYNC_MIN_BYTES // 4
  state = {"w": jax.ShapeDtypeStruct((big,), jnp.float32),
           "rng": jax.random.key(0)}
  assert manager_lib.use_async(None, state)
  state["w"] = jax.ShapeDtypeStruct((big - 64,), jnp.float32)
  assert not manager_lib.use_async(None, state)
  assert manager_lib.use_async(True, state)
  assert not manager_lib.use_async(False, {"w": jnp.zeros(big + 1)})
  with pytest.raises(ValueError, match="async_save must be None, True or "
                     "False, got 'yes'"):
    config_lib.CheckpointConfig(async_save="yes")


# Verification shared between processes, seen from one process: the
# others' verdicts come from a fake all-gather.


class Process:
  """`jax` as seen by process `index` of `count`."""

  def __init__(self, index: int, count: int):
    self.index, self.count = index, count

  def __getattr__(self, name):
    return getattr(jax, name)

  def process_index(self):
    return self.index

  def process_count(self):
    return self.count


def _peers(monkeypatch, index, count, verdicts):
  """Makes this process `index` of `count`; each all-gather returns this
  process's code among `verdicts.pop(0)` (the others'). Returns the
  barriers' names."""
  barriers = []

  def allgather(codes):
    others = list(verdicts.pop(0))
    others.insert(index, int(np.asarray(codes).reshape(-1)[0]))
    return np.asarray(others, np.int32)[:, None]

  monkeypatch.setattr(manager_lib, "jax", Process(index, count))
  monkeypatch.setattr(manager_lib.multihost_utils, "process_allgather",
                      allgather)
  monkeypatch.setattr(manager_lib.multihost_utils, "sync_global_devices",
                      barriers.append)
  return barriers


def test_the_processes_agree_on_a_verdict(monkeypatch):
  # pylint: disable=protected-access
  own = manifest.CorruptCheckpointError("a.bin is missing")
  _peers(monkeypatch, 0, 3, [[0, 0], [0, 1], [2, 1], [1, 1]])
  assert manager_lib._agreed(None) is None
  with pytest.raises(manifest.CorruptCheckpointError,
                     match="^process 2 of 3 found a corrupt file"):
    raise manager_lib._agreed(None)
  with pytest.raises(manager_lib.PeerCheckpointError,
                     match="^process 1 of 3 failed"):
    raise manager_lib._agreed(None)
  assert manager_lib._agreed(own) is own     # Its own names the file.
  monkeypatch.setattr(manager_lib, "jax", Process(0, 1))
  assert manager_lib._agreed(own) is own     # Alone: no collective.
  assert manager_lib._agreed(None) is None


def test_a_corrupt_file_found_by_another_process_skips_the_step(
    tmp_path, monkeypatch, caplog):
  """Process 0 of 2 hashes its half of step 2's files and finds nothing;
  process 1 reports a corrupt file: process 0 falls back to step 1 too,
  and moves step 2 aside before every process reloads the steps."""
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1, 2])
  every = {s: sorted(rel for rel, _ in paths.files(f"{directory}/{s}")
                     if rel != manifest.MANIFEST_FILE) for s in (1, 2)}
  hashed, sha256 = [], manifest._sha256  # pylint: disable=protected-access
  monkeypatch.setattr(manifest, "_sha256",
                      lambda path: hashed.append(path) or sha256(path))
  # Step 2: the manifest check (process 1: corrupt), then the attempt
  # (failed everywhere); step 1: the check, the attempt, the read.
  verdicts = [[1], [1], [0], [0], [0]]
  barriers = _peers(monkeypatch, 0, 2, verdicts)
  _assert_restores_step_1_and_sets_2_aside(directory, caplog)
  assert (f"{directory}/2: it is unreadable or damaged "
          "(CorruptCheckpointError: process 1 of 2 found a corrupt file "
          "(its log names it)).") in caplog.text
  assert barriers == ["kda_lm: set aside 2"] and not verdicts
  for step in (1, 2):   # Process 0's half of each step's files, no more.
    mine = sorted(os.path.relpath(p, f"{directory}/{step}") for p in hashed
                  if os.fspath(p).startswith(f"{directory}/{step}/"))
    assert mine == every[step][0::2] and len(every[step]) > 2
