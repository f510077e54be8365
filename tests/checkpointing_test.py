"""Tests of kda_lm.checkpointing: round trip, partial and corrupt saves."""

import json
import logging
import os
import shutil
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from kda_lm import checkpointing


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
  manager = checkpointing.CheckpointManager(directory, **kwargs)
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
  manager = checkpointing.CheckpointManager(directory)
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
  manager = checkpointing.CheckpointManager(directory)
  restored = manager.restore(target)
  manager.close()
  for leaf in jax.tree.leaves(restored):
    assert leaf.sharding == sharding


def test_empty_directory_restores_nothing(tmp_path):
  manager = checkpointing.CheckpointManager(str(tmp_path / "none"))
  assert manager.latest_step() is None
  assert manager.restore(abstract(), FakeIterator()) is None
  manager.close()


def test_relative_path_is_made_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  manager = checkpointing.CheckpointManager("rel/ckpt")
  assert manager.directory == str(tmp_path / "rel" / "ckpt")
  manager.save(1, make_state())
  manager.close()
  assert os.path.isdir(tmp_path / "rel" / "ckpt" / "1")


def test_max_to_keep_and_existing_step(tmp_path):
  directory = str(tmp_path / "ckpt")
  save_steps(directory, [1, 2, 3, 4], max_to_keep=2)
  manager = checkpointing.CheckpointManager(directory, max_to_keep=2)
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
    manager = checkpointing.CheckpointManager(directory)
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
  state_dir = os.path.join(directory, "4", checkpointing.STATE_ITEM)
  if damage == "state_dir":
    shutil.rmtree(state_dir)
  else:
    for root, _, files in os.walk(state_dir):
      for name in files:
        if "metadata" not in name:
          os.remove(os.path.join(root, name))
  manager = checkpointing.CheckpointManager(directory)
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
  manager = checkpointing.CheckpointManager(directory)
  with pytest.raises(checkpointing.IncompatibleCheckpointError,
                     match=r"'linear/w' has shape \(3, 4\).*\(5, 4\)"):
    manager.restore(abstract(width=5))
  # Nothing was moved aside: the checkpoint is fine, just not this model's.
  assert manager.all_steps() == [1]
  manager.close()


def test_check_compatible_names_missing_and_extra():
  saved = {"a": {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}}
  target = {"a": {"w": jax.ShapeDtypeStruct((2,), jnp.float32)},
            "b": {"w": jax.ShapeDtypeStruct((3,), jnp.float32)}}
  with pytest.raises(checkpointing.IncompatibleCheckpointError,
                     match="'b/w'.*lacks"):
    checkpointing.check_compatible(saved, target)
  with pytest.raises(checkpointing.IncompatibleCheckpointError,
                     match="'b/w'.*the model lacks"):
    checkpointing.check_compatible(target, saved)
  checkpointing.check_compatible(saved, saved)
