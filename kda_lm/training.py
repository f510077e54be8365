r"""Training and evaluation loop: `train_and_evaluate(config, workdir)`.

The config (see `configs/ling3_tiny.py`) has the sections `model`, `data`,
`opt`, `train`, `eval`, `checkpoint` and `mesh`; `check_config` rejects
unknown and missing keys. One run:

1. builds the model (`kda_lm.model.build(config.model)`), the AdamW optimizer
   (linear warmup, cosine decay, global-norm clipping, no weight decay on
   norms, biases, `A_log`, `dt_bias`), a `jax.sharding.Mesh` over all devices
   (axes `data` x `fsdp`: the batch is sharded over both, parameters and
   optimizer state over `fsdp` only, so `fsdp=1` is plain data parallelism);
2. restores the newest complete checkpoint in `<workdir>/checkpoints`
   (parameters, optimizer state, rng, step and the data iterator's position),
   or initialises from `config.train.seed`;
3. runs the jitted, buffer-donating `update` step; the host reads metrics
   only every `train.log_every` steps (and at eval/checkpoint steps), so
   dispatch runs ahead of the device;
4. evaluates on the validation split every `eval.every_steps` steps and at
   the end (loss and accuracy over `loss_mask` positions), saves an async
   checkpoint every `checkpoint.every_steps` steps and at the end.

Output in `workdir`: `config.json`, `metrics.jsonl` (train rows: `step`,
`loss`, `accuracy`, `grad_norm`, `update_norm`, `lr`, `tokens_per_s`,
`wall_s`; with MTP also `mtp_loss`, with MoE `moe_load_max`,
`moe_load_min`, `moe_load_imbalance` (see `load_metrics`); eval rows:
`step`, `eval_loss`, `eval_accuracy`, `eval_tokens`, `wall_s`),
`checkpoints/`, optionally `tensorboard/`. `step` counts completed updates;
a train row averages the steps since the previous row.

MoE selection biases (`e_score_correction_bias`) are parameters that no
gradient reaches; the update step sets them from the expert load that
`apply(..., return_aux=True)` returns, so they live in `TrainState.params`
and are checkpointed with them.

A non-finite loss, gradient or update raises `FloatingPointError` naming the
step before any checkpoint of that step is written.
"""

import logging as std_logging
import os
import time
from typing import Any, Callable, Iterator, Mapping, NamedTuple

from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from data import pipeline
from kda_lm import checkpointing, distributed
from kda_lm import metrics as metrics_lib

PyTree = Any
Batch = Mapping[str, jax.Array]

P = jax.sharding.PartitionSpec
DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
# Parameters that never get weight decay, by name, besides all < 2-D arrays
# and everything under a module whose name contains "norm".
NO_DECAY_NAMES = ("A_log", "dt_bias", "b", "bias", "scale", "offset")

# Keys of the sections `check_config` knows besides `model` and `data`
# (whose keys come from the model and the data pipeline).
SECTION_KEYS = {
    "opt": ("peak_lr", "warmup_steps", "decay_steps", "end_lr_ratio",
            "weight_decay", "b1", "b2", "eps", "clip_norm"),
    "train": ("num_steps", "log_every", "seed", "stop_at_eval_accuracy",
              "tensorboard", "progress_bar"),
    "eval": ("every_steps", "num_batches"),
    "checkpoint": ("enabled", "every_steps", "max_to_keep", "async_save"),
    "mesh": ("data", "fsdp", "distributed", "coordinator_address",
             "num_processes", "process_id", "coordinator_timeout_s"),
}
SECTIONS = ("model", "data", *SECTION_KEYS)


class TrainState(NamedTuple):
  """Everything a checkpoint restores (besides the data position)."""
  params: hk.Params
  opt_state: optax.OptState
  rng: jax.Array   # uint32 [2] PRNG key, split every step.
  step: jax.Array  # int32 scalar: updates done so far.


# Libraries whose INFO logs `quiet_library_logs` drops (warnings stay), and
# TFDS, whose routine warnings on every load ("Using custom data
# configuration", deprecations) are dropped too (errors stay).
_CHATTY_LIBRARIES = ("/orbax/", "/tensorflow/", "/tensorflow_datasets/",
                     "/jax/")
_CHATTY_WARNINGS = ("/tensorflow_datasets/",)


class _LibraryInfoFilter(std_logging.Filter):

  def filter(self, record: std_logging.LogRecord) -> bool:
    path = record.pathname
    if record.levelno >= std_logging.ERROR:
      return True
    if record.levelno >= std_logging.WARNING:
      return not any(lib in path for lib in _CHATTY_WARNINGS)
    return not any(lib in path for lib in _CHATTY_LIBRARIES)


def quiet_library_logs() -> None:
  """Drops INFO logs of Orbax, TF, TFDS and JAX, and TFDS warnings."""
  logger = logging.get_absl_logger()
  if not any(isinstance(f, _LibraryInfoFilter) for f in logger.filters):
    logger.addFilter(_LibraryInfoFilter())


# ---------------------------------------------------------------------------
# Config.


def _model_module():
  from kda_lm import model  # pylint: disable=g-import-not-at-top
  return model


def _keys(section: Any) -> set[str]:
  return set(section.keys()) if hasattr(section, "keys") else set()


def _check_keys(name: str, section: Any, known: set[str], *,
                required: bool = True) -> None:
  if not isinstance(section, (ml_collections.ConfigDict, dict)):
    raise ValueError(f"config.{name} must be a ConfigDict, got "
                     f"{type(section).__name__}.")
  unknown = sorted(_keys(section) - known)
  if unknown:
    raise ValueError(
        f"Unknown config key 'config.{name}.{unknown[0]}' (unknown: "
        f"{unknown}); known keys of config.{name}: {sorted(known)}.")
  missing = sorted(known - _keys(section)) if required else []
  if missing:
    raise ValueError(f"Missing config keys in config.{name}: {missing}.")


def check_config(config: ml_collections.ConfigDict) -> None:
  """Rejects unknown or missing sections and keys, and bad values.

  Args:
    config: the full training config.

  Raises:
    ValueError: an unknown or missing key (the message names it), or a value
      out of range.
  """
  unknown = sorted(_keys(config) - set(SECTIONS))
  if unknown:
    raise ValueError(f"Unknown config section 'config.{unknown[0]}'; known "
                     f"sections: {list(SECTIONS)}.")
  missing = [s for s in SECTIONS if s not in _keys(config)]
  if missing:
    raise ValueError(f"Missing config sections: {missing}.")
  for name, keys in SECTION_KEYS.items():
    _check_keys(name, config[name], set(keys))
  _check_keys("data", config.data, set(pipeline.default_config().keys()),
              required=False)
  model_keys = set(_model_module().resolve_config(config.model).keys())
  _check_keys("model", config.model, model_keys, required=False)
  train, ev, ckpt = config.train, config.eval, config.checkpoint
  if train.num_steps < 1:
    raise ValueError(f"config.train.num_steps must be >= 1, got "
                     f"{train.num_steps}.")
  if train.log_every < 1:
    raise ValueError(f"config.train.log_every must be >= 1, got "
                     f"{train.log_every}.")
  if ev.every_steps < 0 or ckpt.every_steps < 1:
    raise ValueError("config.eval.every_steps must be >= 0 (0: no eval) and "
                     "config.checkpoint.every_steps >= 1.")
  if config.opt.warmup_steps < 0 or not config.opt.peak_lr >= 0:
    raise ValueError("config.opt.warmup_steps and peak_lr must be >= 0.")
  data_vocab = pipeline.vocab_size(config.data)
  if data_vocab > config.model.vocab_size:
    raise ValueError(
        f"The data has {data_vocab} token ids (config.data) but the model "
        f"only {config.model.vocab_size} (config.model.vocab_size).")


# ---------------------------------------------------------------------------
# Optimizer.


def weight_decay_mask(params: hk.Params) -> hk.Params:
  """True for parameters that get weight decay.

  Decayed: arrays of rank >= 2 whose name is not in `NO_DECAY_NAMES` and
  whose module path has no "norm" (embeddings, projections, conv kernels).

  Args:
    params: a Haiku parameter dict (or its abstract shapes).

  Returns:
    A tree of bools like `params`.
  """
  def decay(module: str, name: str, p: Any) -> bool:
    return (len(p.shape) >= 2 and name not in NO_DECAY_NAMES
            and "norm" not in module.lower())
  return hk.data_structures.map(decay, params)


def make_optimizer(opt_config: ml_collections.ConfigDict, num_steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with linear warmup, cosine decay and global-norm clipping.

  Args:
    opt_config: `config.opt`.
    num_steps: `config.train.num_steps` (the default decay length).

  Returns:
    (optimizer, learning-rate schedule of the 0-based step).
  """
  decay_steps = opt_config.decay_steps or num_steps
  warmup = int(opt_config.warmup_steps)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=float(opt_config.peak_lr),
      warmup_steps=warmup, decay_steps=max(int(decay_steps), warmup + 1),
      end_value=float(opt_config.peak_lr) * float(opt_config.end_lr_ratio))
  parts = []
  if opt_config.clip_norm and opt_config.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(float(opt_config.clip_norm)))
  parts.append(optax.adamw(
      schedule, b1=float(opt_config.b1), b2=float(opt_config.b2),
      eps=float(opt_config.eps), weight_decay=float(opt_config.weight_decay),
      mask=weight_decay_mask))
  return optax.chain(*parts), schedule


# ---------------------------------------------------------------------------
# Loss and steps.


def loss_terms(logits: jax.Array, batch: Batch
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Masked cross-entropy sums.

  Args:
    logits: [B,T,V] float32.
    batch: with `targets` [B,T] int and `loss_mask` [B,T] float.

  Returns:
    (sum of loss_mask-weighted cross-entropy, weighted count of correct
    argmax predictions, sum of loss_mask), float32 scalars.
  """
  targets = batch["targets"]
  mask = batch["loss_mask"].astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return (ce * mask).sum(), (correct * mask).sum(), mask.sum()


def _apply(model: hk.Transformed, params: hk.Params, batch: Batch
           ) -> jax.Array:
  return model.apply(params, batch["inputs"],
                     segment_ids=batch["segment_ids"],
                     positions=batch["positions"])


def _apply_aux(model: hk.Transformed, params: hk.Params, batch: Batch
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
  return model.apply(params, batch["inputs"],
                     segment_ids=batch["segment_ids"],
                     positions=batch["positions"], return_aux=True)


def mtp_loss(mtp_logits: jax.Array, batch: Batch) -> jax.Array:
  """Mean MTP cross-entropy over MTP layers, segment-aware.

  Args:
    mtp_logits: [num_mtp_layers, B,T,V]; layer k-1 predicts t_{i+k+1}.
    batch: with `targets`, `loss_mask` and `segment_ids`.

  Returns:
    The float32 mean over layers of each layer's masked mean cross-entropy
    (targets and weights from `kda_lm.layers.mtp.targets_and_mask`).
  """
  from kda_lm.layers import mtp  # pylint: disable=g-import-not-at-top
  losses = []
  for k in range(1, mtp_logits.shape[0] + 1):
    targets, mask = mtp.targets_and_mask(batch["targets"], batch["loss_mask"],
                                         batch["segment_ids"], k)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        mtp_logits[k - 1].astype(jnp.float32), targets)
    losses.append((ce * mask).sum() / jnp.maximum(mask.sum(), 1.0))
  return jnp.mean(jnp.stack(losses))


def load_metrics(expert_load: jax.Array) -> dict[str, jax.Array]:
  """Load balance of `aux["expert_load"]` [layers, E].

  Returns:
    `moe_load_max` / `moe_load_min`: the largest / smallest fraction of a
    layer's routed tokens that one expert received, over all MoE layers
    (uniform = 1/E), and `moe_load_imbalance`: the worst layer's max / mean.
  """
  frac = expert_load / jnp.maximum(expert_load.sum(-1, keepdims=True), 1.0)
  return {"moe_load_max": frac.max(), "moe_load_min": frac.min(),
          "moe_load_imbalance": (frac.max(-1) * frac.shape[-1]).max()}


def make_update_fn(model: hk.Transformed, tx: optax.GradientTransformation,
                   schedule: optax.Schedule,
                   model_config: ml_collections.ConfigDict | None = None
                   ) -> Callable[[TrainState, Batch],
                                 tuple[TrainState, dict[str, jax.Array]]]:
  """Returns `update(state, batch) -> (state, metrics)` (not jitted).

  With a MoE or MTP `model_config`: the loss adds `mtp_loss_scale` times
  the MTP loss (logged as `mtp_loss`; `loss` stays the main loss), and after
  the optimizer step every MoE selection bias is set to its old value moved
  by `router_bias_update_rate` toward a uniform load (the optimizer never
  changes it); metrics add the load balance (`load_metrics`).
  """
  cfg = (None if model_config is None
         else _model_module().resolve_config(model_config))
  with_aux = cfg is not None and bool(cfg["num_experts"]
                                      or cfg["num_mtp_layers"])
  bias_modules = (_model_module().router_bias_modules(model_config)
                  if with_aux else [])

  def loss_fn(params, batch):
    if not with_aux:
      logits, aux = _apply(model, params, batch), {}
    else:
      logits, aux = _apply_aux(model, params, batch)
    loss_sum, correct, weight = loss_terms(logits, batch)
    denom = jnp.maximum(weight, 1.0)
    loss = loss_sum / denom
    extra = {"accuracy": correct / denom, "main_loss": loss}
    if "mtp_logits" in aux:
      extra["mtp_loss"] = mtp_loss(aux["mtp_logits"], batch)
      loss = loss + cfg["mtp_loss_scale"] * extra["mtp_loss"]
    if "expert_load" in aux:
      extra["expert_load"] = jax.lax.stop_gradient(aux["expert_load"])
    return loss, extra

  def update(state: TrainState, batch: Batch):
    (_, extra), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if bias_modules:
      params = _model_module().update_router_bias(
          _keep_bias(params, state.params, bias_modules),
          extra["expert_load"], bias_modules,
          float(cfg["router_bias_update_rate"]))
    rng, _ = jax.random.split(state.rng)
    metrics = {
        "loss": extra["main_loss"],
        "accuracy": extra["accuracy"],
        "grad_norm": optax.global_norm(grads),
        "update_norm": optax.global_norm(updates),
        "lr": jnp.asarray(schedule(state.step), jnp.float32),
    }
    if "mtp_loss" in extra:
      metrics["mtp_loss"] = extra["mtp_loss"]
    if "expert_load" in extra:
      metrics.update(load_metrics(extra["expert_load"]))
    return TrainState(params, opt_state, rng, state.step + 1), metrics

  return update


def _keep_bias(params: hk.Params, old: hk.Params, modules: list[str]
               ) -> hk.Params:
  """`params` with the selection biases of `modules` taken from `old`."""
  from kda_lm.layers import moe  # pylint: disable=g-import-not-at-top
  new = dict(params)
  for module in modules:
    entry = dict(new[module])
    entry[moe.BIAS_NAME] = old[module][moe.BIAS_NAME]
    new[module] = entry
  return new


def make_eval_fn(model: hk.Transformed
                 ) -> Callable[[hk.Params, Batch], jax.Array]:
  """Returns `eval_step(params, batch) -> [loss_sum, correct, weight]`."""

  def eval_step(params, batch):
    return jnp.stack(loss_terms(_apply(model, params, batch), batch))

  return eval_step


# ---------------------------------------------------------------------------
# Devices and sharding.


def make_mesh(mesh_config: ml_collections.ConfigDict,
              devices: list[Any] | None = None) -> jax.sharding.Mesh:
  """A (`data`, `fsdp`) mesh over all devices.

  Args:
    mesh_config: `config.mesh`; `data = -1` takes the devices `fsdp` leaves.
    devices: default `jax.devices()` (all processes).

  Returns:
    The mesh.

  Raises:
    ValueError: the axis sizes do not multiply to the device count.
  """
  devices = list(jax.devices() if devices is None else devices)
  fsdp = int(mesh_config.fsdp)
  data = int(mesh_config.data)
  if fsdp < 1 or (data < 1 and data != -1):
    raise ValueError(f"config.mesh.fsdp must be >= 1 and config.mesh.data "
                     f">= 1 or -1, got {fsdp}, {data}.")
  if data == -1:
    data = len(devices) // fsdp
  if data * fsdp != len(devices):
    raise ValueError(f"config.mesh data={data} x fsdp={fsdp} does not match "
                     f"the {len(devices)} devices.")
  auto = jax.sharding.AxisType.Auto
  return jax.make_mesh((data, fsdp), (DATA_AXIS, FSDP_AXIS),
                       axis_types=(auto, auto), devices=devices)


def _leaf_spec(shape: tuple[int, ...], fsdp: int) -> P:
  """Shards the largest dimension that `fsdp` divides; else replicates."""
  if fsdp == 1 or not shape:
    return P()
  dims = sorted(range(len(shape)), key=lambda d: -shape[d])
  for d in dims:
    if shape[d] % fsdp == 0 and shape[d] >= fsdp:
      spec = [None] * len(shape)
      spec[d] = FSDP_AXIS
      return P(*spec)
  return P()


def state_shardings(abstract_state: PyTree, mesh: jax.sharding.Mesh
                    ) -> PyTree:
  """NamedShardings for a state: FSDP over `fsdp`, replicated over `data`."""
  fsdp = mesh.shape[FSDP_AXIS]
  return jax.tree.map(
      lambda a: jax.sharding.NamedSharding(
          mesh, _leaf_spec(tuple(a.shape), fsdp)),
      abstract_state)


def batch_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """Rows sharded over all devices (`data` and `fsdp` axes)."""
  return jax.sharding.NamedSharding(mesh, P((DATA_AXIS, FSDP_AXIS)))


def _global_batch(batch: Mapping[str, np.ndarray],
                  sharding: jax.sharding.NamedSharding
                  ) -> dict[str, jax.Array]:
  return {key: jax.make_array_from_process_local_data(sharding, batch[key])
          for key in BATCH_KEYS}


def check_batch(batch: Mapping[str, np.ndarray], vocab_size: int,
                where: str) -> None:
  """Raises a clear error for token ids outside the model's vocabulary.

  Args:
    batch: a host numpy batch.
    vocab_size: `config.model.vocab_size`.
    where: names the batch in the message, e.g. "the batch of step 3".

  Raises:
    ValueError: a token id outside `[0, vocab_size)`.
  """
  for key in ("inputs", "targets"):
    ids = batch[key]
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
      bad = lo if lo < 0 else hi
      raise ValueError(
          f"{where[:1].upper()}{where[1:]} has {key} token id {bad} outside "
          f"the model vocabulary [0, {vocab_size}) (config.model.vocab_size); "
          f"check config.data against config.model.")


# ---------------------------------------------------------------------------
# The loop.


def _write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  path = os.path.join(workdir, "config.json")
  with open(path + ".tmp", "w") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  os.replace(path + ".tmp", path)


def _non_finite_error(step: int, values: Mapping[str, float],
                      last_checkpoint: int | None) -> FloatingPointError:
  what = next(k for k in ("loss", "grad_norm", "update_norm")
              if not np.isfinite(values[k]))
  saved = ("no checkpoint was saved" if last_checkpoint is None else
           f"the latest checkpoint is step {last_checkpoint}")
  return FloatingPointError(
      f"Non-finite {what} at step {step} (loss={values['loss']}, "
      f"grad_norm={values['grad_norm']}, "
      f"update_norm={values['update_norm']}). Training stopped before "
      f"saving step {step}; {saved}. Try a lower config.opt.peak_lr or "
      f"config.opt.clip_norm.")


class _Window:
  """Device metrics of the steps since the last train row."""

  def __init__(self):
    self.pending: list[tuple[int, dict[str, jax.Array]]] = []
    self.fetched: list[tuple[int, dict[str, float]]] = []
    self.tokens = 0
    self.start = time.time()
    self.paused = 0.0
    self.first_tokens = 0
    self.first_s = 0.0

  def fetch(self) -> list[tuple[int, dict[str, float]]]:
    """Copies pending metrics to the host (the only device sync)."""
    if self.pending:
      values = jax.device_get([m for _, m in self.pending])
      new = [(s, {k: float(v) for k, v in m.items()})
             for (s, _), m in zip(self.pending, values, strict=True)]
      self.fetched.extend(new)
      self.pending = []
      return new
    return []

  def row(self) -> dict[str, float]:
    rows = [m for _, m in self.fetched]
    out = {k: float(np.mean([m[k] for m in rows]))
           for k in rows[-1] if k != "lr"}
    out["lr"] = rows[-1]["lr"]
    if self.tokens:
      elapsed = max(time.time() - self.start - self.paused, 1e-9)
      out["tokens_per_s"] = self.tokens / elapsed
    else:  # Only the first step, whose time includes compilation.
      out["tokens_per_s"] = self.first_tokens / max(self.first_s, 1e-9)
    return out

  def reset(self) -> None:
    self.fetched = []
    self.tokens = 0
    self.start = time.time()
    self.paused = 0.0


def evaluate(eval_step: Callable[..., jax.Array], params: hk.Params,
             batches: Iterator[Mapping[str, np.ndarray]],
             sharding: jax.sharding.NamedSharding, vocab_size: int
             ) -> dict[str, float]:
  """Loss and accuracy over the `loss_mask` positions of `batches`.

  Args:
    eval_step: the jitted `make_eval_fn` function.
    params: the parameters.
    batches: host numpy batches (this process's rows).
    sharding: the batch sharding.
    vocab_size: the model's vocabulary (token ids are checked).

  Returns:
    `eval_loss`, `eval_accuracy` and `eval_tokens` (the loss_mask sum).
  """
  total = None
  for batch in batches:
    check_batch(batch, vocab_size, "an eval batch")
    sums = eval_step(params, _global_batch(batch, sharding))
    total = sums if total is None else total + sums
  if total is None:
    return {"eval_loss": float("nan"), "eval_accuracy": float("nan"),
            "eval_tokens": 0.0}
  loss_sum, correct, weight = (float(x) for x in jax.device_get(total))
  denom = max(weight, 1.0)
  return {"eval_loss": loss_sum / denom, "eval_accuracy": correct / denom,
          "eval_tokens": weight}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str
                       ) -> TrainState:
  """Trains (resuming from `workdir` if possible) and evaluates.

  Args:
    config: the training config (see the module docstring).
    workdir: the run directory: checkpoints, metrics, config, TFDS data (if
      `config.data.data_dir` is unset).

  Returns:
    The final TrainState.

  Raises:
    ValueError: a bad config, an incompatible checkpoint
      (`checkpointing.IncompatibleCheckpointError`), or token ids outside the
      model vocabulary.
    FloatingPointError: a non-finite loss, gradient or update.
  """
  start_time = time.time()
  # First: check_config already touches the backend (impl="auto").
  distributed.initialize(config.get("mesh"))
  check_config(config)
  workdir = os.path.abspath(os.path.expanduser(workdir))
  is_main = distributed.is_main_process()
  if is_main:
    os.makedirs(workdir, exist_ok=True)
    _write_config(config, workdir)
  logging.info("Workdir %s; %d devices (%s), %d processes.", workdir,
               jax.device_count(), jax.devices()[0].platform,
               jax.process_count())

  mesh = make_mesh(config.mesh)
  model = _model_module().build(config.model)
  vocab = int(config.model.vocab_size)
  num_steps = int(config.train.num_steps)
  tx, schedule = make_optimizer(config.opt, num_steps)
  seq_len = int(config.data.seq_len)
  data_sharding = batch_sharding(mesh)
  replicated = jax.sharding.NamedSharding(mesh, P())
  if config.data.batch_size % mesh.size:
    raise ValueError(f"config.data.batch_size {config.data.batch_size} is "
                     f"not a multiple of the {mesh.size} devices.")

  def init(rng):
    params_rng, state_rng = jax.random.split(rng)
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    params = model.init(params_rng, tokens, jnp.ones_like(tokens))
    return TrainState(params, tx.init(params), state_rng,
                      jnp.zeros((), jnp.int32))

  rng = jax.random.PRNGKey(config.train.seed)
  abstract = jax.eval_shape(init, rng)
  shardings = state_shardings(abstract, mesh)
  abstract = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, shardings)
  num_params = sum(int(np.prod(a.shape))
                   for a in jax.tree.leaves(abstract.params))
  logging.info("Model: %s parameters; mesh %s.", f"{num_params:,}",
               dict(mesh.shape))

  with distributed.main_process_first("kda_lm: data built"):
    train_it = pipeline.make_train_iterator(config.data, workdir=workdir)
  eval_every = int(config.eval.every_steps)
  eval_batches = None
  if eval_every > 0:
    eval_batches = pipeline.make_eval_iterator(
        config.data, workdir=workdir, num_batches=config.eval.num_batches)

  writer = metrics_lib.MetricsWriter(
      workdir, tensorboard=bool(config.train.tensorboard), enabled=is_main)
  manager = None
  if config.checkpoint.enabled:
    manager = checkpointing.CheckpointManager(
        os.path.join(workdir, "checkpoints"),
        max_to_keep=config.checkpoint.max_to_keep,
        async_save=bool(config.checkpoint.async_save))
  progress = None
  try:
    state = manager.restore(abstract, train_it) if manager else None
    if state is not None:
      start_step = int(jax.device_get(state.step))
      logging.info("Resuming from the checkpoint of step %d in %s.",
                   start_step, manager.directory)
    else:
      start_step = 0
      if manager:
        logging.info("No checkpoint in %s: starting from scratch.",
                     manager.directory)
      state = jax.jit(init, out_shardings=shardings)(rng)
    writer.truncate_after(start_step)
    if start_step >= num_steps:
      logging.info("Nothing to train: the checkpoint is at step %d and "
                   "config.train.num_steps is %d (raise it to train on).",
                   start_step, num_steps)
    last_checkpoint = manager.latest_step() if manager else None

    update = jax.jit(make_update_fn(model, tx, schedule, config.model),
                     in_shardings=(shardings, data_sharding),
                     out_shardings=(shardings, replicated),
                     donate_argnums=0)
    eval_step = jax.jit(make_eval_fn(model),
                        in_shardings=(shardings.params, data_sharding),
                        out_shardings=replicated)
    progress = metrics_lib.Progress(num_steps, start_step, enabled=is_main,
                                    use_bar=config.train.progress_bar)
    log_every = int(config.train.log_every)
    ckpt_every = int(config.checkpoint.every_steps)
    stop_at = config.train.stop_at_eval_accuracy
    tokens_per_step = int(config.data.batch_size) * seq_len
    window = _Window()
    best_eval = None

    for step in range(start_step + 1, num_steps + 1):
      batch = next(train_it)
      check_batch(batch, vocab, f"the batch of step {step}")
      state, step_metrics = update(state, _global_batch(batch,
                                                        data_sharding))
      window.pending.append((step, step_metrics))
      window.tokens += tokens_per_step
      if step == start_step + 1:
        # One extra sync: the first step includes compilation, which
        # tokens/s leaves out.
        first = window.fetch()
        window.first_s = time.time() - window.start
        window.first_tokens = window.tokens
        logging.info("Step %d (compilation included) took %.1f s.", step,
                     window.first_s)
        window.reset()
        window.fetched = first
      last = step == num_steps
      do_log = step % log_every == 0 or last
      do_eval = eval_batches is not None and (step % eval_every == 0 or last)
      do_ckpt = manager is not None and (step % ckpt_every == 0 or last)
      if not (do_log or do_eval or do_ckpt):
        continue
      for s, values in window.fetch():
        if not all(np.isfinite(values[k])
                   for k in ("loss", "grad_norm", "update_norm")):
          raise _non_finite_error(s, values, last_checkpoint)
      if do_log and window.fetched:
        row = window.row()
        row["wall_s"] = time.time() - start_time
        writer.write(step, row)
        progress.train(step, row)
        window.reset()
      paused = time.time()
      stop = False
      if do_eval:
        row = evaluate(eval_step, state.params, iter(eval_batches),
                       data_sharding, vocab)
        row["wall_s"] = time.time() - start_time
        writer.write(step, row)
        progress.eval(step, row)
        best_eval = max(best_eval or 0.0, row["eval_accuracy"])
        if stop_at is not None and row["eval_accuracy"] >= stop_at:
          progress.message(
              f"Eval accuracy {row['eval_accuracy']:.4f} >= "
              f"{stop_at} at step {step}: stopping "
              f"(config.train.stop_at_eval_accuracy).")
          stop = True
      if manager is not None and (do_ckpt or stop):
        if manager.save(step, state, train_it):
          last_checkpoint = step
      window.paused += time.time() - paused
      writer.flush()
      if stop:
        break
    final_step = int(jax.device_get(state.step))
    logging.info("Done at step %d after %.1f s%s.", final_step,
                 time.time() - start_time,
                 "" if best_eval is None else
                 f"; best eval accuracy {best_eval:.4f}")
    return state
  finally:
    if progress is not None:
      progress.close()
    if manager is not None:
      manager.close()
    writer.close()
