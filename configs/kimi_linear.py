r"""The published Kimi Linear shapes (`kimi_linear`), for shape-level use.

`get_config()` is Kimi-Linear-48B-A3B (48B total / 3B activated): 27
layers, MLA at the 1-based layers 4, 8, ..., 24 and 27 (the `KKKM` groups
of Ling's rule with a trailing MLA layer), NoPE MLA without a query latent,
the low-rank `kimi` KDA gates, 256 routed experts (top-8, one shared
expert, width 1024) after one dense layer (9216). Like `configs/ling3.py`,
only the `model` dict is real (the other sections are ling3_tiny's); use it
with `jax.eval_shape`:

  python -m kda_lm.model --config=configs/kimi_linear.py --noshapes
  python -m configs.kimi_linear    # total / activated parameter table

`get_config("imported=<workdir>")` is the config of a run directory written
by `python -m kda_lm.hf import` from a `kimi_linear` checkpoint, to
fine-tune it (docs/hf.md).

Sources: the model's `config.json` on the Hugging Face Hub
(moonshotai/Kimi-Linear-48B-A3B-Instruct), whose values are also the
defaults of `transformers`' `KimiLinearConfig`, and the Kimi Linear report
(arXiv 2510.26692). Parameter conventions: `configs.ling3.count_params`.
"""

import ml_collections

from configs import ling3, ling3_tiny
from kda_lm import config as config_lib
from kda_lm import model as model_lib


def model_config() -> ml_collections.ConfigDict:
  """The `model` section of Kimi-Linear-48B-A3B."""
  m = config_lib.config_dict(config_lib.ModelConfig)
  m.vocab_size = 163840
  m.d_model = 2304
  m.attention_pattern = model_lib.ling_pattern(27, 4)   # MLA: 4, 8, .., 27.
  m.num_heads = 32                # KDA and MLA heads,
  m.head_dim = 128                # KDA query/key/value dims per head.
  m.kda_gate = "kimi"             # Low-rank gates, softplus decay.
  m.kv_lora_rank = 512            # MLA KV latent; no query latent.
  m.qk_nope_head_dim = 128
  m.qk_rope_head_dim = 64         # Kept (the key's shared part), not
  m.use_nope = True               # rotated: NoPE MLA.
  m.v_head_dim = 128
  m.norm_eps = 1e-5               # rms_norm_eps; the MLA latent norms
  m.mla_norm_eps = 1e-6           # use 1e-6 (transformers' KimiLinear).
  m.mlp_hidden_dim = 9216         # The dense first layer.
  m.first_k_dense_replace = 1
  m.num_experts = 256
  m.moe_intermediate_size = 1024
  m.num_experts_per_tok = 8
  m.num_shared_experts = 1
  m.routed_scaling_factor = 2.446
  m.compute_dtype = "bfloat16"
  m.scan_layers = True            # One compiled copy of the layer group.
  return m


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`--config=configs/kimi_linear.py` (48B-A3B) or
  `:imported=<workdir>`."""
  if arg and arg.startswith("imported="):
    return ling3.imported_config(arg)
  if arg:
    raise ValueError(f"Unknown variant {arg!r}: use none or "
                     f"'imported=<workdir>'.")
  config = ling3_tiny.get_config()
  config.model = model_config()
  return config


def _main() -> None:
  c = ling3.count_params(model_config())
  print(f"Kimi-Linear-48B-A3B: {c['total'] / 1e9:.2f}B total, "
        f"{c['activated'] / 1e9:.2f}B activated")


if __name__ == "__main__":
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  _main()
