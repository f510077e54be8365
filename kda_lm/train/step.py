"""The jitted steps of training: the loss, the update and the eval loop.

`make_update_fn` builds `update(state, batch) -> (state, metrics)`: the
loss (`kda_lm.losses`, plus the MTP loss), its gradient, the optimizer
step and the MoE selection-bias update. `evaluate` sums the shared eval
step (`losses.make_eval_step`) over a set of batches. Nothing here reads
files or owns a device: `kda_lm.train.loop` jits and runs these.
"""

from typing import Callable, Iterator, Mapping

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from kda_lm import config as config_lib
from kda_lm import losses
from kda_lm import model as model_lib
from kda_lm.layers import moe
from kda_lm.parallel import sharding
from kda_lm.train import state as state_lib

Batch = Mapping[str, jax.Array]
TrainState = state_lib.TrainState


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


def _denominators(batch: Batch, cfg: config_lib.ModelConfig | None
                  ) -> dict[str, jax.Array]:
  """The whole batch's loss denominators (scored targets, at least 1)."""
  out = {"weight": jnp.maximum(
      batch["loss_mask"].astype(jnp.float32).sum(), 1.0)}
  if cfg is not None and cfg.num_mtp_layers:
    out["mtp_weight"] = losses.mtp_weights(batch, cfg.num_mtp_layers)
  return out


def _loss_fn(model: hk.Transformed, cfg: config_lib.ModelConfig | None,
             loss_chunks: int = 1):
  """`loss(params, batch, denominators) -> (loss, extra)` for
  `jax.value_and_grad`: sums over `batch` divided by the whole batch's
  `denominators`, so that micro-batches' losses add up to the batch's.
  With the model config the head runs inside the loss, in `loss_chunks`
  pieces, each device on its own rows (`kda_lm.losses`); without it the
  loss reads the model's logits."""
  with_aux = cfg is not None and cfg.has_aux_outputs
  chunked = cfg is not None
  if loss_chunks > 1 and cfg is None:
    raise ValueError("config.train.loss_chunks > 1 needs the model config.")

  def loss_fn(params, batch, denominators):
    out = losses.apply_batch(model, params, batch, return_aux=with_aux,
                             logits=not chunked)
    out, aux = out if with_aux else (out, {})
    head = model_lib.head_weight(cfg, params) if chunked else None
    loss_sum, correct, _ = losses.loss_terms(out, batch, head, loss_chunks)
    loss = loss_sum / denominators["weight"]
    extra = {"accuracy": correct / denominators["weight"], "main_loss": loss}
    mtp_out = aux.get("mtp_hidden" if chunked else "mtp_logits")
    if mtp_out is not None:
      extra["mtp_loss"] = losses.mtp_loss(
          mtp_out, batch, denominators["mtp_weight"], head, loss_chunks)
      loss = loss + cfg.mtp_loss_scale * extra["mtp_loss"]
    if "expert_load" in aux:
      extra["expert_load"] = jax.lax.stop_gradient(aux["expert_load"])
    return loss, extra

  return loss_fn


def micro_batches(batch: Batch, n: int) -> Batch:
  """`[B,...]` -> `[n, B/n, ...]`; micro-batch i holds rows i, i+n, ...

  Strided, so that each device's rows (a contiguous block of the batch
  sharding) split evenly over the micro-batches and no row moves.
  """
  return jax.tree.map(
      lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1),
      batch)


def _grads_and_extra(loss_fn, params, batch: Batch, n: int, denominators):
  """Gradients and statistics of the whole batch, in `n` micro-batches
  (summed: each micro-batch's loss is already divided by the batch's
  denominators)."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if n == 1:
    (_, extra), grads = grad_fn(params, batch, denominators)
    return grads, extra
  micro = micro_batches(batch, n)

  def body(total, mb):
    (_, extra), grads = grad_fn(params, mb, denominators)
    return jax.tree.map(jnp.add, total, (grads, extra)), None

  first = jax.tree.map(lambda x: x[0], micro)
  shapes = jax.eval_shape(lambda p, b: grad_fn(p, b, denominators)[::-1],
                          params, first)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                       (shapes[0], shapes[1][1]))
  (grads, extra), _ = jax.lax.scan(body, zeros, micro)
  return grads, extra


def make_update_fn(model: hk.Transformed, tx: optax.GradientTransformation,
                   schedule: optax.Schedule,
                   model_config: config_lib.ModelConfig | None = None,
                   grad_accum_steps: int = 1, loss_chunks: int = 1,
                   update_norm: bool = False
                   ) -> Callable[[TrainState, Batch],
                                 tuple[TrainState, dict[str, jax.Array]]]:
  """Returns `update(state, batch) -> (state, metrics)` (not jitted).

  With a MoE or MTP `model_config`: the loss adds `mtp_loss_scale` times
  the MTP loss (logged as `mtp_loss`; `loss` stays the main loss), and after
  the optimizer step every MoE selection bias is set by
  `moe.update_selection_biases`; metrics add the load balance
  (`moe.load_metrics`). With `grad_accum_steps` n > 1 the batch runs as n
  micro-batches (`micro_batches`); the loss, gradients, metrics and expert
  loads are the whole batch's (token-weighted sums, not means of means).
  With `model_config` the LM head runs inside the loss, each device on its
  own rows, over `loss_chunks` strided pieces of them, the gradient made
  in the loss's own pass (`config.train.loss_chunks`, `kda_lm.losses`).
  Metrics: `loss`, `accuracy`, `grad_norm`, `lr`, and `update_norm` (the
  global norm of the optimizer's update) with `update_norm` set
  (`config.train.log_update_norm`: a pass over every update of its own).

  Args:
    model: the built model (`kda_lm.model.build`).
    tx: the optimizer.
    schedule: its learning rate per step (logged as `lr`).
    model_config: the model's settings, typed (`RunConfig.model`); None
      for a model that is not `kda_lm.model`'s (the LM head then runs
      inside `model.apply`).
    grad_accum_steps: micro-batches per step.
    loss_chunks: strided pieces of each row the LM head and the loss run
      over (`config.train.loss_chunks`; > 1 needs `model_config`).
    update_norm: also log `update_norm`.
  """
  has_moe = model_config is not None and model_config.num_experts > 0
  bias_slots = model_lib.router_bias_slots(model_config) if has_moe else []
  loss_fn = _loss_fn(model, model_config, loss_chunks)

  def update(state: TrainState, batch: Batch):
    grads, extra = _grads_and_extra(loss_fn, state.params, batch,
                                    grad_accum_steps,
                                    _denominators(batch, model_config))
    with jax.named_scope("optimizer"):    # Names the ops in profiles.
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
    if bias_slots:
      params = moe.update_selection_biases(
          params, state.params, extra["expert_load"], bias_slots,
          float(model_config.router_bias_update_rate))
    rng, _ = jax.random.split(state.rng)
    metrics = {
        "loss": extra["main_loss"],
        "accuracy": extra["accuracy"],
        "grad_norm": optax.global_norm(grads),
        "lr": jnp.asarray(schedule(state.step), jnp.float32),
    }
    if update_norm:
      metrics["update_norm"] = optax.global_norm(updates)
    if "mtp_loss" in extra:
      metrics["mtp_loss"] = extra["mtp_loss"]
    if "expert_load" in extra:
      metrics.update(moe.load_metrics(extra["expert_load"]))
    return TrainState(params, opt_state, rng, state.step + 1), metrics

  return update


def evaluate(eval_step: Callable[..., jax.Array], params: hk.Params,
             batches: Iterator[Mapping[str, np.ndarray]],
             batch_sharding: jax.sharding.NamedSharding, vocab_size: int
             ) -> dict[str, float]:
  """Loss and accuracy over the `loss_mask` positions of `batches`.

  Args:
    eval_step: the jitted `losses.make_eval_step` function.
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
  loss_sum, correct, weight, _ = (float(x) for x in jax.device_get(total))
  denom = max(weight, 1.0)
  return {"eval_loss": loss_sum / denom, "eval_accuracy": correct / denom,
          "eval_tokens": weight}
