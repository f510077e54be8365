"""configs/ling3.py: the published Ling 3.0 shapes and parameter counts.

Counts come from `jax.eval_shape` (nothing is allocated). Conventions (see
`configs/ling3.py`): total = the main model with embedding and LM head, MTP
layers excluded; activated = total minus the non-selected routed experts
and minus the input embedding table (the LM head counts).
"""

import functools

import numpy as np
import pytest

from configs import ling3
from kda_lm import config, model

PUBLISHED = {"tiny": (7.9e9, 1.3e9), "flash": (125e9, 5.1e9)}


@functools.lru_cache(maxsize=None)
def _counts(size):
  return ling3.count_params(ling3.model_config(size))


@pytest.mark.parametrize("size", ["tiny", "flash"])
def test_total_params_within_2_percent(size):
  total, _ = PUBLISHED[size]
  c = _counts(size)
  assert abs(c["total"] / total - 1) < 0.02, c
  # eval_shape agrees with the shape arithmetic of kda_lm.model.
  assert c["total"] + c["mtp"] == model.param_count(
      config.ModelConfig.from_config(ling3.model_config(size)))


def test_flash_activated_within_2_percent():
  c = _counts("flash")
  assert abs(c["activated"] / PUBLISHED["flash"][1] - 1) < 0.02, c
  # The MTP layer (MLA + MoE + eh_proj) is ~3.1B, ~0.1B of it activated.
  assert 2.9e9 < c["mtp"] < 3.2e9 and 0.05e9 < c["mtp_activated"] < 0.15e9


def test_tiny_activated_known_gap():
  # Ling-3.0-tiny's model-card 1.3B activated is NOT reproduced from its
  # config under the convention that reproduces flash's 5.1B: it gives 1.14B
  # (-12%; SGLang's cookbook says "~1.2B active"); counting the input
  # embedding too gives 1.38B (+6%). See configs/ling3.py. Pinned here so
  # that a shape change shows up.
  c = _counts("tiny")
  assert 1.13e9 < c["activated"] < 1.15e9, c
  emb = 157184 * 1536
  assert 1.37e9 < c["activated"] + emb < 1.39e9


def test_shapes_match_the_published_models():
  t = config.ModelConfig.from_config(ling3.model_config("tiny"))
  f = config.ModelConfig.from_config(ling3.model_config("flash"))
  assert t.attention_pattern == "KKKM" * 6
  assert f.attention_pattern == "KKKKKM" * 7
  for cfg, d, h, q, e, fk, ffn, dense, mtp in (
      (t, 1536, 16, 256, 128, 1, 512, 4608, 0),
      (f, 2560, 32, 0, 512, 2, 768, 6144, 1)):
    assert (cfg.d_model, cfg.num_heads, cfg.head_dim,
            cfg.q_lora_rank, cfg.kv_lora_rank) == (d, h, 128, q, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
            cfg.v_head_dim) == (128, 64, 128)
    assert (cfg.num_experts, cfg.num_experts_per_tok,
            cfg.num_shared_experts, cfg.moe_intermediate_size) == (
                e, 8, 1, ffn)
    assert (cfg.first_k_dense_replace, cfg.mlp_hidden_dim,
            cfg.num_mtp_layers) == (fk, dense, mtp)
    assert cfg.vocab_size == 157184 and cfg.kda_gate == "ling"
    assert cfg.mla_output_gate and not cfg.use_nope
    assert cfg.routed_scaling_factor == 2.5
    assert (cfg.n_group, cfg.topk_group) == (8, 4)
  with pytest.raises(ValueError, match="Unknown Ling 3.0 size"):
    ling3.model_config("huge")
  flash = ling3.get_config("flash")
  assert np.isclose(flash.model.rope_theta, 6e6)
