"""Makes the Hugging Face golden fixtures of `tests/hf_*_test.py`.

For each fixture (`bailing_hybrid`, Ling 3.0; `kimi_linear`, Kimi Linear;
`bailing_hybrid_yarn`, Ling with YaRN `rope_parameters` and
`attention_bias`; `kimi_linear_bias`, Kimi with `attention_bias`;
`bailing_hybrid_clamp`, Ling with per-layer SwiGLU clamps) it builds
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

The `export_*` fixtures are kda-lm's own exports of models a run trained
here has (byte vocabulary, or a BPE's; `experiments/make_export_fixtures.py`
writes their files first): here transformers only loads them, with its
warnings shown, and records their logits, and `AutoTokenizer` loads their
tokenizer and records the ids of `TOKENIZER_TEXT`.

SwiGLU clamps: Ling 3.0's `config.json` carries `expert_swiglu_limit_list`
and `share_expert_swiglu_limit_list` (per layer, 0 = none), which its
trained late layers need, but transformers' `bailing_hybrid` (5.24) does
not read them. For `bailing_hybrid_clamp` the reference therefore applies
them to the loaded torch model itself, in the form transformers' Step3p7
model uses for the same fields and Ling's own serving ports describe:
`silu(gate).clamp(max=L) * up.clamp(-L, L)`, routed and shared experts.

It also writes `tests/testdata/hf/config_fields.json`: the fields of the
two formats' config classes (`to_dict()` of a default config), which
tests/hf_formats_test.py checks against `kda_lm.hf.formats`' lists of
what kda-lm models, checks or ignores.

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


# Clamps small enough to bind in the tiny random model (its SwiGLU inputs
# are of order 0.1-1): per layer, 0 = none; layer 0 is dense.
EXPERT_LIMITS = [0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.2]
SHARED_LIMITS = [0.0, 0.0, 0.0, 0.0, 0.4, 0.4, 0.25, 0.25]


def ling_clamp_config():
  cfg = ling_config()
  cfg.expert_swiglu_limit_list = list(EXPERT_LIMITS)
  cfg.share_expert_swiglu_limit_list = list(SHARED_LIMITS)
  return cfg


def _clamped_experts_forward(experts, limit):
  """`BailingHybridExperts.forward` with the clamped SwiGLU."""
  def forward(hidden_states, top_k_index, top_k_weights):
    out = torch.zeros_like(hidden_states)
    for e in range(experts.num_experts):
      tok, pos = torch.where(top_k_index == e)
      if tok.numel() == 0:
        continue
      gate, up = torch.nn.functional.linear(
          hidden_states[tok], experts.gate_up_proj[e]).chunk(2, dim=-1)
      h = experts.act_fn(gate).clamp(max=limit) * up.clamp(-limit, limit)
      h = torch.nn.functional.linear(h, experts.down_proj[e])
      out.index_add_(0, tok, (h * top_k_weights[tok, pos, None]).to(
          out.dtype))
    return out
  return forward


def _clamped_mlp_forward(mlp, limit):
  def forward(x):
    h = mlp.act_fn(mlp.gate_proj(x)).clamp(max=limit) * mlp.up_proj(
        x).clamp(-limit, limit)
    return mlp.down_proj(h)
  return forward


def apply_clamps(model, cfg):
  """Patches the loaded model's MoE layers with the config's clamps."""
  routed = getattr(cfg, "expert_swiglu_limit_list", None)
  shared = getattr(cfg, "share_expert_swiglu_limit_list", None)
  if not routed and not shared:
    return
  for i, layer in enumerate(model.model.layers):
    moe = layer.mlp
    if not hasattr(moe, "experts"):
      continue
    if routed and routed[i]:
      moe.experts.forward = _clamped_experts_forward(moe.experts, routed[i])
    if shared and shared[i]:
      moe.shared_experts.forward = _clamped_mlp_forward(moe.shared_experts,
                                                        shared[i])


# name: (model_type, config, seed).
FIXTURES = {
    "bailing_hybrid": ("bailing_hybrid", ling_config, 0),
    "kimi_linear": ("kimi_linear", kimi_config, 1),
    "bailing_hybrid_yarn": ("bailing_hybrid", ling_yarn_config, 2),
    "kimi_linear_bias": ("kimi_linear",
                         lambda: kimi_config(attention_bias=True), 3),
    "bailing_hybrid_clamp": ("bailing_hybrid", ling_clamp_config, 4),
    # kda-lm's own exports (experiments/make_export_fixtures.py writes the
    # model files; here transformers loads them and records the logits).
    "export_bytes_bailing_hybrid": ("bailing_hybrid", None, 5),
    "export_bytes_kimi_linear": ("kimi_linear", None, 6),
    "export_bpe_bailing_hybrid": ("bailing_hybrid", None, 7),
}
# A text whose ids `AutoTokenizer` records for the exports with a
# tokenizer (accents, a symbol, an emoji: bytes beyond ASCII).
TOKENIZER_TEXT = "def héllo(wörld):\n    return ∑ 😀  # done\n"


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
  out = os.path.join(OUT, name)
  if cfg is None:   # A kda-lm export: loaded as it is, warnings shown.
    transformers.logging.set_verbosity_warning()
    cfg = transformers.AutoConfig.from_pretrained(out)
  else:
    model = cls(cfg).float().eval()
    randomize(model, gen)
    model.save_pretrained(out)
  # The float64 reference (the grouped expert matmul is float32-only).
  model = cls.from_pretrained(out, experts_implementation="eager").double()
  plain = None
  if any(getattr(cfg, "expert_swiglu_limit_list", None) or ()):
    plain = cls.from_pretrained(out, experts_implementation="eager").double()
    apply_clamps(model, cfg)
  rng = np.random.default_rng(seed)
  arrays = {}
  for i, n in enumerate(DOC_LENGTHS):
    tokens = rng.integers(0, VOCAB, size=n).astype(np.int32)
    run = lambda m, x=tokens: m(torch.tensor(x[None], dtype=torch.long),
                      use_cache=False).logits[0].double()
    with torch.no_grad():
      logits = run(model)
      if plain is not None:
        diff = (run(plain) - logits).norm() / logits.norm()
        print(f"  document {i}: the clamps change the logits by "
              f"{float(diff):.1%} (relative)")
    arrays[f"tokens_{i}"] = tokens
    arrays[f"logits_{i}"] = logits.float().numpy()
  if os.path.exists(os.path.join(out, "tokenizer.json")):
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok(TOKENIZER_TEXT)["input_ids"]
    assert tok.decode(ids) == TOKENIZER_TEXT
    print(f"  AutoTokenizer ({type(tok).__name__}): {len(ids)} ids")
    arrays["tokenizer_ids"] = np.asarray(ids, np.int32)
    arrays["tokenizer_text"] = np.frombuffer(TOKENIZER_TEXT.encode(),
                                             np.uint8)
  np.savez_compressed(os.path.join(out, "golden.npz"), **arrays)
  with safetensors.safe_open(os.path.join(out, "model.safetensors"),
                             "np") as f:
    n_params = sum(int(np.prod(f.get_slice(k).get_shape()))
                   for k in f.keys())
  print(f"{name}: {n_params:,} parameters, "
        f"{json.load(open(os.path.join(out, 'config.json')))['model_type']}")


def write_config_fields():
  fields = {"transformers": transformers.__version__}
  for name, cls in (("bailing_hybrid", transformers.BailingHybridConfig),
                    ("kimi_linear", transformers.KimiLinearConfig)):
    fields[name] = sorted(cls().to_dict())
  with open(os.path.join(OUT, "config_fields.json"), "w") as f:
    json.dump(fields, f, indent=1)
    f.write("\n")


def main():
  print(f"torch {torch.__version__}, transformers "
        f"{transformers.__version__}, safetensors "
        f"{safetensors.__version__}, python {sys.version.split()[0]}")
  names = sys.argv[1:] or list(FIXTURES)
  unknown = sorted(set(names) - set(FIXTURES))
  if unknown:
    raise SystemExit(f"Unknown fixtures {unknown}; known: {list(FIXTURES)}")
  write_config_fields()
  for name in names:
    model_type, config, seed = FIXTURES[name]
    make(name, model_type, config and config(), seed)
    generation = os.path.join(OUT, name, "generation_config.json")
    if os.path.exists(generation):
      os.remove(generation)


if __name__ == "__main__":
  main()
