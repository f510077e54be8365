r"""The training loop: `train_and_evaluate(config, workdir)`.

The config (see `configs/ling3_tiny.py`) has the sections `model`, `data`,
`opt`, `train`, `eval`, `checkpoint` and `mesh`; `check_config` reads each
into its typed dataclass (`kda_lm/config.py`, `data/pipeline.py`) and
rejects unknown and missing keys. The rooms of a run:

* `kda_lm.model`: the model; `kda_lm.optimizer`: AdamW and the weight-decay
  rule; `kda_lm.losses`: the loss; `kda_lm.sharding`: the (`data`, `fsdp`)
  mesh and the shardings; `kda_lm.checkpointing`: Orbax; `kda_lm.metrics`:
  output; `data.pipeline`: the batches.
* This module: the jitted, buffer-donating `update` step and the eval step,
  and the loop. `train_and_evaluate` sets up, restores the newest complete
  checkpoint in `<workdir>/checkpoints` (parameters, optimizer state, rng,
  step and the data iterator's position) or initialises from
  `config.train.seed`, then loops. The host reads metrics only every
  `train.log_every` steps (and at eval/checkpoint steps), so dispatch runs
  ahead of the device. It evaluates every `eval.every_steps` steps and at
  the end (loss and accuracy over `loss_mask` positions) and saves an async
  checkpoint every `checkpoint.every_steps` steps and at the end.

Output in `workdir`: `config.json`, `metrics.jsonl` (train rows: `step`,
`loss`, `accuracy`, `grad_norm`, `update_norm`, `lr`, `tokens_per_s`,
`wall_s`; with MTP also `mtp_loss`, with MoE `moe_load_max`,
`moe_load_min`, `moe_load_imbalance` (see `moe.load_metrics`); eval rows:
`step`, `eval_loss`, `eval_accuracy`, `eval_tokens`, `wall_s`),
`checkpoints/`, optionally `tensorboard/`. `step` counts completed updates;
a train row averages the steps since the previous row.

MoE selection biases (`e_score_correction_bias`) are parameters that no
gradient reaches; the update step sets them from the expert load that
`apply(..., return_aux=True)` returns (`moe.update_selection_biases`), so
they live in `TrainState.params` and are checkpointed with them.

A non-finite loss, gradient or update raises `FloatingPointError` naming the
step before any checkpoint of that step is written.
"""

import contextlib
import functools
import json
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
from kda_lm import checkpointing, distributed, losses, optimizer, sharding
from kda_lm import config as config_lib
from kda_lm import metrics as metrics_lib
from kda_lm import model as model_lib
from kda_lm import workdir as workdir_lib
from kda_lm.layers import moe

Batch = Mapping[str, jax.Array]
SECTIONS = ("model", "data", *[s for s in config_lib.SECTIONS
                               if s != "model"])


class TrainState(NamedTuple):
  """Everything a checkpoint restores (besides the data position)."""
  params: hk.Params
  opt_state: optax.OptState
  rng: jax.Array   # uint32 [2] PRNG key, split every step.
  step: jax.Array  # int32 scalar: updates done so far.


class RunConfig(NamedTuple):
  """The sections of a training config, typed and validated."""
  model: config_lib.ModelConfig
  data: pipeline.DataConfig
  opt: config_lib.OptConfig
  train: config_lib.TrainConfig
  eval: config_lib.EvalConfig
  checkpoint: config_lib.CheckpointConfig
  mesh: config_lib.MeshConfig


# ---------------------------------------------------------------------------
# Checks.


def check_config(config: ml_collections.ConfigDict) -> RunConfig:
  """Reads every section into its dataclass; rejects unknown keys.

  Args:
    config: the full training config.

  Returns:
    The typed sections.

  Raises:
    ValueError: an unknown or missing section or key (the message names it),
      a value out of range, or data with more token ids than the model.
  """
  keys = set(config.keys()) if hasattr(config, "keys") else set()
  unknown = sorted(keys - set(SECTIONS))
  if unknown:
    raise ValueError(f"Unknown config section 'config.{unknown[0]}'; known "
                     f"sections: {list(SECTIONS)}.")
  missing = [s for s in SECTIONS if s not in keys]
  if missing:
    raise ValueError(f"Missing config sections: {missing}.")
  sections = {
      name: config_lib.from_config(cls, config[name], name,
                                   required=name != "model")
      for name, cls in config_lib.SECTIONS.items()}
  run = RunConfig(data=pipeline.DataConfig.from_config(config.data),
                  **sections)
  data_vocab = run.data.vocab_size()
  if data_vocab > run.model.vocab_size:
    raise ValueError(
        f"The data has {data_vocab} token ids (config.data) but the model "
        f"only {run.model.vocab_size} (config.model.vocab_size).")
  return run


def check_batch(batch: Mapping[str, np.ndarray], vocab_size: int,
                where: str) -> None:
  """Raises a clear error for token ids outside the model's vocabulary.

  Args:
    batch: a host numpy batch.
    vocab_size: `config.model.vocab_size`.
    where: names the batch in the message, e.g. "the batch of step 3".

  Raises:
    ValueError: a token id outside `[0, vocab_size)` (see
      `kda_lm.model.check_tokens`).
  """
  for key in ("inputs", "targets"):
    model_lib.check_tokens(batch[key], vocab_size,
                           f"{where[:1].upper()}{where[1:]}: {key}")


# ---------------------------------------------------------------------------
# Steps.


def _apply(model: hk.Transformed, params: hk.Params, batch: Batch,
           return_aux: bool = False) -> Any:
  return model.apply(params, batch["inputs"],
                     segment_ids=batch["segment_ids"],
                     positions=batch["positions"], return_aux=return_aux)


def _loss_fn(model: hk.Transformed, cfg: config_lib.ModelConfig | None):
  """`loss(params, batch) -> (loss, extra)` for `jax.value_and_grad`."""
  with_aux = cfg is not None and cfg.has_aux_outputs

  def loss_fn(params, batch):
    logits, aux = (_apply(model, params, batch, return_aux=True) if with_aux
                   else (_apply(model, params, batch), {}))
    loss_sum, correct, weight = losses.loss_terms(logits, batch)
    denom = jnp.maximum(weight, 1.0)
    loss = loss_sum / denom
    extra = {"accuracy": correct / denom, "main_loss": loss}
    if "mtp_logits" in aux:
      extra["mtp_loss"] = losses.mtp_loss(aux["mtp_logits"], batch)
      loss = loss + cfg.mtp_loss_scale * extra["mtp_loss"]
    if "expert_load" in aux:
      extra["expert_load"] = jax.lax.stop_gradient(aux["expert_load"])
    return loss, extra

  return loss_fn


def make_update_fn(model: hk.Transformed, tx: optax.GradientTransformation,
                   schedule: optax.Schedule, model_config: Any = None
                   ) -> Callable[[TrainState, Batch],
                                 tuple[TrainState, dict[str, jax.Array]]]:
  """Returns `update(state, batch) -> (state, metrics)` (not jitted).

  With a MoE or MTP `model_config`: the loss adds `mtp_loss_scale` times
  the MTP loss (logged as `mtp_loss`; `loss` stays the main loss), and after
  the optimizer step every MoE selection bias is set by
  `moe.update_selection_biases`; metrics add the load balance
  (`moe.load_metrics`).
  """
  cfg = (None if model_config is None
         else config_lib.ModelConfig.from_config(model_config))
  bias_modules = (model_lib.router_bias_modules(cfg)
                  if cfg is not None and cfg.num_experts else [])
  loss_fn = _loss_fn(model, cfg)

  def update(state: TrainState, batch: Batch):
    (_, extra), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if bias_modules:
      params = moe.update_selection_biases(
          params, state.params, extra["expert_load"], bias_modules,
          float(cfg.router_bias_update_rate))
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
      metrics.update(moe.load_metrics(extra["expert_load"]))
    return TrainState(params, opt_state, rng, state.step + 1), metrics

  return update


def make_init_fn(model: hk.Transformed, tx: optax.GradientTransformation,
                 seq_len: int) -> Callable[[jax.Array], TrainState]:
  """Returns `init(rng) -> TrainState`: fresh parameters and optimizer state
  (traced on a `[1, seq_len]` row of token 0, one document)."""

  def init(rng):
    params_rng, state_rng = jax.random.split(rng)
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    params = model.init(params_rng, tokens, jnp.ones_like(tokens))
    return TrainState(params, tx.init(params), state_rng,
                      jnp.zeros((), jnp.int32))

  return init


def make_eval_fn(model: hk.Transformed
                 ) -> Callable[[hk.Params, Batch], jax.Array]:
  """Returns `eval_step(params, batch) -> [loss_sum, correct, weight]`."""

  def eval_step(params, batch):
    return jnp.stack(losses.loss_terms(_apply(model, params, batch), batch))

  return eval_step


def evaluate(eval_step: Callable[..., jax.Array], params: hk.Params,
             batches: Iterator[Mapping[str, np.ndarray]],
             batch_sharding: jax.sharding.NamedSharding, vocab_size: int
             ) -> dict[str, float]:
  """Loss and accuracy over the `loss_mask` positions of `batches`.

  Args:
    eval_step: the jitted `make_eval_fn` function.
    params: the parameters.
    batches: host numpy batches (this process's rows).
    batch_sharding: the batch sharding.
    vocab_size: the model's vocabulary (token ids are checked).

  Returns:
    `eval_loss`, `eval_accuracy` and `eval_tokens` (the loss_mask sum).
  """
  total = None
  for batch in batches:
    check_batch(batch, vocab_size, "an eval batch")
    sums = eval_step(params, sharding.global_batch(batch, batch_sharding))
    total = sums if total is None else total + sums
  if total is None:
    return {"eval_loss": float("nan"), "eval_accuracy": float("nan"),
            "eval_tokens": 0.0}
  loss_sum, correct, weight = (float(x) for x in jax.device_get(total))
  denom = max(weight, 1.0)
  return {"eval_loss": loss_sum / denom, "eval_accuracy": correct / denom,
          "eval_tokens": weight}


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


# ---------------------------------------------------------------------------
# The run.


def _under_mesh(mesh: jax.sharding.Mesh, fn: Callable[..., Any]
                ) -> Callable[..., Any]:
  """`fn` traced and run under `jax.set_mesh(mesh)`: the layers find the
  mesh there and run their kernels and sorts per device
  (`kda_lm.context_parallel`)."""

  @functools.wraps(fn)
  def call(*args, **kwargs):
    with jax.set_mesh(mesh):
      return fn(*args, **kwargs)

  return call


class _Run:
  """One run's fixed parts (model, optimizer, mesh, jitted steps, data,
  output) and the loop's named actions: log a row, evaluate, checkpoint."""

  def __init__(self, config: ml_collections.ConfigDict, cfg: RunConfig,
               workdir: str, start_time: float):
    self.cfg = cfg
    self.start_time = start_time
    self.workdir = workdir = os.path.abspath(os.path.expanduser(workdir))
    # Plain JSON values: saved with every checkpoint, compared on resume.
    self.config_json = json.loads(config.to_json_best_effort())
    is_main = distributed.is_main_process()
    logging.info("Workdir %s; %d devices (%s), %d processes.", workdir,
                 jax.device_count(), jax.devices()[0].platform,
                 jax.process_count())
    self.mesh = sharding.make_mesh(cfg.mesh)
    sharding.check_batch_shape(self.mesh, cfg.data.batch_size,
                               cfg.data.seq_len)
    self._build_steps()
    # Process 0 builds the TFDS data; the others then read it.
    with distributed.main_process_first("kda_lm: data built"):
      self.train_it = pipeline.make_train_iterator(cfg.data, workdir=workdir)
    self.eval_batches = None
    if cfg.eval.every_steps > 0:
      self.eval_batches = pipeline.make_eval_iterator(
          cfg.data, workdir=workdir, num_batches=cfg.eval.num_batches)
    self.writer = metrics_lib.MetricsWriter(
        workdir, tensorboard=bool(cfg.train.tensorboard), enabled=is_main)
    self.manager = None
    if cfg.checkpoint.enabled:
      self.manager = checkpointing.CheckpointManager(
          os.path.join(workdir, "checkpoints"),
          max_to_keep=cfg.checkpoint.max_to_keep,
          async_save=bool(cfg.checkpoint.async_save))
    self.is_main = is_main
    self.progress = None
    self.start_step = 0
    self.last_checkpoint = None
    self.best_eval = None

  def _build_steps(self) -> None:
    """The model, optimizer, state shardings and the jitted steps."""
    cfg = self.cfg
    model = model_lib.build(cfg.model)
    tx, schedule = optimizer.make_optimizer(cfg.opt, cfg.train.num_steps)
    init = make_init_fn(model, tx, cfg.data.seq_len)

    self.rng = jax.random.PRNGKey(cfg.train.seed)
    abstract = jax.eval_shape(init, self.rng)
    self.shardings = sharding.state_shardings(abstract, self.mesh)
    self.abstract = sharding.with_shardings(abstract, self.shardings)
    num_params = sum(int(np.prod(a.shape))
                     for a in jax.tree.leaves(abstract.params))
    logging.info("Model: %s parameters; mesh %s.", f"{num_params:,}",
                 dict(self.mesh.shape))
    self.batch_sharding = sharding.batch_sharding(self.mesh)
    replicated = sharding.replicated(self.mesh)
    mesh = functools.partial(_under_mesh, self.mesh)
    # Parameters do not depend on the mesh: init traces its one-row batch
    # with the single-device layers (a [1,T] row cannot be split over
    # several data devices).
    self.init = jax.jit(init, out_shardings=self.shardings)
    self.update = mesh(jax.jit(
        make_update_fn(model, tx, schedule, cfg.model),
        in_shardings=(self.shardings, self.batch_sharding),
        out_shardings=(self.shardings, replicated), donate_argnums=0))
    self.eval_step = mesh(jax.jit(
        make_eval_fn(model),
        in_shardings=(self.shardings.params, self.batch_sharding),
        out_shardings=replicated))

  def _check_resume(self, step: int, saved: dict[str, Any] | None) -> bool:
    """Compares the checkpoint's config with this run's (see `workdir`).

    Returns:
      Whether to restore the data iterator's position: False when an
      allowed change of the data keys restarts the stream under them.
    """
    if saved is None:
      logging.warning("The checkpoint of step %d records no config: cannot "
                      "check that this run continues the same one.", step)
      self.config_changes = []
      return True
    self.config_changes = workdir_lib.check_resume(
        saved, self.config_json, step=step,
        allow_change=self.cfg.train.allow_config_change)
    return not any(c.key.startswith("data.") for c in self.config_changes)

  def restore_or_init(self) -> TrainState:
    """The newest complete checkpoint's state, else a fresh one."""
    manager = self.manager
    self.config_changes = []
    state = None
    if manager:
      state = manager.restore(self.abstract, self.train_it,
                              on_config=self._check_resume)
    if state is not None:
      self.start_step = int(jax.device_get(state.step))
      logging.info("Resuming from the checkpoint of step %d in %s.",
                   self.start_step, manager.directory)
    else:
      if manager:
        logging.info("No checkpoint in %s: starting from scratch.",
                     manager.directory)
      state = self.init(self.rng)
    if self.is_main:
      workdir_lib.write_config(self.workdir, self.config_json,
                               step=self.start_step,
                               changes=self.config_changes)
    self.writer.truncate_after(self.start_step)
    num_steps = self.cfg.train.num_steps
    if self.start_step >= num_steps:
      logging.info("Nothing to train: the checkpoint is at step %d and "
                   "config.train.num_steps is %d (raise it to train on).",
                   self.start_step, num_steps)
    self.last_checkpoint = manager.latest_step() if manager else None
    self.progress = metrics_lib.Progress(
        num_steps, self.start_step, enabled=self.is_main,
        use_bar=self.cfg.train.progress_bar)
    return state

  def check_finite(self, fetched: list[tuple[int, dict[str, float]]]
                   ) -> None:
    for step, values in fetched:
      if not all(np.isfinite(values[k])
                 for k in ("loss", "grad_norm", "update_norm")):
        raise _non_finite_error(step, values, self.last_checkpoint)

  def log_row(self, step: int, row: dict[str, float]) -> None:
    row["wall_s"] = time.time() - self.start_time
    self.writer.write(step, row)
    self.progress.train(step, row)

  def evaluate(self, step: int, state: TrainState) -> bool:
    """Evaluates and logs; True when the run should stop here."""
    row = evaluate(self.eval_step, state.params, iter(self.eval_batches),
                   self.batch_sharding, self.cfg.model.vocab_size)
    row["wall_s"] = time.time() - self.start_time
    self.writer.write(step, row)
    self.progress.eval(step, row)
    self.best_eval = max(self.best_eval or 0.0, row["eval_accuracy"])
    stop_at = self.cfg.train.stop_at_eval_accuracy
    if stop_at is None or row["eval_accuracy"] < stop_at:
      return False
    self.progress.message(
        f"Eval accuracy {row['eval_accuracy']:.4f} >= {stop_at} at step "
        f"{step}: stopping (config.train.stop_at_eval_accuracy).")
    return True

  def checkpoint(self, step: int, state: TrainState) -> None:
    if self.manager is not None and self.manager.save(
        step, state, self.train_it, config=self.config_json):
      self.last_checkpoint = step

  def finish(self, state: TrainState) -> None:
    logging.info("Done at step %d after %.1f s%s.",
                 int(jax.device_get(state.step)),
                 time.time() - self.start_time,
                 "" if self.best_eval is None else
                 f"; best eval accuracy {self.best_eval:.4f}")

  def close(self) -> None:
    if self.progress is not None:
      self.progress.close()
    if self.manager is not None:
      self.manager.close()
    self.writer.close()


def _train_loop(run: _Run, state: TrainState) -> TrainState:
  """Steps from the restored step to `train.num_steps` (or an early stop)."""
  cfg = run.cfg
  num_steps = cfg.train.num_steps
  window = metrics_lib.Window(cfg.data.batch_size * cfg.data.seq_len)
  for step in range(run.start_step + 1, num_steps + 1):
    if run.manager is not None:
      run.manager.check_for_errors()   # A failed background save stops here.
    batch = next(run.train_it)
    check_batch(batch, cfg.model.vocab_size, f"the batch of step {step}")
    state, step_metrics = run.update(
        state, sharding.global_batch(batch, run.batch_sharding))
    window.add(step, step_metrics)
    if step == run.start_step + 1:
      logging.info("Step %d (compilation included) took %.1f s.", step,
                   window.time_first_step())
    last = step == num_steps
    do_log = step % cfg.train.log_every == 0 or last
    do_eval = run.eval_batches is not None and (
        step % cfg.eval.every_steps == 0 or last)
    do_ckpt = step % cfg.checkpoint.every_steps == 0 or last
    if not (do_log or do_eval or (do_ckpt and run.manager is not None)):
      continue
    run.check_finite(window.fetch())
    if do_log and window.has_rows():
      run.log_row(step, window.row())
      window.reset()
    with window.paused():
      stop = do_eval and run.evaluate(step, state)
      if do_ckpt or stop:
        run.checkpoint(step, state)
      run.writer.flush()
    if stop:
      break
  run.finish(state)
  return state


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
      (`checkpointing.IncompatibleCheckpointError`), a checkpoint trained
      with different model or data settings
      (`workdir.ConfigChangedError`; see `config.train.allow_config_change`),
      or token ids outside the model vocabulary.
    FloatingPointError: a non-finite loss, gradient or update.
    workdir.WorkdirLockedError: another live process trains in `workdir`.
    checkpointing.CheckpointSaveError: a checkpoint could not be written.
  """
  start_time = time.time()
  # First: the config checks already touch the backend (impl="auto").
  distributed.initialize(config.get("mesh"))
  run_config = check_config(config)
  workdir = os.path.abspath(os.path.expanduser(workdir))
  lock = contextlib.nullcontext()
  if distributed.is_main_process():
    os.makedirs(workdir, exist_ok=True)
    lock = workdir_lib.WorkdirLock(workdir)
  with lock:
    # The BPE tokenizer (built once per data dir) is recorded by path and
    # checksum in the run's config, and so checked on resume.
    with distributed.main_process_first("kda_lm: tokenizer built"):
      config = pipeline.resolve_config(config, workdir)
    run_config = check_config(config)
    run = _Run(config, run_config, workdir, start_time)
    try:
      state = run.restore_or_init()
      return _train_loop(run, state)
    finally:
      run.close()
