"""Tests of kda_lm/hf/formats.py: a `config.json` <-> kda-lm's `model`
section, on the fixtures' configs (tests/testdata/hf) and edits of them;
no model is built."""

import dataclasses
import json
import os

import process_support
import pytest

from kda_lm import config
from kda_lm.hf import formats, mapping
from kda_lm.ops.kda import common as kda_common

FIXTURES = os.path.join(process_support.REPO, "tests", "testdata", "hf")
FIXTURE_TYPES = {"bailing_hybrid": mapping.BAILING,
                 "kimi_linear": mapping.KIMI,
                 "bailing_hybrid_yarn": mapping.BAILING,
                 "kimi_linear_bias": mapping.KIMI,
                 "bailing_hybrid_clamp": mapping.BAILING,
                 "export_bytes_bailing_hybrid": mapping.BAILING,
                 "export_bytes_kimi_linear": mapping.KIMI,
                 "export_bpe_bailing_hybrid": mapping.BAILING}
# Only the fields a Ling config.json must have; every other one takes its
# default.
MINIMAL = dict(model_type="bailing_hybrid", vocab_size=32, hidden_size=16,
               num_hidden_layers=6, num_attention_heads=2,
               linear_head_dim=8, kv_lora_rank=8, qk_nope_head_dim=4,
               qk_rope_head_dim=4, v_head_dim=4, intermediate_size=24,
               num_experts=4, moe_intermediate_size=8,
               num_experts_per_token=2)


def fixture_config(name):
  """The fixture's parsed `config.json`."""
  with open(os.path.join(FIXTURES, name, "config.json")) as f:
    return json.load(f)


def typed(hf_config, **kwargs):
  return config.ModelConfig.from_config(formats.from_hf(hf_config,
                                                        **kwargs))


def rope_change(**rope_parameters):
  """A config change: the YaRN fixture's `rope_parameters` updated."""
  rope = dict(fixture_config("bailing_hybrid_yarn")["rope_parameters"])
  rope.update(rope_parameters)
  return {"rope_parameters": {k: v for k, v in rope.items()
                              if v is not None}}


@pytest.mark.parametrize("name", FIXTURE_TYPES)
def test_export_gives_back_the_fixtures_fields(name):
  """`to_hf(from_hf(c))` writes each field of `c` it writes at all with
  `c`'s value, and reads back as the same config."""
  original = fixture_config(name)
  cfg = typed(original)
  model_type = original["model_type"]   # read from JSON: not interned
  assert model_type == FIXTURE_TYPES[name]
  assert formats.guess_model_type(cfg) == model_type
  exported = formats.to_hf(cfg, model_type)
  differ = {k: (v, original[k]) for k, v in exported.items()
            if k in original and original[k] != v}
  assert not differ, differ
  assert exported["model_type"] == model_type
  for key in ("attention_bias", "rope_parameters", "linear_attn_config"):
    assert (key in exported) == (key in original), key
  assert typed(exported) == cfg


def test_the_ling_fixtures_fields_are_read():
  m = formats.from_hf(fixture_config("bailing_hybrid"))
  want = dict(vocab_size=64, d_model=16, num_heads=2, mla_num_heads=2,
              head_dim=8, conv_size=4, kv_lora_rank=8, q_lora_rank=8,
              qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
              mlp_hidden_dim=24, norm_eps=1e-6, mla_norm_eps=1e-6,
              rope_theta=10000.0, mla_bias=False, use_nope=False,
              mla_output_gate=True, kda_gate="ling", kda_lower_bound=-5.0,
              num_experts=4, moe_intermediate_size=8, num_experts_per_tok=2,
              num_shared_experts=1, first_k_dense_replace=1,
              routed_scaling_factor=2.5, n_group=2, topk_group=1,
              moe_renormalize=True, expert_swiglu_limits=(),
              shared_swiglu_limits=(), param_dtype="float32",
              attention_pattern="KKKMKKKM")
  assert {k: m[k] for k in want} == want
  assert m.rope_scaling.type == "none"


def test_the_kimi_fixtures_fields_are_read():
  """Kimi's `linear_attn_config` comes before the top-level fields."""
  hf_config = fixture_config("kimi_linear")
  hf_config.update(linear_num_heads=8, linear_head_dim=2,
                   linear_conv_kernel_dim=2, short_conv_kernel_size=2)
  m = formats.from_hf(hf_config)
  want = dict(num_heads=2, head_dim=8, conv_size=4, q_lora_rank=0,
              norm_eps=1e-5, mla_norm_eps=1e-6, use_nope=True,
              mla_output_gate=False, kda_gate="kimi",
              attention_pattern="KKKMKKKM")
  assert {k: m[k] for k in want} == want


def test_missing_fields_take_their_defaults():
  m = formats.from_hf(MINIMAL)
  want = dict(attention_pattern="KKKKKM", num_heads=2, mla_num_heads=2,
              head_dim=8, conv_size=4, q_lora_rank=0, norm_eps=1e-6,
              mla_norm_eps=1e-6, rope_theta=10000.0, mla_bias=False,
              kda_lower_bound=kda_common.GATE_FLOOR, num_shared_experts=0,
              first_k_dense_replace=0, routed_scaling_factor=1.0,
              n_group=1, topk_group=1, moe_renormalize=True,
              expert_swiglu_limits=(), shared_swiglu_limits=(),
              param_dtype="float32")
  assert {k: m[k] for k in want} == want
  assert m.rope_scaling.type == "none"
  kimi = dict(MINIMAL, model_type="kimi_linear",
              linear_attn_config={"full_attn_layers": [2, 6]})
  assert formats.from_hf(kimi).attention_pattern == "KMKKKM"


def test_the_second_spelling_of_each_field_is_read():
  """transformers' aliases; where both are given the first is read."""
  hf_config = {k: v for k, v in MINIMAL.items() if k not in (
      "num_experts", "num_experts_per_token", "linear_head_dim")}
  hf_config.update(num_local_experts=8, num_experts_per_tok=3,
                   n_shared_experts=2, n_group=4, topk_group=2,
                   norm_topk_prob=False, torch_dtype="bfloat16",
                   head_dim=6, short_conv_kernel_size=3,
                   rope_scaling={"rope_theta": 50.0})
  m = formats.from_hf(hf_config)
  want = dict(num_experts=8, num_experts_per_tok=3, num_shared_experts=2,
              n_group=4, topk_group=2, moe_renormalize=False,
              param_dtype="bfloat16", head_dim=6, conv_size=3,
              rope_theta=50.0)
  assert {k: m[k] for k in want} == want
  hf_config.update(num_experts=4, num_experts_per_token=2,
                   num_shared_experts=1, num_expert_group=2,
                   moe_renormalize=True, dtype="float16", linear_head_dim=8,
                   linear_conv_kernel_dim=2, linear_num_heads=2,
                   rope_parameters={"rope_theta": 20.0}, rope_theta=30.0)
  m = formats.from_hf(hf_config)
  want = dict(num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
              n_group=2, moe_renormalize=True, param_dtype="float16",
              head_dim=8, conv_size=2, rope_theta=20.0)
  assert {k: m[k] for k in want} == want
  del hf_config["rope_parameters"], hf_config["rope_scaling"]
  assert formats.from_hf(hf_config).rope_theta == 30.0
  hf_config["dtype"] = None   # a null is not given
  assert formats.from_hf(hf_config).param_dtype == "bfloat16"


@pytest.mark.parametrize("field", [
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "linear_head_dim", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "intermediate_size", "num_experts",
    "moe_intermediate_size", "num_experts_per_token"])
def test_missing_required_fields_are_named(field):
  hf_config = dict(MINIMAL)
  del hf_config[field]
  with pytest.raises(ValueError, match=f"lacks the field '{field}'"):
    formats.from_hf(hf_config)
  with pytest.raises(ValueError, match=f"lacks the field '{field}'"):
    formats.from_hf(dict(MINIMAL, **{field: None}))


def test_parameter_dtype():
  hf_config = fixture_config("bailing_hybrid")
  assert formats.from_hf(hf_config, dtype="bfloat16").param_dtype == (
      "bfloat16")
  for dtype in ("float32", "bfloat16", "float16"):
    assert formats.from_hf(dict(hf_config, dtype=dtype)).param_dtype == dtype
  with pytest.raises(ValueError, match="parameter dtype 'int8'"):
    formats.from_hf(hf_config, dtype="int8")
  with pytest.raises(ValueError, match="parameter dtype 'float64'"):
    formats.from_hf(dict(hf_config, dtype="float64"))
  with pytest.raises(TypeError):   # keyword-only
    formats.from_hf(hf_config, "bfloat16")


@pytest.mark.parametrize("model_type", [None, "llama", "bailing_moe"])
def test_unknown_model_types_are_refused(model_type):
  with pytest.raises(ValueError, match=f"'model_type' is {model_type!r}"):
    formats.model_type_of(dict(MINIMAL, model_type=model_type))
  with pytest.raises(ValueError, match=f"'model_type' is {model_type!r}"):
    formats.from_hf(dict(MINIMAL, model_type=model_type))


@pytest.mark.parametrize("field,value", [
    ("tie_word_embeddings", True), ("hidden_act", "gelu"),
    ("pretraining_tp", 2), ("num_key_value_heads", 1),
    ("kda_safe_gate", False)])
def test_checked_fields_refuse_other_values(field, value):
  hf_config = dict(fixture_config("bailing_hybrid"), **{field: value})
  with pytest.raises(ValueError, match=f"field '{field}' is {value!r}"):
    formats.from_hf(hf_config)
  hf_config[field] = None   # absent: accepted
  formats.from_hf(hf_config)


def test_checked_fields_accept_kda_lms_values():
  hf_config = dict(fixture_config("bailing_hybrid"), num_attention_heads=4,
                   num_key_value_heads=4, linear_num_heads=4)
  assert formats.from_hf(hf_config).mla_num_heads == 4
  hf_config.update(tie_word_embeddings=False, hidden_act="silu",
                   kda_safe_gate=True, pretraining_tp=1)
  formats.from_hf(hf_config)


def test_every_config_field_is_modelled_checked_or_ignored():
  """Each field of transformers' two config classes (recorded by
  experiments/make_hf_fixtures.py) and of every fixture's config.json is
  in exactly one of formats' lists; a field a new transformers adds fails
  here until it is placed."""
  with open(os.path.join(FIXTURES, "config_fields.json")) as f:
    recorded = json.load(f)
  fields = set(recorded["bailing_hybrid"]) | set(recorded["kimi_linear"])
  for name in FIXTURE_TYPES:
    fields |= set(fixture_config(name))
  lists = [formats.MODELLED, set(formats.CHECKED), set(formats.IGNORED)]
  for field in sorted(fields):
    homes = [i for i, names in enumerate(lists) if field in names]
    assert len(homes) == 1, (field, homes)
  assert all(reason for reason in formats.IGNORED.values())


@pytest.mark.parametrize("change,match", [
    ({"tie_word_embeddings": True}, "'tie_word_embeddings' is True"),
    *[(rope_change(rope_type=t), f"'rope_parameters.rope_type' is '{t}'")
      for t in ("linear", "dynamic", "longrope", "llama3", "custom",
                "yarn_v2")],
    ({"rope_parameters": None,
      "rope_scaling": {"type": "linear", "factor": 2.0}},
     "'rope_parameters.rope_type' is 'linear'"),
    (rope_change(partial_rotary_factor=0.5),
     "'rope_parameters.partial_rotary_factor' is 0.5"),
    ({**rope_change(), "partial_rotary_factor": 0.5},
     "'rope_parameters.partial_rotary_factor' is 0.5"),
    (rope_change(partial_rotary_factor=2.0),
     "'rope_parameters.partial_rotary_factor' is 2.0"),
    (rope_change(factor=None), "lacks the field 'rope_parameters.factor'"),
    (rope_change(factor=0.0), "rope_scaling.factor must be > 0"),
    (rope_change(attention_factor=0.0),
     "'rope_parameters.attention_factor' is 0.0"),
    (rope_change(attention_factor=-1.0),
     "'rope_parameters.attention_factor' is -1.0"),
])
def test_bad_configs_are_named(change, match):
  hf_config = fixture_config("bailing_hybrid")
  hf_config.update(change)
  with pytest.raises(ValueError, match=match):
    formats.from_hf(hf_config)


def test_yarn_is_read_as_transformers_reads_it():
  """The YaRN fields, their defaults, and `original_max_position_embeddings`
  (top-level field first, then rope_parameters', then the model's
  length)."""
  hf_config = fixture_config("bailing_hybrid_yarn")
  m = formats.from_hf(hf_config)
  assert m.mla_bias and m.rope_theta == 10.0
  want = dict(type="yarn", factor=4.0, original_max_position_embeddings=16,
              beta_fast=2.0, beta_slow=0.5, truncate=False,
              attention_factor=0.0, mscale=2.0, mscale_all_dim=1.0)
  assert m.rope_scaling.to_dict() == want
  hf_config["original_max_position_embeddings"] = 32
  hf_config.update(rope_change(beta_fast=None, beta_slow=None, truncate=None,
                               mscale=None, attention_factor=1.25))
  rs = formats.from_hf(hf_config).rope_scaling
  assert (rs.original_max_position_embeddings, rs.beta_fast, rs.beta_slow,
          rs.truncate, rs.mscale, rs.attention_factor) == (
              32, 32.0, 1.0, True, 0.0, 1.25)
  hf_config.update(rope_change(attention_factor=0.5,
                               partial_rotary_factor=1.0))
  assert formats.from_hf(hf_config).rope_scaling.attention_factor == 0.5
  del hf_config["original_max_position_embeddings"]
  hf_config.update(rope_change(original_max_position_embeddings=None))
  assert formats.from_hf(hf_config).rope_scaling[
      "original_max_position_embeddings"] == hf_config["model_max_length"]
  kimi = formats.from_hf(fixture_config("kimi_linear_bias"))
  assert kimi.mla_bias and kimi.rope_scaling.type == "none"


def test_swiglu_clamps_import_export_and_refusals():
  """The clamp lists become per-layer limits (entries past the decoder
  layers, the MTP layers', are dropped); Kimi cannot express them; a list
  shorter than the layers is refused by name."""
  hf_config = fixture_config("bailing_hybrid_clamp")
  cfg = typed(hf_config)
  assert cfg.swiglu_limits(5) == (0.3, 0.4)
  assert cfg.swiglu_limits(0) == (0.0, 0.0)
  longer = dict(hf_config, expert_swiglu_limit_list=list(
      hf_config["expert_swiglu_limit_list"]) + [9.0])
  assert typed(longer).expert_swiglu_limits == cfg.expert_swiglu_limits
  short = dict(hf_config, share_expert_swiglu_limit_list=[0.5])
  with pytest.raises(ValueError, match="share_expert_swiglu_limit_list"):
    formats.from_hf(short)
  with pytest.raises(ValueError, match="expert_swiglu_limits"):
    formats.to_hf(cfg, "kimi_linear")
  plain = typed(fixture_config("bailing_hybrid"))
  assert plain.expert_swiglu_limits == () == plain.shared_swiglu_limits


def test_layer_kinds_without_layer_types():
  """Ling's `layer_group_size` and Kimi's 1-based `full_attn_layers`."""
  for model_type in ("bailing_hybrid", "kimi_linear"):
    hf_config = fixture_config(model_type)
    del hf_config["layer_types"]
    assert formats.from_hf(hf_config).attention_pattern == "KKKMKKKM"


def test_layer_types_come_before_the_group_rule():
  hf_config = dict(fixture_config("bailing_hybrid"), layer_group_size=2)
  hf_config["layer_types"] = ["full_attention"] + hf_config[
      "layer_types"][1:]
  assert formats.from_hf(hf_config).attention_pattern == "MKKMKKKM"
  del hf_config["layer_types"]
  assert formats.from_hf(hf_config).attention_pattern == "KMKMKMKM"


@pytest.mark.parametrize("change,match", [
    ({"layer_types": ["linear_attention"] * 7},
     "'layer_types' must list 8 of"),
    ({"layer_types": ["linear_attention"] * 9},
     "'layer_types' must list 8 of"),
    ({"layer_types": ["sliding_attention"] + ["linear_attention"] * 7},
     "'layer_types' must list 8 of"),
    ({"layer_types": None, "linear_attn_config": {"head_dim": 8}},
     "neither 'layer_types' nor"),
    ({"layer_types": None, "linear_attn_config": None},
     "neither 'layer_types' nor"),
])
def test_bad_layer_kinds_are_named(change, match):
  hf_config = dict(fixture_config("kimi_linear"), **change)
  with pytest.raises(ValueError, match=match):
    formats.from_hf(hf_config)


@pytest.mark.parametrize("types,first_dense", [
    (["dense"] * 2 + ["sparse"] * 6, 2), (["sparse"] * 8, 0),
    (["dense"] + ["sparse"] * 7, 1)])
def test_mlp_layer_types_give_the_dense_layers(types, first_dense):
  hf_config = dict(fixture_config("bailing_hybrid"), mlp_layer_types=types,
                   first_k_dense_replace=3)
  assert formats.from_hf(hf_config).first_k_dense_replace == first_dense
  del hf_config["mlp_layer_types"]
  assert formats.from_hf(hf_config).first_k_dense_replace == 3


@pytest.mark.parametrize("types", [
    ["sparse", "dense"] + ["sparse"] * 6, ["dense"] + ["sparse"] * 6,
    ["dense"] + ["sparse"] * 8, ["dense", "sparse", "dense"] + ["sparse"] * 5,
    ["dense"] + ["moe"] * 7])
def test_bad_mlp_layer_types_are_named(types):
  hf_config = dict(fixture_config("bailing_hybrid"), mlp_layer_types=types)
  with pytest.raises(ValueError, match="'mlp_layer_types' must be 'dense'"):
    formats.from_hf(hf_config)


def test_rope_type_spellings():
  """`rope_type` or the older `type`; no type is the default rope; Kimi
  ignores the scaling."""
  for rope in ({"rope_type": "yarn", "factor": 2.0},
               {"type": "yarn", "factor": 2.0}):
    hf_config = dict(MINIMAL, rope_scaling=rope,
                     max_position_embeddings=64)
    rs = formats.from_hf(hf_config).rope_scaling
    assert (rs.type, rs.factor, rs.original_max_position_embeddings) == (
        "yarn", 2.0, 64)
    hf_config.update(model_type="kimi_linear",
                     layer_types=["linear_attention"] * 6)
    assert formats.from_hf(hf_config).rope_scaling.type == "none"
  kimi = dict(fixture_config("kimi_linear"),
              rope_scaling={"rope_type": "yarn", "factor": 4.0})
  assert formats.from_hf(kimi).rope_scaling.type == "none"
  hf_config = dict(MINIMAL, rope_parameters={"factor": 2.0})
  assert formats.from_hf(hf_config).rope_scaling.type == "none"
  hf_config = dict(MINIMAL, rope_parameters={"rope_type": "yarn",
                                             "factor": 2.0})
  with pytest.raises(ValueError, match="original_max_position_embeddings"):
    formats.from_hf(hf_config)
  hf_config["model_max_length"] = 48
  assert formats.from_hf(hf_config).rope_scaling[
      "original_max_position_embeddings"] == 48
  hf_config["max_position_embeddings"] = 40
  assert formats.from_hf(hf_config).rope_scaling[
      "original_max_position_embeddings"] == 40


def test_the_optional_yarn_fields_are_exported_only_when_given():
  hf_config = fixture_config("bailing_hybrid_yarn")
  cfg = typed(hf_config)
  rope = formats.to_hf(cfg, mapping.BAILING)["rope_parameters"]
  assert rope == hf_config["rope_parameters"]
  assert "attention_factor" not in rope
  hf_config.update(rope_change(attention_factor=1.5, mscale=None))
  rope = formats.to_hf(typed(hf_config), mapping.BAILING)["rope_parameters"]
  assert rope["attention_factor"] == 1.5 and "mscale" not in rope
  plain = formats.to_hf(typed(fixture_config("bailing_hybrid")),
                        mapping.BAILING)
  assert plain["rope_parameters"] == {"rope_theta": 10000.0,
                                      "rope_type": "default"}


def test_swiglu_clamp_lists_of_exactly_the_layers_or_zeros():
  hf_config = fixture_config("bailing_hybrid_clamp")
  assert len(hf_config["expert_swiglu_limit_list"]) == 8
  assert typed(hf_config).expert_swiglu_limits == (
      0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.2)
  zeros = dict(hf_config, expert_swiglu_limit_list=[0.0] * 8)
  cfg = typed(zeros)
  assert cfg.expert_swiglu_limits == ()
  assert cfg.shared_swiglu_limits == tuple(
      hf_config["share_expert_swiglu_limit_list"])
  exported = formats.to_hf(cfg, mapping.BAILING)
  assert exported["expert_swiglu_limit_list"] == [0.0] * 8
  assert exported["share_expert_swiglu_limit_list"] == (
      hf_config["share_expert_swiglu_limit_list"])
  for bad in (dict(hf_config, expert_swiglu_limit_list=(0.5,) * 8),
              dict(hf_config, expert_swiglu_limit_list=[0.5] * 7),
              dict(fixture_config("kimi_linear"),
                   expert_swiglu_limit_list=[0.5] * 8)):
    with pytest.raises(ValueError, match="'expert_swiglu_limit_list' must"):
      formats.from_hf(bad)


@pytest.mark.parametrize("model_type", mapping.MODEL_TYPES)
def test_export_refuses_what_the_format_cannot_express(model_type):
  name = "bailing_hybrid" if model_type == mapping.BAILING else "kimi_linear"
  cfg = typed(fixture_config(name))
  ling = model_type == mapping.BAILING
  changes = dict(kda_gate="kimi" if ling else "ling", use_nope=ling,
                 mla_output_gate=not ling, kda_head_v_dim=4, conv_bias=True,
                 tie_embeddings=True, num_mtp_layers=1, mla_norm_eps=1e-5)
  if ling:
    changes.update(mla_num_heads=4, norm_eps=1e-5)
  for key, value in changes.items():
    bad = dataclasses.replace(cfg, **{key: value})
    with pytest.raises(ValueError, match=f"express model.{key} = "):
      formats.to_hf(bad, model_type)
  with pytest.raises(ValueError, match="needs MoE layers"):
    formats.to_hf(dataclasses.replace(cfg, num_experts=0,
                                      first_k_dense_replace=0), model_type)


def test_kimi_exports_what_ling_cannot():
  """Kimi's MLA may have its own head count and `rms_norm_eps`."""
  cfg = typed(dict(fixture_config("kimi_linear"), num_attention_heads=4,
                   num_key_value_heads=4, rms_norm_eps=1e-5))
  exported = formats.to_hf(cfg, mapping.KIMI)
  assert exported["num_attention_heads"] == 4 == (
      exported["num_key_value_heads"])
  assert exported["linear_attn_config"]["num_heads"] == 2
  assert exported["rms_norm_eps"] == 1e-5


def test_export_writes_the_layer_lists():
  cfg = dataclasses.replace(typed(fixture_config("kimi_linear")),
                            attention_pattern="MKKMK",
                            first_k_dense_replace=2)
  exported = formats.to_hf(cfg, mapping.KIMI)
  assert exported["layer_types"] == [
      "full_attention", "linear_attention", "linear_attention",
      "full_attention", "linear_attention"]
  assert exported["mlp_layer_types"] == ["dense"] * 2 + ["sparse"] * 3
  assert exported["linear_attn_config"]["full_attn_layers"] == [1, 4]
  assert exported["linear_attn_config"]["kda_layers"] == [2, 3, 5]
  assert exported["linear_attn_config"]["short_conv_kernel_size"] == 4
  assert exported["q_lora_rank"] is None and exported["qk_head_dim"] == 8
  assert "rope_parameters" not in exported
  assert exported["architectures"] == ["KimiLinearForCausalLM"]
  ling = typed(fixture_config("bailing_hybrid"))
  for pattern, group in (("KKKMKKKM", 4), ("MKKKKKKK", 1),
                         ("KKKKKKKK", 9)):
    cfg = dataclasses.replace(ling, attention_pattern=pattern)
    exported = formats.to_hf(cfg, mapping.BAILING)
    assert exported["layer_group_size"] == group, pattern
    assert exported["q_lora_rank"] == 8
    assert exported["architectures"] == ["BailingHybridForCausalLM"]
    assert exported["kda_safe_gate"] is True
    assert exported["num_nextn_predict_layers"] == 0
    assert exported["short_conv_kernel_size"] == 4
    assert exported["rope_theta"] == 10000.0


def test_model_type_and_group_size_read_values_not_objects():
  """The gate's name compared by value (one read from a file is another
  object than the literal), and a stack without MLA layers of odd or even
  length has a group one longer than itself."""
  ling = typed(fixture_config("bailing_hybrid"))
  gate = "".join(["li", "ng"])
  assert formats.guess_model_type(
      dataclasses.replace(ling, kda_gate=gate)) == mapping.BAILING
  # A format kda-lm does not write is refused, not written as Kimi's.
  with pytest.raises(ValueError, match="Unknown model_type 'aaa'; kda-lm "
                     "writes"):
    formats.to_hf(ling, "aaa")
  for pattern in ("KKK", "KKKK", "KM"):
    want = pattern.find("M") + 1 or len(pattern) + 1
    assert formats._group_size(pattern) == want, pattern  # pylint: disable=protected-access


def test_carried_fields():
  """A source's ignored fields (token ids, length limits) are kept, not its
  provenance or anything kda-lm computes; token ids are null without
  one."""
  assert formats.carried_fields(None) == dict.fromkeys(
      formats.TOKEN_ID_FIELDS)
  source = dict(fixture_config("bailing_hybrid"), bos_token_id=1,
                eos_token_id=[2, 3], use_cache=False, vocab_size=99,
                _name_or_path="x", transformers_version="0",
                qk_head_dim=99, architectures=["X"])
  carried = formats.carried_fields(source)
  assert carried["bos_token_id"] == 1 and carried["pad_token_id"] is None
  assert carried["eos_token_id"] == [2, 3]
  assert carried["use_cache"] is False
  assert carried["model_max_length"] == 262144
  for name in ("vocab_size", "_name_or_path", "transformers_version",
               "qk_head_dim", "architectures", "hidden_size"):
    assert name not in carried, name
  exported = formats.to_hf(typed(fixture_config("bailing_hybrid")),
                           mapping.BAILING, source)
  assert exported["bos_token_id"] == 1 and exported["vocab_size"] == 64
  assert exported["architectures"] == ["BailingHybridForCausalLM"]
