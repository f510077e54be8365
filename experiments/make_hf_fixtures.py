"""Makes the Hugging Face golden fixtures of `tests/hf_*_test.py`.

For each fixture (`bailing_hybrid`, Ling 3.0; `kimi_linear`, Kimi Linear;
`bailing_hybrid_yarn`, Ling with YaRN `rope_parameters` and
`attention_bias`; `kimi_linear_bias`, Kimi with `attention_bias`) it builds
a tiny random model with `transformers` (two layer groups of KDA layers and
an MLA layer, a dense first layer, grouped MoE, random norm weights, router
biases, decay parameters and MLA biases), saves it with
`save_pretrained` (the on-disk layout of the published checkpoints), and
runs several documents of unequal length through it, one document per row
(the torch fallback of both models cannot reset the KDA state inside a
packed row). It writes, per fixture, into `tests/testdata/hf/<name>/`:

  config.json, model.safetensors   the model as `save_pretrained` wrote it
  golden.npz                       tokens_<i> [T_i] int32 and logits_<i>
                                   [T_i, W] float32, HF's logits of
                                   document i run alone (computed in
                                   float64: the model's own float32
                                   rounding, ~1e-6 relative, stays out of
                                   the reference)

It runs in its own environment (torch, transformers; the tests only read
the files):

  py="$(bash experiments/hf_fixtures_env.sh)"
  "$py" -m experiments.make_hf_fixtures [name ...]   # default: all

(named ones only: the others' files stay as they are).
"""

import json
import os
import sys

import numpy as np
import safetensors
import torch
import transformers

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "testdata",
                   "hf")
DOC_LENGTHS = (37, 11, 24, 5)
VOCAB = 64

# Shapes shared by both types: 8 layers (two groups of KKKM), D = 16, two
# heads, MoE with 4 experts in 2 groups after one dense layer.
COMMON = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
    moe_intermediate_size=8, num_hidden_layers=8, num_attention_heads=2,
    num_key_value_heads=2, kv_lora_rank=8, qk_rope_head_dim=4,
    qk_nope_head_dim=4, v_head_dim=4, n_group=2, topk_group=1,
    num_experts_per_tok=2, num_local_experts=4, n_shared_experts=1,
    first_k_dense_replace=1, routed_scaling_factor=2.5,
    initializer_range=0.1, pad_token_id=None, bos_token_id=None,
    eos_token_id=None, tie_word_embeddings=False)


def ling_config():
  return transformers.BailingHybridConfig(
      **COMMON, head_dim=8, q_lora_rank=8, layer_group_size=4,
      short_conv_kernel_size=4, rope_theta=10000.0, num_mtp_layers=0,
      rms_norm_eps=1e-6)


def kimi_config(**kwargs):
  return transformers.KimiLinearConfig(
      **COMMON, q_lora_rank=None, rms_norm_eps=1e-5,
      linear_attn_config=dict(head_dim=8, num_heads=2,
                              short_conv_kernel_size=4,
                              full_attn_layers=[4, 8],
                              kda_layers=[1, 2, 3, 5, 6, 7]), **kwargs)


# YaRN over a 16-token pretraining context (the documents are longer), 8
# RoPE dims and base 10 so that the ramp blends between pairs 0 and 3 (not
# truncated), both magnitude scales non-trivial.
YARN = dict(rope_type="yarn", rope_theta=10.0, factor=4.0,
            original_max_position_embeddings=16, beta_fast=2.0,
            beta_slow=0.5, truncate=False, mscale=2.0, mscale_all_dim=1.0)


def ling_yarn_config():
  return transformers.BailingHybridConfig(
      **dict(COMMON, qk_rope_head_dim=8), head_dim=8, q_lora_rank=8,
      layer_group_size=4, short_conv_kernel_size=4, rope_theta=10.0,
      rope_parameters=dict(YARN), max_position_embeddings=64,
      attention_bias=True, num_mtp_layers=0, rms_norm_eps=1e-6)


# name: (model_type, config, seed).
FIXTURES = {
    "bailing_hybrid": ("bailing_hybrid", ling_config, 0),
    "kimi_linear": ("kimi_linear", kimi_config, 1),
    "bailing_hybrid_yarn": ("bailing_hybrid", ling_yarn_config, 2),
    "kimi_linear_bias": ("kimi_linear",
                         lambda: kimi_config(attention_bias=True), 3),
}


def randomize(model, gen):
  """Non-trivial norms, router biases, decay parameters, MLA biases."""
  with torch.no_grad():
    for name, p in list(model.named_parameters()) + list(
        model.named_buffers()):
      if not p.is_floating_point():
        continue
      if "norm" in name or "layernorm" in name:
        p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
      elif "expert_bias" in name or "e_score_correction_bias" in name:
        p.copy_(0.2 * torch.randn(p.shape, generator=gen))
      elif name.endswith("A_log") or name.endswith("dt_bias"):
        p.copy_(0.5 * torch.randn(p.shape, generator=gen))
      elif name.endswith(".bias"):   # attention_bias (zeros at init).
        p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def make(name, model_type, cfg, seed):
  torch.manual_seed(seed)
  gen = torch.Generator().manual_seed(seed)
  cls = {"bailing_hybrid": transformers.BailingHybridForCausalLM,
         "kimi_linear": transformers.KimiLinearForCausalLM}[model_type]
  model = cls(cfg).float().eval()
  randomize(model, gen)
  out = os.path.join(OUT, name)
  model.save_pretrained(out)
  # The float64 reference (the grouped expert matmul is float32-only).
  model = cls.from_pretrained(out, experts_implementation="eager").double()
  rng = np.random.default_rng(seed)
  arrays = {}
  for i, n in enumerate(DOC_LENGTHS):
    tokens = rng.integers(0, VOCAB, size=n).astype(np.int32)
    with torch.no_grad():
      logits = model(torch.tensor(tokens[None], dtype=torch.long),
                     use_cache=False).logits[0].double()
    arrays[f"tokens_{i}"] = tokens
    arrays[f"logits_{i}"] = logits.float().numpy()
  np.savez_compressed(os.path.join(out, "golden.npz"), **arrays)
  with safetensors.safe_open(os.path.join(out, "model.safetensors"),
                             "np") as f:
    n_params = sum(int(np.prod(f.get_slice(k).get_shape()))
                   for k in f.keys())
  print(f"{name}: {n_params:,} parameters, "
        f"{json.load(open(os.path.join(out, 'config.json')))['model_type']}")


def main():
  print(f"torch {torch.__version__}, transformers "
        f"{transformers.__version__}, safetensors "
        f"{safetensors.__version__}, python {sys.version.split()[0]}")
  names = sys.argv[1:] or list(FIXTURES)
  unknown = sorted(set(names) - set(FIXTURES))
  if unknown:
    raise SystemExit(f"Unknown fixtures {unknown}; known: {list(FIXTURES)}")
  for name in names:
    model_type, config, seed = FIXTURES[name]
    make(name, model_type, config(), seed)
    os.remove(os.path.join(OUT, name, "generation_config.json"))


if __name__ == "__main__":
  main()
