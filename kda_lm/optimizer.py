"""The optimizer: AdamW with warmup, cosine decay, clipping, and the one
weight-decay rule.

  tx, schedule = optimizer.make_optimizer(config.opt, config.train.num_steps)
"""

from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from kda_lm import config as config_lib
from kda_lm import stack

# Parameters that never get weight decay, by name, besides all < 2-D arrays
# and everything under a module whose name contains "norm": KDA's gate
# parameters (FLA's `_no_weight_decay`), biases and norm scales.
NO_DECAY_NAMES = ("A_log", "dt_bias", "b", "bias", "scale", "offset")


def weight_decay_mask(params: hk.Params) -> hk.Params:
  """True for parameters that get weight decay (the only such rule).

  Decayed: arrays of rank >= 2 whose name is not in `NO_DECAY_NAMES` and
  whose module path has no "norm" (embeddings, projections, conv kernels,
  experts). Not decayed: norms, biases, `A_log`, `dt_bias`, MoE selection
  biases. A scanned group's parameters (`stack.is_stacked`) are ranked
  without their repeat axis, so the mask does not depend on the layout.

  Args:
    params: a Haiku parameter dict (or its abstract shapes).

  Returns:
    A tree of bools like `params`.
  """
  def decay(module: str, name: str, p: Any) -> bool:
    rank = len(p.shape) - stack.is_stacked(module)
    return (rank >= 2 and name not in NO_DECAY_NAMES
            and "norm" not in module.lower())
  return hk.data_structures.map(decay, params)


def scale_by_adam(b1: float, b2: float, eps: float, moment_dtype: Any
                  ) -> optax.GradientTransformation:
  """Adam's scaling (`optax.scale_by_adam`, same state type) with both
  moments stored in `moment_dtype`; each update is computed in float32
  from them and the gradient, then cast to the gradient's dtype."""

  def init(params):
    zeros = lambda p: jnp.zeros(p.shape, moment_dtype)
    return optax.ScaleByAdamState(
        count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params),
        nu=jax.tree.map(zeros, params))

  def update(updates, state, params=None):
    del params
    f32 = lambda x: x.astype(jnp.float32)
    count = optax.safe_int32_increment(state.count)
    mu = jax.tree.map(lambda g, m: b1 * f32(m) + (1 - b1) * f32(g),
                      updates, state.mu)
    nu = jax.tree.map(lambda g, v: b2 * f32(v) + (1 - b2) * f32(g)**2,
                      updates, state.nu)
    c1, c2 = 1 - b1**f32(count), 1 - b2**f32(count)
    out = jax.tree.map(
        lambda g, m, v: (m / c1 / (jnp.sqrt(v / c2) + eps)).astype(g.dtype),
        updates, mu, nu)
    cast = lambda t: jax.tree.map(lambda x: x.astype(moment_dtype), t)
    return out, optax.ScaleByAdamState(count, cast(mu), cast(nu))

  return optax.GradientTransformation(init, update)


def make_optimizer(opt_config: Any, num_steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with linear warmup, cosine decay and global-norm clipping;
  its moments in `opt.moment_dtype` (`scale_by_adam` when not float32).

  Args:
    opt_config: `config.opt` (a ConfigDict or `kda_lm.config.OptConfig`).
    num_steps: `config.train.num_steps` (the default decay length).

  Returns:
    (optimizer, learning-rate schedule of the 0-based step).

  Raises:
    ValueError: a bad `config.opt`.
  """
  opt = config_lib.from_config(config_lib.OptConfig, opt_config, "opt")
  decay_steps = opt.decay_steps or num_steps
  warmup = int(opt.warmup_steps)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=float(opt.peak_lr),
      warmup_steps=warmup, decay_steps=max(int(decay_steps), warmup + 1),
      end_value=float(opt.peak_lr) * float(opt.end_lr_ratio))
  parts = []
  if opt.clip_norm and opt.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(float(opt.clip_norm)))
  b1, b2, eps = float(opt.b1), float(opt.b2), float(opt.eps)
  if opt.moment_dtype == "float32":
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps,
                             weight_decay=float(opt.weight_decay),
                             mask=weight_decay_mask))
  else:   # optax.adamw's chain (same state tree), moments in moment_dtype.
    parts.append(optax.chain(
        scale_by_adam(b1, b2, eps, jnp.dtype(opt.moment_dtype)),
        optax.add_decayed_weights(float(opt.weight_decay), weight_decay_mask),
        optax.scale_by_learning_rate(schedule)))
  return optax.chain(*parts), schedule
