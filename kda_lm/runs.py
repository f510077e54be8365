"""A training run's saved config and newest parameters, for inference.

`train.py` writes `<workdir>/config.json` and Orbax checkpoints under
`<workdir>/checkpoints` (`kda_lm.checkpointing`). `load_run` reads both back:

  run = runs.load_run("runs/ling3_tiny")
  run.config.model, run.params, run.step
"""

import json
import os
from typing import Any, NamedTuple

import haiku as hk
import jax
import ml_collections

from kda_lm import checkpointing, optimizer, sharding, training
from kda_lm import model as model_lib


class Run(NamedTuple):
  """A loaded run.

  Attributes:
    workdir: the absolute run directory.
    config: the training config (a ConfigDict from `config.json`).
    params: the newest checkpoint's parameters.
    step: that checkpoint's step.
  """
  workdir: str
  config: ml_collections.ConfigDict
  params: hk.Params
  step: int


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """Reads `<workdir>/config.json`.

  Raises:
    FileNotFoundError: no such file (not a training run directory).
  """
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"{path} does not exist: --workdir must be the directory of a "
        f"training run (python train.py --workdir=...).")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def _abstract_state(config: ml_collections.ConfigDict) -> Any:
  """The TrainState's shapes and shardings, as training builds them."""
  cfg = training.check_config(config)
  model = model_lib.build(cfg.model)
  tx, _ = optimizer.make_optimizer(cfg.opt, cfg.train.num_steps)
  init = training.make_init_fn(model, tx, cfg.data.seq_len)
  abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
  mesh = sharding.make_mesh(cfg.mesh)
  return sharding.with_shardings(
      abstract, sharding.state_shardings(abstract, mesh))


def load_run(workdir: str) -> Run:
  """Loads the run's config and its newest complete checkpoint.

  Args:
    workdir: the run directory given to `train.py`.

  Returns:
    The `Run`.

  Raises:
    FileNotFoundError: no `config.json`, or no complete checkpoint.
    checkpointing.IncompatibleCheckpointError: the checkpoint does not match
      the saved config.
  """
  workdir = os.path.abspath(os.path.expanduser(workdir))
  config = load_config(workdir)
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory) or not os.listdir(directory):
    raise FileNotFoundError(f"No checkpoint in {directory}: train first "
                            f"(python train.py --workdir={workdir}).")
  manager = checkpointing.CheckpointManager(directory, max_to_keep=None,
                                            async_save=False)
  try:
    state = manager.restore(_abstract_state(config))
  finally:
    manager.close()
  if state is None:
    raise FileNotFoundError(f"No complete checkpoint in {directory}: train "
                            f"first (python train.py --workdir={workdir}).")
  return Run(workdir, config, state.params, int(jax.device_get(state.step)))
