"""Tensor names: kda-lm's (unscanned) parameter tree <-> a Hugging Face
checkpoint's on-disk tensors.

`tensor_map(cfg, model_type)` lists, for every tensor of the checkpoint,
the parameter it fills: `(module, name)` in the Haiku tree, the expert slot
of a stacked routed-expert array, and how the array is laid out on each
side. Layouts (HF linear weights are [out, in]):

  transpose  HF [F,D]       <-> kda-lm `w [D,F]` (also routers, experts)
  conv       HF [C,1,J]     <-> kda-lm `weight [J,C]` (tap J-1 = the
                                current token on both sides)
  same       identical arrays (norms, embeddings, biases, `dt_bias`;
             MLA's `attention_bias` biases are kda-lm's `b`)
  a_log      HF [H] (Ling) or [1,1,H,1] (Kimi) <-> kda-lm `A_log [H]`

The map is for today's unscanned layout (one `layer_{i}` module per
layer); a scanned tree is converted to and from it around these functions.
"""

from typing import NamedTuple, Optional

import numpy as np

from kda_lm import config as config_lib
from kda_lm import stack
from kda_lm.layers import moe

BAILING = "bailing_hybrid"
KIMI = "kimi_linear"
MODEL_TYPES = (BAILING, KIMI)

# Per format: the embedding, a layer's mixer prefix, the KDA output
# projection, the MoE prefix, routed-expert names (gate, up, down), the
# selection bias, and the dense-FFN prefix.
_NAMES = {
    BAILING: dict(embed="model.word_embeddings", mixer="attention",
                  kda_out="dense", mla_out="dense", moe="mlp",
                  experts=("gate_proj", "up_proj", "down_proj"),
                  bias="expert_bias", dense_ffn="mlp"),
    KIMI: dict(embed="model.embed_tokens", mixer="self_attn",
               kda_out="o_proj", mla_out="o_proj", moe="block_sparse_moe",
               experts=("w1", "w3", "w2"), bias="e_score_correction_bias",
               dense_ffn="block_sparse_moe"),
}

# kda-lm parameters the HF formats lack, filled with zeros on import and
# required to be zero on export: Kimi's output-gate bias.
ZERO_PARAMS = {KIMI: (("kda/g_b_proj", "b"),)}


class Target(NamedTuple):
  """Where one HF tensor lives in the parameter tree.

  Attributes:
    module: the Haiku module path, e.g. "layer_0/kda/q_proj".
    name: the parameter name in it, e.g. "w".
    layout: "transpose", "conv", "same" or "a_log".
    expert: the slot in a stacked [E,...] expert array, or None.
  """
  module: str
  name: str
  layout: str
  expert: Optional[int] = None


def _linear(module: str) -> Target:
  return Target(module, "w", "transpose")


def _norm(module: str) -> Target:
  return Target(module, "weight", "same")


def _swiglu(hf: str, kda: str, names=("gate_proj", "up_proj", "down_proj")
            ) -> dict[str, Target]:
  kda_names = ("gate_proj", "up_proj", "down_proj")
  return {f"{hf}.{n}.weight": _linear(f"{kda}/{k}")
          for n, k in zip(names, kda_names, strict=True)}


def _kda_layer(p: str, m: str, model_type: str) -> dict[str, Target]:
  out = {f"{p}.{x}_proj.weight": _linear(f"{m}/{x}_proj")
         for x in ("q", "k", "v", "b")}
  out.update({f"{p}.{x}_conv1d.weight": Target(f"{m}/{x}_conv1d", "weight",
                                                "conv")
              for x in ("q", "k", "v")})
  out[f"{p}.A_log"] = Target(m, "A_log", "a_log")
  out[f"{p}.dt_bias"] = Target(m, "dt_bias", "same")
  out[f"{p}.o_norm.weight"] = _norm(f"{m}/o_norm")
  out[f"{p}.{_NAMES[model_type]['kda_out']}.weight"] = _linear(
      f"{m}/o_proj")
  gates = (("f_proj", "g_proj") if model_type == BAILING else
           ("f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj"))
  out.update({f"{p}.{g}.weight": _linear(f"{m}/{g}") for g in gates})
  return out


def _mla_layer(p: str, m: str, cfg: config_lib.ModelConfig,
               model_type: str) -> dict[str, Target]:
  mla_out = _NAMES[model_type]["mla_out"]
  out = {f"{p}.kv_a_proj_with_mqa.weight": _linear(f"{m}/kv_a_proj"),
         f"{p}.kv_a_layernorm.weight": _norm(f"{m}/kv_a_norm"),
         f"{p}.kv_b_proj.weight": _linear(f"{m}/kv_b_proj"),
         f"{p}.{mla_out}.weight": _linear(f"{m}/o_proj")}
  # `attention_bias`: HF biases q_a_proj (with a query latent),
  # kv_a_proj_with_mqa and the output projection.
  biased = [("kv_a_proj_with_mqa", "kv_a_proj"), (mla_out, "o_proj")]
  if cfg.q_lora_rank:
    out[f"{p}.q_a_proj.weight"] = _linear(f"{m}/q_a_proj")
    out[f"{p}.q_a_layernorm.weight"] = _norm(f"{m}/q_a_norm")
    out[f"{p}.q_b_proj.weight"] = _linear(f"{m}/q_b_proj")
    biased.append(("q_a_proj", "q_a_proj"))
  else:
    out[f"{p}.q_proj.weight"] = _linear(f"{m}/q_proj")
  if cfg.mla_output_gate:
    out[f"{p}.g_proj.weight"] = _linear(f"{m}/g_proj")
  if cfg.mla_bias:
    out.update({f"{p}.{hf}.bias": Target(f"{m}/{kda}", "b", "same")
                for hf, kda in biased})
  return out


def _moe_layer(p: str, m: str, cfg: config_lib.ModelConfig,
               model_type: str) -> dict[str, Target]:
  names = _NAMES[model_type]
  out = {f"{p}.gate.weight": Target(m, "router", "transpose"),
         f"{p}.gate.{names['bias']}": Target(m, moe.BIAS_NAME, "same")}
  for e in range(cfg.num_experts):
    for hf, kda in zip(names["experts"], ("gate_proj", "up_proj",
                                          "down_proj"), strict=True):
      out[f"{p}.experts.{e}.{hf}.weight"] = Target(m, kda, "transpose", e)
  if cfg.num_shared_experts:
    out.update(_swiglu(f"{p}.shared_experts", f"{m}/shared_experts"))
  return out


def tensor_map(cfg: config_lib.ModelConfig, model_type: str
               ) -> dict[str, Target]:
  """Every tensor name of the HF checkpoint -> its `Target`.

  Args:
    cfg: the model config (what `formats.from_hf` gives).
    model_type: "bailing_hybrid" or "kimi_linear".

  Returns:
    A dict in checkpoint order (embedding, layers, final norm, head).

  Raises:
    ValueError: an unknown `model_type`.
  """
  if model_type not in MODEL_TYPES:
    raise ValueError(f"Unknown model_type {model_type!r}; kda-lm reads "
                     f"{MODEL_TYPES}.")
  names = _NAMES[model_type]
  out = {f"{names['embed']}.weight": Target("embed", "embeddings", "same")}
  for i, kind in enumerate(cfg.attention_pattern):
    p, m = f"model.layers.{i}", stack.layer_name(i)
    out[f"{p}.input_layernorm.weight"] = _norm(f"{m}/attn_norm")
    out[f"{p}.post_attention_layernorm.weight"] = _norm(f"{m}/mlp_norm")
    mixer = f"{p}.{names['mixer']}"
    if kind == "K":
      out.update(_kda_layer(mixer, f"{m}/kda", model_type))
    else:
      out.update(_mla_layer(mixer, f"{m}/mla", cfg, model_type))
    if cfg.is_moe_layer(i):
      out.update(_moe_layer(f"{p}.{names['moe']}", f"{m}/moe", cfg,
                            model_type))
    else:
      out.update(_swiglu(f"{p}.{names['dense_ffn']}", f"{m}/mlp"))
  out["model.norm.weight"] = _norm("final_norm")
  out["lm_head.weight"] = _linear("lm_head")
  return out


def canonical_name(name: str, model_type: str) -> str:
  """A tensor name as `tensor_map` spells it: Kimi's dense feed-forwards
  may also be saved as `mlp.*` (transformers reads both)."""
  if model_type == KIMI and ".mlp." in name:
    return name.replace(".mlp.", ".block_sparse_moe.", 1)
  return name


def zero_params(cfg: config_lib.ModelConfig, model_type: str
                ) -> list[tuple[str, str]]:
  """(module, name) of the kda-lm parameters the format has no tensor for
  (zero on import, checked to be zero on export)."""
  out = []
  for i, kind in enumerate(cfg.attention_pattern):
    for module, name in ZERO_PARAMS.get(model_type, ()):
      if module.split("/")[0] == {"K": "kda", "M": "mla"}[kind]:
        out.append((f"{stack.layer_name(i)}/{module}", name))
  return out


def hf_shape(target: Target, kda_shape: tuple[int, ...], model_type: str
             ) -> tuple[int, ...]:
  """The HF tensor's shape given its parameter's (whole) kda-lm shape."""
  shape = tuple(kda_shape[1:]) if target.expert is not None else tuple(
      kda_shape)
  if target.layout == "transpose":
    return shape[::-1]
  if target.layout == "conv":
    return (shape[1], 1, shape[0])
  if target.layout == "a_log" and model_type == KIMI:
    return (1, 1, shape[0], 1)
  return shape


def to_kda(target: Target, array: np.ndarray) -> np.ndarray:
  """An HF tensor in kda-lm's layout (one expert slot when stacked)."""
  if target.layout == "transpose":
    return array.T
  if target.layout == "conv":
    return array[:, 0, :].T
  if target.layout == "a_log":
    return array.reshape(-1)
  return array


def to_hf(target: Target, array: np.ndarray, model_type: str
          ) -> np.ndarray:
  """A kda-lm parameter (one expert slot when stacked) in HF's layout."""
  if target.expert is not None:
    array = array[target.expert]
  shape = hf_shape(target, array.shape if target.expert is None else
                   (0,) + array.shape, model_type)
  if target.layout == "transpose":
    return np.ascontiguousarray(array.T)
  if target.layout == "conv":
    return np.ascontiguousarray(array.T[:, None, :])
  return np.ascontiguousarray(array.reshape(shape))
