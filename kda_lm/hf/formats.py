"""Configs: a Hugging Face `config.json` <-> kda-lm's `model` section.

Two formats, both shipped by `transformers` 5.x: `bailing_hybrid` (Ling
3.0, `BailingHybridConfig`) and `kimi_linear` (Kimi Linear,
`KimiLinearConfig`). What a format has and kda-lm cannot represent is
refused on import with a `ValueError` naming the `config.json` field; what
kda-lm has and the format cannot express is refused on export naming the
`config.model` option to change.

RoPE scaling: Ling's `rope_parameters` (or the older `rope_scaling`) with
`rope_type` "yarn" is `model.rope_scaling` (`kda_lm.layers.rope`), read as
`transformers` reads it; other scaled types are refused. Kimi's MLA applies
no RoPE and no YaRN softmax scale, so its `rope_parameters` are ignored.

Layer kinds: both formats save `layer_types` ("linear_attention" = KDA,
"full_attention" = MLA); without it, Ling's rule is `layer_group_size`
(layer i is MLA when (i + 1) % G == 0) and Kimi's is
`linear_attn_config.full_attn_layers` (1-based layer numbers).
"""

from typing import Any, Optional

import ml_collections

from kda_lm import config as config_lib
from kda_lm.hf import mapping
from kda_lm.layers import rope as rope_lib
from kda_lm.ops.kda import common as kda_common

# HF's MLA latent norms (q_a_layernorm, kv_a_layernorm) use this epsilon in
# both formats, whatever `rms_norm_eps` says.
HF_LATENT_NORM_EPS = 1e-6
_KINDS = {"linear_attention": "K", "full_attention": "M"}
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16",
           "float16": "float16"}
# YaRN's `rope_parameters` read and written only when given (kda-lm: 0 =
# not given; transformers treats an mscale of 0 so too).
_YARN_OPTIONAL = ("attention_factor", "mscale", "mscale_all_dim")


# Every `config.json` field of the two formats, by how kda-lm treats it
# (tests/hf_formats_test.py checks the lists against the fields of
# transformers' config classes, recorded in tests/testdata/hf/
# config_fields.json, so a field transformers adds fails the test until it
# is placed here). MODELLED: read into `model` (`from_hf`), written back by
# `to_hf`. CHECKED: refused on import unless kda-lm's value
# (`_refuse_unsupported`). IGNORED: name -> why it changes nothing kda-lm
# computes.
MODELLED = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "linear_num_heads",
    "linear_head_dim", "head_dim", "linear_conv_kernel_dim",
    "short_conv_kernel_size", "linear_attn_config", "kv_lora_rank",
    "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
    "max_position_embeddings", "attention_bias", "layer_types",
    "layer_group_size", "mlp_layer_types", "first_k_dense_replace",
    "kda_lower_bound", "num_experts", "num_local_experts",
    "moe_intermediate_size", "num_experts_per_token", "num_experts_per_tok",
    "num_shared_experts", "n_shared_experts", "routed_scaling_factor",
    "num_expert_group", "n_group", "topk_group", "moe_renormalize",
    "norm_topk_prob", "dtype", "torch_dtype", "expert_swiglu_limit_list",
    "share_expert_swiglu_limit_list"})
CHECKED = {"tie_word_embeddings": False, "hidden_act": "silu",
           "kda_safe_gate": True, "pretraining_tp": 1,
           "num_key_value_heads": "num_attention_heads"}
IGNORED = {
    "_name_or_path": "where transformers loaded it from",
    "architectures": "the class name; model_type decides",
    "transformers_version": "provenance",
    "qk_head_dim": "derived: qk_nope_head_dim + qk_rope_head_dim",
    "initializer_range": "initialisation only; weights are loaded",
    "attention_dropout": "dropout is off at inference; kda-lm trains "
                         "without dropout",
    "use_cache": "an inference switch of transformers",
    "return_dict": "an output switch of transformers",
    "output_attentions": "an output switch of transformers",
    "output_hidden_states": "an output switch of transformers",
    "output_router_logits": "an output switch of transformers",
    "chunk_size_feed_forward": "transformers' memory option (same output)",
    "is_encoder_decoder": "False for both formats",
    "problem_type": "sequence-classification heads only",
    "id2label": "sequence-classification heads only",
    "label2id": "sequence-classification heads only",
    "pad_token_id": "the tokenizer's; transformers uses it for the "
                    "embedding's padding row at initialisation only",
    "bos_token_id": "the tokenizer's (generation settings)",
    "eos_token_id": "the tokenizer's (generation settings)",
    "model_max_length": "the tokenizer's length limit",
    "num_nextn_predict_layers": "multi-token-prediction layers are not "
                                "imported (the decoder's logits do not "
                                "use them)",
    "num_mtp_layers": "as num_nextn_predict_layers",
    "mtp_loss_scaling_factor": "training loss weight of the MTP layers",
}


def _get(hf: dict, *names: str, default: Any = None) -> Any:
  """The first of `names` present in `hf` (transformers' aliases)."""
  for name in names:
    if name in hf and hf[name] is not None:
      return hf[name]
  return default


def _need(hf: dict, *names: str) -> Any:
  value = _get(hf, *names)
  if value is None:
    raise ValueError(f"config.json lacks the field {names[0]!r}.")
  return value


def _refuse_unsupported(hf: dict, model_type: str) -> None:
  """Raises for a CHECKED field whose value kda-lm cannot represent."""
  for name, ok in CHECKED.items():
    if ok == "num_attention_heads":
      ok = hf.get("num_attention_heads")
    value = hf.get(name)
    if value is not None and value != ok:
      raise ValueError(f"config.json field {name!r} is {value!r}: kda-lm "
                       f"models only {ok!r} ({model_type}).")


def _rope_parameters(hf: dict) -> dict:
  return _get(hf, "rope_parameters", "rope_scaling", default={}) or {}


def _yarn_context(hf: dict, rope: dict) -> int:
  """YaRN's `original_max_position_embeddings` as transformers resolves it:
  a top-level field first, then `rope_parameters`', then the model's
  `max_position_embeddings`."""
  value = _get(hf, "original_max_position_embeddings") or rope.get(
      "original_max_position_embeddings") or _get(
          hf, "max_position_embeddings", "model_max_length")
  if value is None:
    raise ValueError("config.json lacks the field "
                     "'rope_parameters.original_max_position_embeddings'.")
  return int(value)


def _rope_scaling(hf: dict, model_type: str) -> ml_collections.ConfigDict:
  """`model.rope_scaling` from `rope_parameters` (read as transformers'
  `_compute_yarn_parameters` and `yarn_apply_mscale` read it)."""
  out = config_lib.config_dict(rope_lib.RopeScaling)
  rope = _rope_parameters(hf)
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if model_type == mapping.KIMI or rope_type == "default":
    return out   # Kimi's MLA applies no RoPE: its scaling is ignored.
  if rope_type != "yarn":
    raise ValueError(
        f"config.json field 'rope_parameters.rope_type' is {rope_type!r}: "
        f"kda-lm implements 'default' and 'yarn' only.")
  partial = rope.get("partial_rotary_factor",
                     _get(hf, "partial_rotary_factor", default=1.0))
  if partial != 1.0:
    raise ValueError(f"config.json field 'rope_parameters."
                     f"partial_rotary_factor' is {partial!r}: kda-lm "
                     f"rotates all qk_rope_head_dim dims.")
  if rope.get("factor") is None:
    raise ValueError("config.json lacks the field 'rope_parameters.factor' "
                     "(rope_type 'yarn').")
  out.type = "yarn"
  out.factor = float(rope["factor"])
  out.original_max_position_embeddings = _yarn_context(hf, rope)
  out.beta_fast = float(rope.get("beta_fast") or 32.0)
  out.beta_slow = float(rope.get("beta_slow") or 1.0)
  out.truncate = bool(rope.get("truncate", True))
  if rope.get("attention_factor") is not None and not (
      rope["attention_factor"] > 0):
    raise ValueError(f"config.json field 'rope_parameters.attention_factor' "
                     f"is {rope['attention_factor']!r}: it must be > 0.")
  for name in _YARN_OPTIONAL:
    out[name] = float(rope.get(name) or 0.0)
  return out


def _rope_parameters_out(cfg: config_lib.ModelConfig) -> dict:
  """Ling's `rope_parameters`: what `_rope_scaling` reads back."""
  out = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
  s = cfg.rope_scaling
  if s.active:
    out.update(rope_type=s.type, factor=s.factor,
               original_max_position_embeddings=(
                   s.original_max_position_embeddings),
               beta_fast=s.beta_fast, beta_slow=s.beta_slow,
               truncate=s.truncate)
    out.update({name: getattr(s, name) for name in _YARN_OPTIONAL
                if getattr(s, name)})
  return out


def _pattern(hf: dict, model_type: str, num_layers: int) -> str:
  """The layer kinds as an `attention_pattern`."""
  types = hf.get("layer_types")
  if types is None and model_type == mapping.BAILING:
    group = int(_get(hf, "layer_group_size", default=6))
    types = ["full_attention" if (i + 1) % group == 0 else
             "linear_attention" for i in range(num_layers)]
  if types is None:
    full = (hf.get("linear_attn_config") or {}).get("full_attn_layers")
    if full is None:
      raise ValueError("config.json has neither 'layer_types' nor "
                       "'linear_attn_config.full_attn_layers'.")
    types = ["full_attention" if i + 1 in full else "linear_attention"
             for i in range(num_layers)]
  bad = sorted({t for t in types if t not in _KINDS})
  if bad or len(types) != num_layers:
    raise ValueError(f"config.json field 'layer_types' must list "
                     f"{num_layers} of {sorted(_KINDS)}, got {types!r}.")
  return "".join(_KINDS[t] for t in types)


def _first_dense(hf: dict, num_layers: int) -> int:
  """`first_k_dense_replace` from `mlp_layer_types` (dense ones first)."""
  types = hf.get("mlp_layer_types")
  if types is None:
    return int(_get(hf, "first_k_dense_replace", default=0))
  k = sum(t == "dense" for t in types)
  if len(types) != num_layers or types != ["dense"] * k + ["sparse"] * (
      num_layers - k):
    raise ValueError(f"config.json field 'mlp_layer_types' must be "
                     f"'dense' layers then 'sparse' ones ({num_layers} in "
                     f"all), got {types!r}.")
  return k


def model_type_of(hf: dict) -> str:
  """The checked `model_type` of a `config.json` dict."""
  model_type = hf.get("model_type")
  if model_type not in mapping.MODEL_TYPES:
    raise ValueError(f"config.json field 'model_type' is {model_type!r}; "
                     f"kda-lm reads {mapping.MODEL_TYPES}.")
  return model_type


def from_hf(hf: dict, *, dtype: Optional[str] = None
            ) -> ml_collections.ConfigDict:
  """A `config.json` dict as kda-lm's `model` section.

  Args:
    hf: the parsed `config.json`.
    dtype: the parameters' dtype; None = the checkpoint's (`dtype` or
      `torch_dtype`, float32 if absent).

  Returns:
    A `model` ConfigDict that `kda_lm.model.build` accepts.

  Raises:
    ValueError: an unknown `model_type`, a missing field, or one kda-lm
      cannot represent (the message names it).
  """
  model_type = model_type_of(hf)
  _refuse_unsupported(hf, model_type)
  kimi = model_type == mapping.KIMI
  lin = hf.get("linear_attn_config") or {}
  n = int(_need(hf, "num_hidden_layers"))
  m = config_lib.config_dict(config_lib.ModelConfig)
  m.vocab_size = int(_need(hf, "vocab_size"))
  m.d_model = int(_need(hf, "hidden_size"))
  m.attention_pattern = _pattern(hf, model_type, n)
  m.mla_num_heads = int(_need(hf, "num_attention_heads"))
  m.num_heads = int(lin.get("num_heads") or _get(
      hf, "linear_num_heads", default=m.mla_num_heads))
  m.head_dim = int(lin.get("head_dim") or _need(hf, "linear_head_dim",
                                                "head_dim"))
  m.conv_size = int(lin.get("short_conv_kernel_size") or _get(
      hf, "linear_conv_kernel_dim", "short_conv_kernel_size", default=4))
  m.kv_lora_rank = int(_need(hf, "kv_lora_rank"))
  m.q_lora_rank = int(_get(hf, "q_lora_rank", default=0))
  m.qk_nope_head_dim = int(_need(hf, "qk_nope_head_dim"))
  m.qk_rope_head_dim = int(_need(hf, "qk_rope_head_dim"))
  m.v_head_dim = int(_need(hf, "v_head_dim"))
  m.mlp_hidden_dim = int(_need(hf, "intermediate_size"))
  m.norm_eps = float(_get(hf, "rms_norm_eps", default=1e-6))
  m.mla_norm_eps = HF_LATENT_NORM_EPS
  m.rope_theta = float(_rope_parameters(hf).get(
      "rope_theta", _get(hf, "rope_theta", default=10000.0)))
  m.rope_scaling = _rope_scaling(hf, model_type)
  m.mla_bias = bool(_get(hf, "attention_bias", default=False))
  m.use_nope = kimi
  m.mla_output_gate = not kimi
  m.kda_gate = "kimi" if kimi else "ling"
  m.kda_lower_bound = float(_get(hf, "kda_lower_bound",
                                 default=kda_common.GATE_FLOOR))
  m.num_experts = int(_need(hf, "num_experts", "num_local_experts"))
  m.moe_intermediate_size = int(_need(hf, "moe_intermediate_size"))
  m.num_experts_per_tok = int(_need(hf, "num_experts_per_token",
                                    "num_experts_per_tok"))
  m.num_shared_experts = int(_get(hf, "num_shared_experts",
                                  "n_shared_experts", default=0))
  m.first_k_dense_replace = _first_dense(hf, n)
  m.routed_scaling_factor = float(_get(hf, "routed_scaling_factor",
                                       default=1.0))
  m.n_group = int(_get(hf, "num_expert_group", "n_group", default=1))
  m.topk_group = int(_get(hf, "topk_group", default=1))
  m.moe_renormalize = bool(_get(hf, "moe_renormalize", "norm_topk_prob",
                                default=True))
  m.expert_swiglu_limits, m.shared_swiglu_limits = _swiglu_limits(
      hf, model_type, n)
  dtype = dtype or _get(hf, "dtype", "torch_dtype", default="float32")
  if dtype not in _DTYPES:
    raise ValueError(f"Unsupported parameter dtype {dtype!r} (config.json "
                     f"field 'dtype'); use one of {sorted(_DTYPES)}.")
  m.param_dtype = _DTYPES[dtype]
  config_lib.ModelConfig.from_config(m)   # Validates.
  return m


# Ling 3.0's per-layer SwiGLU clamps (routed, shared experts), as kda-lm's
# `model` fields.
SWIGLU_LIMIT_FIELDS = (("expert_swiglu_limit_list", "expert_swiglu_limits"),
                       ("share_expert_swiglu_limit_list",
                        "shared_swiglu_limits"))


def _swiglu_limits(hf: dict, model_type: str, n: int) -> tuple:
  """(routed, shared) clamps per layer from `config.json`: () when absent
  or all zero. Entries past the n decoder layers belong to the MTP layers,
  which are not imported."""
  out = []
  for field, _ in SWIGLU_LIMIT_FIELDS:
    values = _get(hf, field)
    if values is None:
      out.append(())
      continue
    if model_type != mapping.BAILING or not isinstance(values, list) or (
        len(values) < n):
      raise ValueError(f"config.json field {field!r} must be a list of at "
                       f"least num_hidden_layers ({n}) numbers for "
                       f"bailing_hybrid, got {values!r}.")
    limits = tuple(float(v) for v in values[:n])
    out.append(limits if any(limits) else ())
  return tuple(out)


def guess_model_type(cfg: config_lib.ModelConfig) -> str:
  """The format whose layers `cfg` has (Ling's or Kimi's KDA gate)."""
  return mapping.BAILING if cfg.kda_gate == "ling" else mapping.KIMI


def _refuse_export(cfg: config_lib.ModelConfig, model_type: str) -> None:
  """Raises for an unknown `model_type` and for what it cannot express,
  naming the option."""
  if model_type not in mapping.MODEL_TYPES:
    raise ValueError(f"Unknown model_type {model_type!r}; kda-lm writes "
                     f"{mapping.MODEL_TYPES}.")
  ling = model_type == mapping.BAILING
  for _, name in SWIGLU_LIMIT_FIELDS:
    if not ling and any(getattr(cfg, name)):
      raise ValueError(f"The {model_type} format cannot express "
                       f"model.{name} (SwiGLU clamps); set it to () or "
                       f"export to {mapping.BAILING}.")
  wanted = (("kda_gate", "ling" if ling else "kimi"),
            ("use_nope", not ling), ("mla_output_gate", ling),
            ("kda_head_v_dim", cfg.head_dim), ("conv_bias", False),
            ("tie_embeddings", False), ("num_mtp_layers", 0),
            ("mla_norm_eps", HF_LATENT_NORM_EPS))
  if ling:
    wanted += (("mla_num_heads", cfg.num_heads),
               ("norm_eps", HF_LATENT_NORM_EPS))
  for name, ok in wanted:
    if getattr(cfg, name) != ok:
      raise ValueError(
          f"The {model_type} format cannot express model.{name} = "
          f"{getattr(cfg, name)!r}; set model.{name}={ok!r} (or export to "
          f"another format).")
  if not cfg.num_experts:
    raise ValueError(f"The {model_type} format needs MoE layers; set "
                     f"model.num_experts > 0.")



# Token ids an export writes unless the source checkpoint had its own:
# explicit nulls, since the config classes otherwise fall back to Ling's
# ids (pad 156892, eos 156895), which lie outside a smaller vocabulary
# (transformers then refuses the padding row).
TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def carried_fields(source: Optional[dict]) -> dict:
  """The IGNORED fields of a source `config.json` an export keeps (token
  ids, length limits, ...: what kda-lm does not compute with but readers
  of the checkpoint use), with null token ids where it has none."""
  out = {name: None for name in TOKEN_ID_FIELDS}
  keep = set(IGNORED) - {"_name_or_path", "architectures",
                         "transformers_version", "qk_head_dim"}
  out.update({k: v for k, v in (source or {}).items() if k in keep})
  return out


def to_hf(cfg: config_lib.ModelConfig, model_type: str,
          source: Optional[dict] = None) -> dict:
  """kda-lm's model config as the `config.json` of `model_type`.

  Args:
    cfg: the model config.
    model_type: "bailing_hybrid" or "kimi_linear".
    source: the `config.json` the model was imported from, if any: its
      fields kda-lm ignores are carried over (`carried_fields`).

  Raises:
    ValueError: an unknown `model_type`, or the format cannot express
      `cfg` (names the option).
  """
  _refuse_export(cfg, model_type)
  n = cfg.num_layers
  kinds = {v: k for k, v in _KINDS.items()}
  layer_types = [kinds[c] for c in cfg.attention_pattern]
  ling = model_type == mapping.BAILING
  hf = {
      "architectures": ["BailingHybridForCausalLM" if ling else
                        "KimiLinearForCausalLM"],
      "model_type": model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_hidden_dim, "num_hidden_layers": n,
      "num_attention_heads": cfg.mla_num_heads,
      "num_key_value_heads": cfg.mla_num_heads,
      "kv_lora_rank": cfg.kv_lora_rank,
      "q_lora_rank": cfg.q_lora_rank or None,
      "qk_nope_head_dim": cfg.qk_nope_head_dim,
      "qk_rope_head_dim": cfg.qk_rope_head_dim,
      "qk_head_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
      "head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
      "linear_head_dim": cfg.head_dim, "linear_num_heads": cfg.num_heads,
      "linear_conv_kernel_dim": cfg.conv_size,
      "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
      "attention_bias": cfg.mla_bias, "tie_word_embeddings": False,
      "layer_types": layer_types,
      "mlp_layer_types": ["dense" if not cfg.is_moe_layer(i) else "sparse"
                          for i in range(n)],
      "first_k_dense_replace": cfg.first_k_dense_replace,
      "num_experts": cfg.num_experts,
      "moe_intermediate_size": cfg.moe_intermediate_size,
      "num_experts_per_token": cfg.num_experts_per_tok,
      "num_shared_experts": cfg.num_shared_experts,
      "num_expert_group": cfg.n_group, "topk_group": cfg.topk_group,
      "routed_scaling_factor": cfg.routed_scaling_factor,
      "moe_renormalize": cfg.moe_renormalize, "dtype": cfg.param_dtype,
      **carried_fields(source),
  }
  if ling:
    hf.update(rope_parameters=_rope_parameters_out(cfg),
              rope_theta=cfg.rope_theta,
              short_conv_kernel_size=cfg.conv_size,
              kda_safe_gate=True, kda_lower_bound=cfg.kda_lower_bound,
              num_nextn_predict_layers=0,
              layer_group_size=_group_size(cfg.attention_pattern))
    for field, name in SWIGLU_LIMIT_FIELDS:
      hf[field] = list(getattr(cfg, name)) or [0.0] * n
  else:
    hf["linear_attn_config"] = {
        "head_dim": cfg.head_dim, "num_heads": cfg.num_heads,
        "short_conv_kernel_size": cfg.conv_size,
        "full_attn_layers": [i + 1 for i, c in
                             enumerate(cfg.attention_pattern) if c == "M"],
        "kda_layers": [i + 1 for i, c in enumerate(cfg.attention_pattern)
                       if c == "K"]}
  return hf


def _group_size(pattern: str) -> int:
  """Ling's `layer_group_size` when `pattern` follows its rule (else the
  first MLA layer's position; `layer_types` is what readers use)."""
  first = pattern.find("M") + 1
  return first if first > 0 else len(pattern) + 1
