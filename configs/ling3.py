r"""The published Ling 3.0 shapes (`BailingMoeV3`), for shape-level use.

`get_config("tiny")` is Ling-3.0-tiny (7.9B total / 1.3B activated),
`get_config("flash")` Ling-3.0-flash (~125B / 5.1B, plus one MTP layer);
see `docs/layers.md`. Only the `model` dict is real: the
other sections are ling3_tiny's so that the config passes
`kda_lm.config.check_config`, but these models are far too large to
train or even initialise on this machine. Use them with `jax.eval_shape`:

  python -m kda_lm.model --config=configs/ling3.py:tiny --noshapes
  python -m configs.ling3          # total / activated parameter table

`get_config("imported=<workdir>")` is the config of a run directory that
`python -m kda_lm.hf import` wrote from a Hugging Face checkpoint, so that
`python train.py --config=configs/ling3.py:imported=W --workdir=W`
fine-tunes it (docs/hf.md).

Parameter conventions (`count_params`): "total" is every parameter of the
main model (embedding and LM head included, MTP layers excluded, as
DeepSeek-V3 reports 671B + 14B MTP); "activated" is what one token reads:
total minus the routed experts it does not select (`E - k` of `E` per MoE
layer), minus the input embedding table (a lookup, not a matmul), the LM
head counted. `count_params` also returns the MTP layers separately.

Sources. The shapes are those of the models' `config.json` as copied into
public test fixtures (inclusionAI `BailingMoeV3ForCausalLM`,
"bailing_hybrid"): both sizes use `n_group` 8 / `topk_group` 4, a shared
expert as wide as a routed one, the bounded KDA gate (`kda_safe_gate`,
`kda_lower_bound` -5, no low-rank gates) and a head-wise MLA output gate;
tiny has no MTP layer (`num_nextn_predict_layers` 0), flash has one.

The activated counts. This convention reproduces flash's published 5.1B
exactly (5.10B; counting the input embedding too gives 5.51B) and tiny's
"~1.2B active" of SGLang's Ling-3.0-tiny cookbook (1.14B), but NOT the 1.3B
of tiny's model card: no convention gives 1.3B from tiny's config (with the
input embedding: 1.38B). Ling 2.0's cards count both tables (Ling-mini-2.0:
789M non-embedding + 2 x 322M = 1.43B "1.4B"), which is flash's 5.51B.
"""

import os
from typing import Any

import jax
import ml_collections

from configs import ling3_tiny
from kda_lm import config as config_lib
from kda_lm import flops
from kda_lm import model as model_lib
from kda_lm.train import state as state_lib

SIZES = ("tiny", "flash")


# What differs between the sizes: width, layers and Ling 3.0's layer group
# (one MLA layer per group), heads, query latent (0 = direct W_q), dense FFN
# width, routed experts and their width, leading dense layers, MTP layers.
_PER_SIZE = {
    "tiny": dict(d_model=1536, layers=(24, 4), num_heads=16, q_lora_rank=256,
                 mlp_hidden_dim=4608, num_experts=128,
                 moe_intermediate_size=512, first_k_dense_replace=1),
    "flash": dict(d_model=2560, layers=(42, 6), num_heads=32,
                  mlp_hidden_dim=6144, num_experts=512,
                  moe_intermediate_size=768, first_k_dense_replace=2,
                  num_mtp_layers=1),
}


def model_config(size: str) -> ml_collections.ConfigDict:
  """The `model` section of Ling-3.0-`size` (the rest: ModelConfig's
  defaults)."""
  if size not in SIZES:
    raise ValueError(f"Unknown Ling 3.0 size {size!r}; expected one of "
                     f"{SIZES}.")
  m = config_lib.config_dict(config_lib.ModelConfig)
  m.vocab_size = 157184           # The Bailing tokenizer.
  m.head_dim = 128                # KDA query/key/value dims per head.
  m.kv_lora_rank = 512            # MLA KV latent, as DeepSeek-V3.
  m.qk_nope_head_dim = 128
  m.qk_rope_head_dim = 64
  m.v_head_dim = 128
  m.rope_theta = 6e6              # RoPE base for 128k context.
  m.mla_output_gate = True        # Head-wise gated MLA.
  m.num_experts_per_tok = 8       # Top-8 of the routed experts,
  m.num_shared_experts = 1        # plus one shared expert,
  m.routed_scaling_factor = 2.5   # weights scaled by 2.5,
  m.n_group = 8                   # chosen from 4 of 8 expert groups.
  m.topk_group = 4
  m.compute_dtype = "bfloat16"    # Activations as trained.
  m.scan_layers = True            # One compiled copy of the layer group.
  values = dict(_PER_SIZE[size])
  m.attention_pattern = model_lib.ling_pattern(*values.pop("layers"))
  m.update(values)
  return m


def imported_config(arg: str) -> ml_collections.ConfigDict:
  """The config of a run directory written by `python -m kda_lm.hf import`
  (`arg` = "imported=<workdir>"): fine-tuning resumes it unchanged."""
  workdir = os.path.expanduser(arg.split("=", 1)[1])
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"{path} does not exist: import a checkpoint first "
                     f"(python -m kda_lm.hf import --workdir={workdir}).")
  # Keys added to kda-lm since the import take their defaults.
  return state_lib.load_config(workdir)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`--config=configs/ling3.py:tiny` or `:flash` (default tiny), or
  `:imported=<workdir>` (an imported checkpoint's run, to fine-tune)."""
  if arg and arg.startswith("imported="):
    return imported_config(arg)
  config = ling3_tiny.get_config()
  config.model = model_config(arg or "tiny")
  return config


def count_params(model_config: Any) -> dict[str, int]:
  """Total / activated / MTP parameters (`kda_lm.flops.count_params`) of a
  `model` section (a ConfigDict, read here)."""
  return flops.count_params(config_lib.ModelConfig.from_config(model_config))


def _main() -> None:
  print(f"{'model':<16} {'total':>9} {'activated':>10} {'MTP':>8}")
  for size in SIZES:
    c = count_params(model_config(size))
    print(f"Ling-3.0-{size:<7} {c['total'] / 1e9:>8.2f}B "
          f"{c['activated'] / 1e9:>9.2f}B {c['mtp'] / 1e9:>7.2f}B")


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  _main()
