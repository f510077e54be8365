"""A run's training state, and loading a trained run.

What training writes and inference reads back: the `TrainState` a
checkpoint restores, its one builder (`state_layout`: initialisation,
abstract shapes and shardings), and `load_run` (a run's config and newest
parameters, for generation and evaluation). The run's typed config is
`kda_lm.config.RunConfig`.

The one module of the training room that `kda_lm.infer` and `kda_lm.hf`
may import: it imports nothing else of `kda_lm.train`, only the rooms
below (`kda_lm.checkpoint` and lower).
"""

import os
from typing import Any, Callable, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
import optax

from data import pipeline
from kda_lm import config as config_lib
from kda_lm import model as model_lib
from kda_lm import optimizer, stack
from kda_lm.checkpoint import manager as manager_lib
from kda_lm.checkpoint import paths
from kda_lm.checkpoint import workdir as workdir_lib
from kda_lm.parallel import sharding


class TrainState(NamedTuple):
  """Everything a checkpoint restores (besides the data position)."""
  params: hk.Params
  opt_state: optax.OptState
  rng: jax.Array   # uint32 [2] PRNG key, split every step.
  step: jax.Array  # int32 scalar: updates done so far.


def init_rng_impl(choice: str, platform: str | None = None) -> str:
  """The PRNG implementation `train.init_rng` names: "auto" is
  "unsafe_rbg" on accelerators (TPU, GPU) and "threefry" on the CPU.

  Args:
    choice: one of `config.INIT_RNGS`.
    platform: default `jax.default_backend()`.
  """
  if choice != "auto":
    return choice
  platform = platform or jax.default_backend()
  return "threefry" if platform == "cpu" else "unsafe_rbg"


def make_init_fn(model: hk.Transformed, tx: optax.GradientTransformation,
                 seq_len: int, init_rng: str = "auto"
                 ) -> Callable[..., TrainState]:
  """Returns `init(rng, params=None) -> TrainState` at step 0: fresh
  parameters (traced on a `[1, seq_len]` row of token 0, one document) or
  the given ones (an imported checkpoint's), a fresh optimizer state, and
  the state's rng, split from `rng` the same way in both cases.

  `init_rng` (`config.train.init_rng`, resolved by
  `init_rng_impl`) is the parameters' generator: "threefry" draws
  from `rng`'s split, "unsafe_rbg" from a key of that implementation made
  of the split's two halves.
  """
  impl = init_rng_impl(init_rng)

  def init(rng, params=None):
    params_rng, state_rng = jax.random.split(rng)
    if impl != "threefry":
      halves = jax.random.split(params_rng)
      if jax.dtypes.issubdtype(halves.dtype, jax.dtypes.prng_key):
        halves = jax.random.key_data(halves)   # A typed key's bits.
      params_rng = jax.random.wrap_key_data(halves.reshape(-1), impl=impl)
    if params is None:
      tokens = jnp.zeros((1, seq_len), jnp.int32)
      params = model.init(params_rng, tokens, jnp.ones_like(tokens))
    return TrainState(params, tx.init(params), state_rng,
                      jnp.zeros((), jnp.int32))

  return init


class StateLayout(NamedTuple):
  """A run's TrainState: how it starts and where it lives (`state_layout`).

  Attributes:
    init: `make_init_fn`'s `init(rng, params=None)`, not jitted.
    abstract: the state's shapes and dtypes, with `shardings` set.
    shardings: the state's shardings on the mesh (`state_shardings`).
  """
  init: Callable[..., TrainState]
  abstract: TrainState
  shardings: Any


def state_layout(model: hk.Transformed, tx: optax.GradientTransformation,
                 seq_len: int, mesh: jax.sharding.Mesh,
                 init_rng: str = "auto") -> StateLayout:
  """The one builder of a TrainState, its shapes and its shardings: used
  by training, loading a run, the Hugging Face import and the compile
  checks alike."""
  init = make_init_fn(model, tx, seq_len, init_rng)
  abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
  shardings = state_shardings(abstract, mesh)
  return StateLayout(init, sharding.with_shardings(abstract, shardings),
                     shardings)


def init_key(cfg: config_lib.RunConfig) -> jax.Array:
  """The key a run's `init` starts from (`config.train.seed`): the loop's
  fresh runs and the Hugging Face import's step 0 alike."""
  return jax.random.PRNGKey(cfg.train.seed)


def run_state_layout(cfg: config_lib.RunConfig, mesh: jax.sharding.Mesh
                     ) -> StateLayout:
  """`state_layout` of a run's model and optimizer (start its `init` from
  `init_key(cfg)`)."""
  tx, _ = optimizer.make_optimizer(cfg.opt, cfg.train.num_steps)
  return state_layout(model_lib.build(cfg.model), tx, cfg.data.seq_len,
                      mesh, cfg.train.init_rng)


def abstract_state(cfg: config_lib.RunConfig, mesh: jax.sharding.Mesh
                   ) -> TrainState:
  """The TrainState's shapes, with the shardings training gives them."""
  return run_state_layout(cfg, mesh).abstract


def state_shardings(abstract: Any, mesh: jax.sharding.Mesh) -> Any:
  """The training shardings of a state or parameter tree (a scanned
  group's repeat axis unsharded)."""
  return sharding.state_shardings(abstract, mesh,
                                  stacked_prefix=stack.SCAN_NAME + "/")


class Run(NamedTuple):
  """A trained run, loaded for inference.

  Attributes:
    workdir: the absolute run directory.
    config: the training config (a ConfigDict from `config.json`).
    params: the newest checkpoint's parameters.
    step: that checkpoint's step.
    model: `config.model`, typed (read once by `load_run`); None in a
      `Run` made without a model (one that only reads its data).
  """
  workdir: str
  config: ml_collections.ConfigDict
  params: hk.Params
  step: int
  model: config_lib.ModelConfig | None = None


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """Reads `<workdir>/config.json`, with the keys added to kda-lm since it
  was written at their defaults (`workdir.with_defaults`).

  Raises:
    FileNotFoundError: no such file (not a training run directory).
  """
  config = workdir_lib.read_config(workdir)
  if config is None:
    raise FileNotFoundError(
        f"{os.path.join(workdir, workdir_lib.CONFIG_FILE)} does not exist: "
        f"--workdir must be the directory of a training run (python "
        f"train.py --workdir=...).")
  return ml_collections.ConfigDict(workdir_lib.with_defaults(config))


# A Hugging Face checkpoint's tokenizer files, copied into the workdir of
# its import (`kda_lm.hf.workdir`); `tokenizer.json` is the tokenizer.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                      "special_tokens_map.json")


class RunTokenizer(NamedTuple):
  """A run's text tokenizer (`run_tokenizer`).

  Attributes:
    path: its `tokenizer.json`; "" = the text's UTF-8 bytes (ids 0..255).
    released: a released model's tokenizer (an imported checkpoint's, or
      "hf:PATH"), whose special-token template applies per document; else
      a BPE trained here or bytes.
  """
  path: str
  released: bool


def run_tokenizer(run: Run) -> RunTokenizer | None:
  """The tokenizer of a run's text (checked against the SHA-256 in its
  config), or None for runs on token ids (delayed_copy)."""
  imported = os.path.join(run.workdir, HF_TOKENIZER_FILES[0])
  if os.path.isfile(imported):
    return RunTokenizer(imported, True)
  if run.config.data.name == "delayed_copy":
    return None
  data = pipeline.DataConfig.from_config(run.config.data).resolve(
      pipeline.resolve_data_dir(run.config.data, run.workdir)).dataset
  if data.hf_path:
    return RunTokenizer(data.hf_path, True)
  return RunTokenizer(data.tokenizer_path if data.is_bpe else "", False)


def load_run(workdir: str) -> Run:
  """Loads the run's config and its newest complete checkpoint.

  Args:
    workdir: the run directory given to `train.py`.

  Returns:
    The `Run`.

  Raises:
    FileNotFoundError: no `config.json`, or no complete checkpoint.
    compat.IncompatibleCheckpointError: the checkpoint does not match the
      saved config.
  """
  workdir = os.path.abspath(os.path.expanduser(workdir))
  config = load_config(workdir)
  directory = workdir_lib.recorded_checkpoint_dir(workdir)
  hint = f"train first (python train.py --workdir={workdir})."
  if not paths.has_entries(directory):
    raise FileNotFoundError(f"No checkpoint in {directory}: {hint}")
  cfg = config_lib.check_config(config)
  target = abstract_state(cfg, sharding.make_mesh(cfg.mesh))
  manager = manager_lib.CheckpointManager(directory, max_to_keep=None,
                                          async_save=False)
  try:
    state = manager.restore(target)
  finally:
    manager.close()
  if state is None:
    raise FileNotFoundError(f"No complete checkpoint in {directory}: {hint}")
  return Run(workdir, config, state.params, int(jax.device_get(state.step)),
             cfg.model)
