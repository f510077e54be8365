"""The optimizer: AdamW with warmup, cosine decay, clipping, and the one
weight-decay rule.

  tx, schedule = optimizer.make_optimizer(config.opt, config.train.num_steps)
"""

from typing import Any

import haiku as hk
import optax

from kda_lm import config as config_lib

# Parameters that never get weight decay, by name, besides all < 2-D arrays
# and everything under a module whose name contains "norm": KDA's gate
# parameters (FLA's `_no_weight_decay`), biases and norm scales.
NO_DECAY_NAMES = ("A_log", "dt_bias", "b", "bias", "scale", "offset")


def weight_decay_mask(params: hk.Params) -> hk.Params:
  """True for parameters that get weight decay (the only such rule).

  Decayed: arrays of rank >= 2 whose name is not in `NO_DECAY_NAMES` and
  whose module path has no "norm" (embeddings, projections, conv kernels,
  experts). Not decayed: norms, biases, `A_log`, `dt_bias`, MoE selection
  biases.

  Args:
    params: a Haiku parameter dict (or its abstract shapes).

  Returns:
    A tree of bools like `params`.
  """
  def decay(module: str, name: str, p: Any) -> bool:
    return (len(p.shape) >= 2 and name not in NO_DECAY_NAMES
            and "norm" not in module.lower())
  return hk.data_structures.map(decay, params)


def make_optimizer(opt_config: Any, num_steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with linear warmup, cosine decay and global-norm clipping.

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
  parts.append(optax.adamw(
      schedule, b1=float(opt.b1), b2=float(opt.b2), eps=float(opt.eps),
      weight_decay=float(opt.weight_decay), mask=weight_decay_mask))
  return optax.chain(*parts), schedule
