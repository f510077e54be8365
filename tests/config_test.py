"""Tests of kda_lm/config.py: typed sections, defaults and key checks."""

import dataclasses

import ml_collections
import pytest

from configs import ling3_tiny
from kda_lm import config
from kda_lm.layers import rope


def test_config_dict_round_trip_gives_the_defaults():
  for cls in (config.OptConfig, config.TrainConfig, config.EvalConfig,
              config.CheckpointConfig, config.MeshConfig):
    section = config.config_dict(cls)
    assert set(section.keys()) == set(config.field_names(cls))
    assert config.from_config(cls, section, "x", required=True) == cls()


def test_model_config_resolves_none_defaults():
  m = config.ModelConfig.from_config(ling3_tiny.model_config())
  assert m.kda_head_v_dim == m.head_dim == 32
  assert m.mla_num_heads == m.num_heads == 4
  assert m.moe_intermediate_size == 128 and m.embed_init_std == 1.0
  assert [m.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
  with pytest.raises(dataclasses.FrozenInstanceError):
    m.d_model = 64  # type: ignore[misc]
  # Only what differs from the defaults is set: a dense model with no
  # expert width keeps None.
  dense = config.ModelConfig.from_config(dict(
      vocab_size=8, d_model=8, attention_pattern="K", num_heads=1,
      head_dim=8, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=4,
      v_head_dim=4, mlp_hidden_dim=8))
  assert dense.moe_intermediate_size is None and not dense.has_aux_outputs


@pytest.mark.parametrize("key,value,match", [
    ("d_model", 0, "model.d_model must be a positive int"),
    ("num_experts", -1, "model.num_experts must be an int >= 0"),
    ("mtp_layer_kind", "X", "model.mtp_layer_kind"),
    ("norm_eps", 0.0, "norm_eps"),
    ("param_dtype", "int8", "model.param_dtype"),
    ("mla_norm_eps", -1.0, "mla_norm_eps"),
    ("kda_lower_bound", -6.0, "model.kda_lower_bound"),
])
def test_model_config_errors_name_the_field(key, value, match):
  values = ling3_tiny.model_config()
  values[key] = value
  with pytest.raises(ValueError, match=match):
    config.ModelConfig.from_config(values)


def test_unknown_and_missing_keys():
  values = ling3_tiny.model_config()
  values.d_modell = 3
  with pytest.raises(ValueError, match=r"config\.model\.d_modell"):
    config.ModelConfig.from_config(values)
  with pytest.raises(ValueError, match="lacks the required key 'd_model'"):
    config.ModelConfig.from_config({"vocab_size": 8})
  opt = config.config_dict(config.OptConfig)
  del opt["b1"]
  with pytest.raises(ValueError, match=r"Missing config keys.*b1"):
    config.from_config(config.OptConfig, opt, "opt", required=True)
  with pytest.raises(ValueError, match="must be a ConfigDict"):
    config.from_config(config.OptConfig, 3, "opt")


def test_section_errors():
  with pytest.raises(ValueError, match="train.num_steps"):
    config.TrainConfig(num_steps=0)
  with pytest.raises(ValueError, match="eval.every_steps"):
    config.EvalConfig(every_steps=-1)
  with pytest.raises(ValueError, match="checkpoint.every_steps"):
    config.CheckpointConfig(every_steps=0)
  with pytest.raises(ValueError, match="peak_lr"):
    config.OptConfig(peak_lr=-1.0)


def test_command_line_style_override_of_a_none_field():
  c = ling3_tiny.get_config()
  c.lock()
  c.model.kda_head_v_dim = 16        # a typed FieldReference(None) field
  c.opt.decay_steps = 100
  assert config.ModelConfig.from_config(c.model).kda_head_v_dim == 16
  with pytest.raises(AttributeError):
    c.model.not_a_field = 1
  assert isinstance(c.model, ml_collections.ConfigDict)


def test_checkpoint_every_seconds_is_none_or_positive():
  assert config.CheckpointConfig().every_seconds is None
  assert config.CheckpointConfig(every_seconds=0.5).every_seconds == 0.5
  for bad in (0, -1.0, True, "60"):
    with pytest.raises(ValueError, match="every_seconds must be None or a "
                       "number > 0"):
      config.CheckpointConfig(every_seconds=bad)


def test_checkpoint_directory_is_none_or_a_path():
  assert config.CheckpointConfig().directory is None
  for good in ("gs://bucket/run", "/tmp/ckpts", "ckpts"):
    assert config.CheckpointConfig(directory=good).directory == good
  for bad in ("", "  ", 3):
    with pytest.raises(ValueError, match="directory must be None or a path "
                       "or URL"):
      config.CheckpointConfig(directory=bad)


def test_rope_scaling_is_a_sub_section():
  """`model.rope_scaling` is a nested ConfigDict, read into a RopeScaling;
  its errors name the field."""
  c = ling3_tiny.get_config()
  c.lock()
  assert config.ModelConfig.from_config(c.model).rope_scaling == (
      rope.RopeScaling())
  c.model.rope_scaling.type = "yarn"          # As --config.model.rope_...
  c.model.rope_scaling.factor = 4.0
  c.model.rope_scaling.original_max_position_embeddings = 4096
  c.model.rope_scaling.mscale_all_dim = 1.0
  m = config.ModelConfig.from_config(c.model)
  assert m.rope_scaling == rope.RopeScaling(
      type="yarn", factor=4.0, original_max_position_embeddings=4096,
      mscale_all_dim=1.0)
  assert config.ModelConfig.from_config(c.model.to_dict()) == m
  # A nested update with another config's sub-section (no None fields).
  other = ling3_tiny.model_config()
  other.update(dict(c.model))
  assert config.ModelConfig.from_config(other) == m
  c.model.rope_scaling.original_max_position_embeddings = 0
  with pytest.raises(ValueError, match="original_max_position_embeddings"):
    config.ModelConfig.from_config(c.model)
  values = ling3_tiny.model_config()
  values.rope_scaling.typ = "yarn"
  with pytest.raises(ValueError, match=r"config\.model\.rope_scaling\.typ"):
    config.ModelConfig.from_config(values)
  values = ling3_tiny.model_config()
  values.rope_scaling.type, values.use_nope = "yarn", True
  values.rope_scaling.original_max_position_embeddings = 64
  with pytest.raises(ValueError, match="needs RoPE, and use_nope is set"):
    config.ModelConfig.from_config(values)
