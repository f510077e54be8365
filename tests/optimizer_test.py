"""Tests of kda_lm/optimizer.py: the weight-decay rule and the schedule."""

import numpy as np

from configs import ling3_tiny
from kda_lm import config, optimizer


def test_weight_decay_mask():
  params = {
      "layer_0/attn_norm": {"weight": np.ones(4)},
      "layer_0/kda": {"A_log": np.ones(2), "dt_bias": np.ones(8)},
      "layer_0/kda/q_proj": {"w": np.ones((4, 4)), "b": np.ones(4)},
      "layer_0/kda/q_conv1d": {"weight": np.ones((4, 4))},
      "embed": {"embeddings": np.ones((8, 4))},
  }
  mask = optimizer.weight_decay_mask(params)
  assert mask == {
      "layer_0/attn_norm": {"weight": False},
      "layer_0/kda": {"A_log": False, "dt_bias": False},
      "layer_0/kda/q_proj": {"w": True, "b": False},
      "layer_0/kda/q_conv1d": {"weight": True},
      "embed": {"embeddings": True},
  }


def test_schedule_warmup_cosine_and_typed_config():
  opt = config.OptConfig(peak_lr=1.0, warmup_steps=4, end_lr_ratio=0.1)
  _, schedule = optimizer.make_optimizer(opt, num_steps=20)
  np.testing.assert_allclose([schedule(0), schedule(2), schedule(4)],
                             [0.0, 0.5, 1.0], rtol=1e-6)
  np.testing.assert_allclose(schedule(20), 0.1, rtol=1e-5)
  # The ConfigDict section gives the same schedule.
  _, from_dict = optimizer.make_optimizer(ling3_tiny.get_config().opt, 400)
  _, typed = optimizer.make_optimizer(config.OptConfig(), 400)
  for step in (0, 10, 50, 399):
    assert from_dict(step) == typed(step)
