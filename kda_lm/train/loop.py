r"""The training loop: `train_and_evaluate(config, workdir)`.

The config (see `configs/ling3_tiny.py`) has the sections `model`, `data`,
`opt`, `train`, `eval`, `checkpoint` and `mesh`;
`kda_lm.config.check_config` reads each into its typed dataclass
(`kda_lm/config.py`, `data/pipeline.py`) and rejects unknown and missing
keys. This module owns the loop and its jobs, each in one place:
`build_steps` (model, optimizer, shardings, the jitted steps of
`kda_lm.train.step`), `_restore_or_init` (resume checks and restore),
`_Output` (metrics rows and console), and `_train_loop` (when to log,
evaluate and save). `train_and_evaluate` sets up, restores the newest complete
  checkpoint in `<workdir>/checkpoints` (parameters, optimizer state, rng,
  step and the data iterator's position) or initialises from
  `config.train.seed`, then loops. The host reads metrics only every
  `train.log_every` steps (and at eval/checkpoint steps), so dispatch runs
  ahead of the device. It evaluates every `eval.every_steps` steps and at
  the end (loss and accuracy over `loss_mask` positions) and saves an async
  checkpoint every `checkpoint.every_steps` steps and at the end.

Output in `workdir`: `config.json`, `metrics.jsonl` (train rows: `step`,
`loss`, `accuracy`, `grad_norm`, `lr`, `tokens_per_s`, `wall_s`; with
`train.log_update_norm` also `update_norm`; with MTP also `mtp_loss`, with
MoE `moe_load_max`, `moe_load_min`, `moe_load_imbalance` (see
`moe.load_metrics`); eval rows:
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
from typing import Any, Callable, Mapping, NamedTuple

from absl import logging
import jax
import ml_collections
import numpy as np

from data import pipeline
import kda_lm
from kda_lm import config as config_lib
from kda_lm import flops, losses, optimizer
from kda_lm import model as model_lib
from kda_lm.checkpoint import manager as manager_lib
from kda_lm.checkpoint import paths
from kda_lm.checkpoint import workdir as workdir_lib
from kda_lm.parallel import distributed, sharding
from kda_lm.train import ahead as ahead_lib
from kda_lm.train import metrics as metrics_lib
from kda_lm.train import preemption as preemption_lib
from kda_lm.train import state as state_lib
from kda_lm.train import step as step_lib

TrainState = state_lib.TrainState

# The metrics a step must keep finite (`update_norm` when it is logged).
_FINITE = ("loss", "grad_norm", "update_norm")


def _non_finite_error(step: int, values: Mapping[str, float],
                      last_checkpoint: int | None) -> FloatingPointError:
  checked = [k for k in _FINITE if k in values]
  what = next(k for k in checked if not np.isfinite(values[k]))
  saved = ("no checkpoint was saved" if last_checkpoint is None else
           f"the latest checkpoint is step {last_checkpoint}")
  shown = ", ".join(f"{k}={values[k]}" for k in checked)
  return FloatingPointError(
      f"Non-finite {what} at step {step} ({shown}). Training stopped "
      f"before saving step {step}; {saved}. Try a lower config.opt.peak_lr "
      f"or config.opt.clip_norm.")


class _UnderMesh:
  """`fn` traced, lowered and run under `jax.set_mesh(mesh)`: the layers
  find the mesh there and run their kernels and sorts per device
  (`kda_lm.parallel.maps`, `kda_lm.parallel.context`)."""

  def __init__(self, mesh: jax.sharding.Mesh, fn: Any):
    self.mesh = mesh
    self.fn = fn

  def __call__(self, *args, **kwargs):
    with jax.set_mesh(self.mesh):
      return self.fn(*args, **kwargs)

  def lower(self, *args, **kwargs) -> Any:
    with jax.set_mesh(self.mesh):
      return self.fn.lower(*args, **kwargs)


class Steps(NamedTuple):
  """The jitted functions of a run and the shardings they use."""
  init: Callable[[jax.Array], TrainState]
  update: Callable[..., tuple[TrainState, dict[str, jax.Array]]]
  eval_step: Callable[..., jax.Array]
  abstract: TrainState        # Shapes, dtypes and shardings of the state.
  batch_sharding: jax.sharding.NamedSharding
  rng: jax.Array              # The key `init` starts from.
  flops_per_token: float      # Analytic training FLOPs (`flops.step_flops`).


def build_steps(cfg: config_lib.RunConfig, mesh: jax.sharding.Mesh) -> Steps:
  """The model, optimizer, state shardings and the jitted steps."""
  model = model_lib.build(cfg.model, remat=cfg.train.remat)
  tx, schedule = optimizer.make_optimizer(cfg.opt, cfg.train.num_steps)
  layout = state_lib.state_layout(model, tx, cfg.data.seq_len, mesh,
                                  cfg.train.init_rng)
  rng = state_lib.init_key(cfg)
  abstract, shardings = layout.abstract, layout.shardings
  num_params = sum(int(np.prod(a.shape))
                   for a in jax.tree.leaves(abstract.params))
  T = cfg.data.seq_len
  flops_per_token = flops.step_flops(cfg.model, 1, T, abstract.params) / T
  logging.info("Model: %s parameters (initialised with %s), %.3g training "
               "FLOPs per token at T=%d; mesh %s.", f"{num_params:,}",
               state_lib.init_rng_impl(cfg.train.init_rng), flops_per_token,
               T, dict(mesh.shape))
  batch_sharding = sharding.batch_sharding(mesh)
  replicated = sharding.replicated(mesh)
  on_mesh = functools.partial(_UnderMesh, mesh)
  # Parameters do not depend on the mesh: init traces its one-row batch
  # with the single-device layers (a [1,T] row cannot be split over
  # several data devices).
  return Steps(
      init=jax.jit(layout.init, out_shardings=shardings),
      update=on_mesh(jax.jit(
          step_lib.make_update_fn(model, tx, schedule, cfg.model,
                                  cfg.train.grad_accum_steps,
                                  cfg.train.loss_chunks,
                                  cfg.train.log_update_norm),
          in_shardings=(shardings, batch_sharding),
          out_shardings=(shardings, replicated), donate_argnums=0)),
      eval_step=on_mesh(jax.jit(
          losses.make_eval_step(
              model, head_weight=functools.partial(model_lib.head_weight,
                                                   cfg.model),
              chunks=cfg.train.loss_chunks),
          in_shardings=(shardings.params, batch_sharding),
          out_shardings=replicated)),
      abstract=abstract,
      batch_sharding=batch_sharding, rng=rng,
      flops_per_token=flops_per_token)


class _Output:
  """Where a run reports: `metrics.jsonl` (and TensorBoard) and the
  console progress, with wall-clock seconds since the start."""

  def __init__(self, cfg: config_lib.RunConfig, workdir: str,
               start_time: float, enabled: bool):
    self.start_time = start_time
    self.enabled = enabled
    self.use_bar = cfg.train.progress_bar
    self.writer = metrics_lib.MetricsWriter(
        workdir, tensorboard=bool(cfg.train.tensorboard), enabled=enabled)
    self.progress = None

  def start(self, num_steps: int, start_step: int) -> None:
    self.writer.truncate_after(start_step)
    self.progress = metrics_lib.Progress(
        num_steps, start_step, enabled=self.enabled, use_bar=self.use_bar)

  def train_row(self, step: int, row: dict[str, float]) -> None:
    row["wall_s"] = time.time() - self.start_time
    self.writer.write(step, row)
    self.progress.train(step, row)

  def eval_row(self, step: int, row: dict[str, float]) -> None:
    row["wall_s"] = time.time() - self.start_time
    self.writer.write(step, row)
    self.progress.eval(step, row)

  def close(self) -> None:
    if self.progress is not None:
      self.progress.close()
    self.writer.close()


def _resume_check(cfg: config_lib.RunConfig, config_json: dict[str, Any],
                  changes: list[Any]):
  """`on_config` for `CheckpointManager.restore`: compares the checkpoint's
  config with this run's (`workdir.check_resume`), records the allowed
  changes, and says whether to restore the data iterator's position (not
  when an allowed change of the data keys restarts the stream)."""

  def on_config(step: int, saved: dict[str, Any] | None) -> bool:
    if saved is None:
      logging.warning("The checkpoint of step %d records no config: cannot "
                      "check that this run continues the same one.", step)
      return True
    changes[:] = workdir_lib.check_resume(
        saved, config_json, step=step,
        allow_change=cfg.train.allow_config_change,
        defaults=workdir_lib.default_keys())
    return not any(c.key.startswith("data.") for c in changes)

  return on_config


def _refuse_moved_checkpoints(workdir: str, directory: str) -> None:
  """A run that finds no checkpoint in `directory` does not start over in
  a workdir whose recorded run kept its checkpoints elsewhere
  (`config.checkpoint.directory` changed): it names both places."""
  before = workdir_lib.recorded_checkpoint_dir(workdir)
  if before is None or before == directory:
    return
  if paths.has_entries(before):
    raise ValueError(
        f"The run in {workdir} keeps its checkpoints in {before}, but "
        f"config.checkpoint.directory now points to {directory}, which "
        "holds none. Pass --config.checkpoint.directory="
        f"{before} to resume, or move the checkpoints there first.")


class _Run:
  """One run's fixed parts (config, mesh, steps, data, output, checkpoint
  manager) and the loop's named actions: evaluate, checkpoint."""

  def __init__(self, config: ml_collections.ConfigDict,
               cfg: config_lib.RunConfig, workdir: str, start_time: float):
    self.cfg = cfg
    self.workdir = workdir
    self.cache_counts = ahead_lib.CacheCounts()
    # Plain JSON values: saved with every checkpoint, compared on resume.
    self.config_json = json.loads(config.to_json_best_effort())
    self.is_main = distributed.is_main_process()
    logging.info("Workdir %s; %d devices (%s), %d processes.", workdir,
                 jax.device_count(), jax.devices()[0].platform,
                 jax.process_count())
    # Start-up phases (name, seconds), logged after the first step.
    self.phases = [("imports, config and devices",
                    time.time() - kda_lm.IMPORTED_AT)]
    mark = time.time()
    mesh = sharding.make_mesh(cfg.mesh)
    sharding.check_batch_shape(mesh, cfg.data.batch_size, cfg.data.seq_len,
                               cfg.train.grad_accum_steps,
                               cfg.train.loss_chunks)
    self.steps = build_steps(cfg, mesh)
    self.phases.append(("model", time.time() - mark))
    self.train_it = None        # The data (`build_data`).
    self.eval_batches = None
    self.evaluated = False
    self.output = _Output(cfg, workdir, start_time, self.is_main)
    self.manager = None
    self.lowered = {}   # The steps traced and lowered, by name.
    self.ahead = None   # Their background compilation.
    self.compiled_ahead = {}   # Its seconds per step.
    self.first_step_parts = []   # Named parts of the first step's time.
    if cfg.checkpoint.enabled:
      self.manager = manager_lib.CheckpointManager(
          workdir_lib.checkpoint_dir(workdir, cfg.checkpoint.directory),
          max_to_keep=cfg.checkpoint.max_to_keep,
          async_save=manager_lib.use_async(cfg.checkpoint.async_save,
                                           self.steps.abstract))
    self.start_step = 0
    self.last_checkpoint = None
    self.best_eval = None
    self.preemption = preemption_lib.Preemption()
    self.save_clock = preemption_lib.SaveClock(cfg.checkpoint.every_seconds)

  def check_finite(self, fetched: list[tuple[int, dict[str, float]]]
                   ) -> None:
    for step, values in fetched:
      if not all(np.isfinite(values[k]) for k in _FINITE if k in values):
        raise _non_finite_error(step, values, self.last_checkpoint)

  def log_startup(self, first_step_s: float) -> None:
    """One line: each start-up phase's seconds, up to the end of the
    first step (whose parts, `first_step_parts`, are named)."""
    parts = list(self.first_step_parts)
    rest = first_step_s - sum(s for _, s in parts)
    phases = list(self.phases) + parts + [
        ("first step" if self.compiled_ahead else
         "first step, compilation included", rest)]
    beside = "".join(f"; {name} compiled in {s:.1f} s in the background"
                     for name, s in self.compiled_ahead.items())
    logging.info("Start-up %.1f s: %s%s%s.", sum(s for _, s in phases),
                 ", ".join(f"{name} {s:.1f} s" for name, s in phases),
                 beside, self.cache_counts.text())

  def build_data(self) -> None:
    """The train iterator and, when the run evaluates, the eval batches."""
    mark = time.time()
    cfg, workdir = self.cfg, self.workdir
    # Process 0 builds the TFDS data; the others then read it.
    with distributed.main_process_first("kda_lm: data built"):
      self.train_it = pipeline.make_train_iterator(cfg.data, workdir=workdir)
    if cfg.eval.every_steps > 0:
      self.eval_batches = pipeline.make_eval_iterator(
          cfg.data, workdir=workdir, num_batches=cfg.eval.num_batches)
    self.phases.append(("data", time.time() - mark))

  def lower_steps(self, latest: int | None) -> None:
    """Traces and lowers the steps (`lowered`), unless the newest
    checkpoint, step `latest`, already reaches `train.num_steps`. With no
    checkpoint (nothing to check first) the state's initialisation is
    lowered too, and each program starts compiling as soon as it is
    lowered."""
    if latest is not None and latest >= self.cfg.train.num_steps:
      return
    mark = time.time()
    for name, lower in ahead_lib.lowerings(
        self.steps, self.cfg.data.batch_size, self.cfg.data.seq_len,
        with_eval=self.cfg.eval.every_steps > 0,
        with_init=latest is None).items():
      self.lowered[name] = lower()
      if latest is None:
        self.compile_ahead(0)
    self.phases.append(("steps traced", time.time() - mark))

  def compile_ahead(self, start_step: int) -> None:
    """Starts compiling each lowered step in the background (`ahead`),
    once, unless `start_step` already reaches `train.num_steps`."""
    if not self.lowered or start_step >= self.cfg.train.num_steps:
      return
    if self.ahead is None:
      self.ahead = ahead_lib.Ahead()
    for name, program in self.lowered.items():
      if not self.ahead.started(name):
        logging.info("Compiling the %s in the background.", name)
        self.ahead.start(name, program.compile)

  def init_state(self) -> TrainState:
    """A fresh state, from its program compiled ahead when there is one
    (waiting for it: a second call would compile it again)."""
    if self.ahead is not None and self.ahead.started(ahead_lib.INIT):
      self.ahead.wait_for(ahead_lib.INIT)
    return self.steps.init(self.steps.rng)

  def wait_for_steps(self) -> None:
    """Waits for the background compilation (re-raising its error)."""
    if self.ahead is not None:
      mark = time.time()
      self.compiled_ahead = self.ahead.wait()
      self.ahead, self.lowered = None, {}   # The programs are kept by JAX.
      self.first_step_parts.append(("compilation after the state",
                                    time.time() - mark))

  def evaluate(self, step: int, state: TrainState) -> bool:
    """Evaluates and logs; True when the run should stop here."""
    start = time.time()
    row = step_lib.evaluate(
        self.steps.eval_step, state.params, iter(self.eval_batches),
        self.steps.batch_sharding, self.cfg.model.vocab_size)
    if not self.evaluated:
      self.evaluated = True
      logging.info("The first eval took %.1f s (its compilation included).",
                   time.time() - start)
    self.output.eval_row(step, row)
    self.best_eval = max(self.best_eval or 0.0, row["eval_accuracy"])
    stop_at = self.cfg.train.stop_at_eval_accuracy
    if stop_at is None or row["eval_accuracy"] < stop_at:
      return False
    self.output.progress.message(
        f"Eval accuracy {row['eval_accuracy']:.4f} >= {stop_at} at step "
        f"{step}: stopping (config.train.stop_at_eval_accuracy).")
    return True

  def checkpoint(self, step: int, state: TrainState,
                 wait: bool = False) -> None:
    """Saves `step` (asynchronously unless `wait`)."""
    if self.manager is not None and self.manager.save(
        step, state, self.train_it, config=self.config_json):
      self.last_checkpoint = step
    if self.manager is not None and wait:
      self.manager.wait_until_finished()
    self.save_clock.saved()

  def preempted(self, step: int) -> preemption_lib.Preempted:
    where = ("nowhere: config.checkpoint.enabled is False"
             if self.manager is None else
             f"{self.manager.directory}/{self.last_checkpoint}")
    return preemption_lib.Preempted(step, where)

  def finish(self, state: TrainState) -> None:
    logging.info("Done at step %d after %.1f s%s.",
                 int(jax.device_get(state.step)),
                 time.time() - self.output.start_time,
                 "" if self.best_eval is None else
                 f"; best eval accuracy {self.best_eval:.4f}")

  def close(self) -> None:
    if self.ahead is not None:
      self.ahead.join()   # No compilation outlives the run.
    self.output.close()
    if self.manager is not None:
      self.manager.close()


def _restore_or_init(run: _Run) -> TrainState:
  """The newest complete checkpoint's state, else a fresh one; records the
  run's config and starts its output at the step it resumes from."""
  manager, changes, state = run.manager, [], None
  latest = manager.latest_step() if manager else None
  if manager and latest is None:
    _refuse_moved_checkpoints(run.workdir, manager.directory)
  run.lower_steps(latest)
  run.build_data()   # While the steps compile (a fresh run's).
  mark = time.time()
  if latest is not None:
    check = _resume_check(run.cfg, run.config_json, changes)

    def on_config(step: int, saved: dict[str, Any] | None) -> bool:
      restore_data = check(step, saved)
      run.compile_ahead(step)   # The checks passed: compile beside restore.
      return restore_data

    state = manager.restore(run.steps.abstract, run.train_it,
                            on_config=on_config)
  if state is not None:
    run.start_step = int(jax.device_get(state.step))
    logging.info("Resuming from the checkpoint of step %d in %s.",
                 run.start_step, manager.directory)
  else:
    if latest is not None:   # Every step failed its checks.
      _refuse_moved_checkpoints(run.workdir, manager.directory)
    if manager:
      logging.info("No checkpoint in %s: starting from scratch.",
                   manager.directory)
    run.compile_ahead(0)
    state = run.init_state()
  run.phases.append((f"state {'restored' if run.start_step else 'built'}",
                     time.time() - mark))
  if run.is_main:
    workdir_lib.write_config(run.workdir, run.config_json,
                             step=run.start_step, changes=changes)
  num_steps = run.cfg.train.num_steps
  if run.start_step >= num_steps:
    logging.info("Nothing to train: the checkpoint is at step %d and "
                 "config.train.num_steps is %d (raise it to train on).",
                 run.start_step, num_steps)
  run.last_checkpoint = manager.latest_step() if manager else None
  run.output.start(num_steps, run.start_step)
  return state


def _train_loop(run: _Run, state: TrainState) -> TrainState:
  """Steps from the restored step to `train.num_steps` (or an early stop)."""
  cfg = run.cfg
  num_steps = cfg.train.num_steps
  window = metrics_lib.Window(
      cfg.data.batch_size * cfg.data.seq_len,
      flops_per_token=run.steps.flops_per_token,
      devices=jax.device_count(),
      peak_flops=flops.peak_flops(jax.devices()[0].device_kind))
  for step in range(run.start_step + 1, num_steps + 1):
    if run.manager is not None:
      run.manager.check_for_errors()   # A failed background save stops here.
    mark = time.time()
    batch = next(run.train_it)
    step_lib.check_batch(batch, cfg.model.vocab_size,
                         f"the batch of step {step}")
    if step == run.start_step + 1:
      run.first_step_parts.append(("first batch", time.time() - mark))
      run.wait_for_steps()
    state, step_metrics = run.steps.update(
        state, sharding.global_batch(batch, run.steps.batch_sharding))
    window.add(step, step_metrics)
    if step == run.start_step + 1:
      run.log_startup(window.time_first_step())
    preempted = run.preemption.reached(step)
    last = step == num_steps or preempted
    do_log = step % cfg.train.log_every == 0 or last
    do_eval = run.eval_batches is not None and not preempted and (
        step % cfg.eval.every_steps == 0 or last)
    do_ckpt = (step % cfg.checkpoint.every_steps == 0 or last
               or (do_log and run.save_clock.due()))
    if not (do_log or do_eval or (do_ckpt and run.manager is not None)):
      continue
    run.check_finite(window.fetch())
    if do_log and window.has_rows():
      # Skipped bad records (`DataIterator.metrics`; stand-in iterators
      # have none).
      data_metrics = getattr(run.train_it, "metrics", dict)()
      run.output.train_row(step, {**window.row(), **data_metrics})
      window.reset()
    with window.paused():
      stop = do_eval and run.evaluate(step, state)
      if do_ckpt or stop:
        run.checkpoint(step, state, wait=preempted)
      run.output.writer.flush()
    if preempted:
      run.finish(state)
      raise run.preempted(step)
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
      (`compat.IncompatibleCheckpointError`), a checkpoint trained
      with different model or data settings
      (`workdir.ConfigChangedError`; see `config.train.allow_config_change`),
      or token ids outside the model vocabulary.
    FloatingPointError: a non-finite loss, gradient or update.
    preemption.Preempted: SIGTERM or SIGINT; the current step was saved.
    workdir.WorkdirLockedError: another live process trains in `workdir`.
    manager.CheckpointSaveError: a checkpoint could not be written.
  """
  start_time = time.time()
  # First: the config checks already touch the backend (impl="auto").
  distributed.initialize(config.get("mesh"))
  config_lib.check_config(config)   # Bad configs fail before any file.
  workdir = os.path.abspath(os.path.expanduser(workdir))
  ahead_lib.use_compilation_cache(config.train.get("compilation_cache", ""),
                                  workdir)
  lock = contextlib.nullcontext()
  if distributed.is_main_process():
    os.makedirs(workdir, exist_ok=True)
    lock = workdir_lib.WorkdirLock(workdir)
  with lock:
    # The BPE tokenizer (built once per data dir) is recorded by path and
    # checksum in the run's config, and so checked on resume.
    with distributed.main_process_first("kda_lm: tokenizer built"):
      config = pipeline.resolve_config(config, workdir,
                                       workdir_lib.read_config(workdir))
    run_config = config_lib.check_config(config)
    run = _Run(config, run_config, workdir, start_time)
    try:
      with run.preemption:
        state = _restore_or_init(run)
        return _train_loop(run, state)
    except Exception as error:
      if distributed.lost_peer(error):
        # Exits at once: closing would wait for the dead process.
        distributed.stop_for_lost_peer(error)
      raise
    finally:
      run.close()
