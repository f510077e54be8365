r"""ling3_tiny: a miniature of Ling 3.0 small enough for 2 CPUs.

Four layers KKKM (Ling 3.0's layer_group_size=4 rule: 3 KDA : 1 MLA), the
KDA `ling` gate (full-rank, bounded in (-5, 0)), gated MLA with RoPE, and
Ling 3.0's feed-forward layout: layer 0 keeps a dense SwiGLU (384 wide),
layers 1-3 are MoE (8 SwiGLU experts of width 128, top-2, sigmoid router
with the aux-loss-free selection bias, 1 shared expert: active FFN width
3 x 128 = the dense 384). Like Ling-3.0-tiny it has no MTP layer; `:mtp`
adds one as in Ling-3.0-flash. The published shapes are `configs/ling3.py`.

Usage:

  python -m kda_lm.model --config=configs/ling3_tiny.py
  python -m kda_lm.model --config=configs/ling3_tiny.py \
      --config.model.attention_pattern=KKKK

Training (`python train.py --config=configs/ling3_tiny.py[:variant]`):

  (default)  delayed copy (delay 32, beyond the short-conv window).
  :text      language model on the `text_files` dataset (the standard
             library's .py files) with a 4096-token byte-level BPE trained
             on its training split (built once per data dir).
  :text_bytes  the same corpus byte by byte (vocabulary 256).
  :kda_only  attention_pattern "KKKK".
  :mla_only  attention_pattern "MMMM".
  :dense     dense SwiGLU feed-forward in every layer (num_experts=0).
  :mtp       one MTP layer (MLA + MoE) with loss weight 0.1.

`get_config(arg)` takes the text after `:` in `--config=path.py:arg`;
variants combine with commas, e.g. `:text,kda_only`.
"""

import ml_collections

from data import pipeline
from kda_lm import config as config_lib


def model_config() -> ml_collections.ConfigDict:
  """The `model` section (`kda_lm.config.ModelConfig`; the rest default)."""
  m = config_lib.config_dict(config_lib.ModelConfig)
  # Token ids lie in [0, vocab_size); `get_config` links it to the data's.
  m.vocab_size = 256
  m.d_model = 128                 # D, residual width (channels).
  # One character per layer, K = KDA, M = MLA: Ling 3.0's
  # layer_group_size=4 rule with 4 layers.
  m.attention_pattern = "KKKM"
  m.num_heads = 4                 # H, KDA and MLA heads.
  m.head_dim = 32                 # K, KDA query/key (and value) dims.
  m.kv_lora_rank = 64             # MLA compressed KV latent (dims per token).
  m.qk_nope_head_dim = 32         # MLA query/key dims per head without RoPE.
  m.qk_rope_head_dim = 16         # MLA query/shared key dims with RoPE.
  m.v_head_dim = 32               # MLA value dims per head.
  m.mla_output_gate = True        # Head-wise sigmoid output gate (Ling 3.0).
  m.mlp_hidden_dim = 384          # F, dense SwiGLU width (layer 0).
  # Ling 3.0's MoE on layers 1-3: 8 experts of width 128, top-2, one shared
  # expert (active width 3 x 128 = the dense 384).
  m.num_experts = 8
  m.num_experts_per_tok = 2
  m.num_shared_experts = 1
  m.moe_intermediate_size = 128
  m.first_k_dense_replace = 1     # Layer 0 keeps the dense FFN.
  m.routed_scaling_factor = 2.5   # As Ling 3.0.
  # Selection-bias step per update: faster than the default 1e-3 for runs
  # of a few hundred steps.
  m.router_bias_update_rate = 0.01
  return m


def data_config() -> ml_collections.ConfigDict:
  """The `data` section (`data/pipeline.py`; the rest default)."""
  d = pipeline.default_config()
  d.seq_len = 128                 # Tokens per packed row.
  # Rows per step, global (all processes). 4 reaches 99% soonest on 2 CPU
  # cores: 16 needs as many steps (~100) at 4x the cost per step.
  d.batch_size = 4
  # delayed_copy: 32 token ids, copied 32 tokens back (beyond the
  # short-conv window), documents of 64..128 tokens, 256 for validation.
  d.vocab_size = 32
  d.delay = 32
  d.min_len = 64
  d.max_len = 128
  d.num_eval_docs = 256
  # Documents are shorter than a row: no second (piece) shuffle, which keeps
  # the stream the delayed-copy results were measured on.
  d.piece_shuffle_buffer = 0
  return d


def _section(cls) -> ml_collections.ConfigDict:
  """A section at its defaults (`kda_lm/config.py` documents each field)."""
  return config_lib.config_dict(cls)


VARIANTS = ("text", "text_bytes", "kda_only", "mla_only", "dense", "mtp")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Returns the config.

  Args:
    arg: the variant after `:` in `--config=configs/ling3_tiny.py:arg`;
      None or "" for the default.

  Returns:
    A ConfigDict with the sub-dicts `model`, `data`, `opt`, `train`,
    `eval`, `checkpoint` and `mesh`.

  Raises:
    ValueError: an unknown variant.
  """
  variants = [v for v in (arg or "").split(",") if v]
  unknown = sorted(set(variants) - set(VARIANTS))
  if unknown:
    raise ValueError(f"Unknown ling3_tiny variant {unknown[0]!r}; expected "
                     f"comma-separated names from {VARIANTS}.")
  config = ml_collections.ConfigDict()
  config.model = model_config()
  config.data = data_config()
  # AdamW (peak 3e-3, warmup 50, cosine to 10%), 400 steps, eval every 50,
  # checkpoint every 100, all devices data-parallel: the defaults.
  config.opt = _section(config_lib.OptConfig)
  config.train = _section(config_lib.TrainConfig)
  config.eval = _section(config_lib.EvalConfig)
  config.checkpoint = _section(config_lib.CheckpointConfig)
  config.mesh = _section(config_lib.MeshConfig)
  # A 23 MB state and 4 x 128-token batches: 256 MiB of pinned host memory
  # for the TPU runtime's transfers instead of 4 GiB starts it 3.5-8 s
  # sooner on a v5e (no effect off TPU).
  config.mesh.tpu_premapped_buffer_mib = 256
  # The model's vocabulary follows the delayed-copy vocabulary.
  config.model.vocab_size = config.data.get_ref("vocab_size")
  if "text" in variants and "text_bytes" in variants:
    raise ValueError("Choose one of the ling3_tiny variants text and "
                     "text_bytes.")
  if "text" in variants or "text_bytes" in variants:
    config.data.name = "text_files"
    # Long files are cut into row-sized pieces and the pieces shuffled, so
    # consecutive rows come from different files.
    config.data.piece_shuffle_buffer = 1024
    if "text" in variants:
      # 4096 BPE tokens (~3.4 bytes each on Python source); see the README.
      # The vocabulary, in one place: data.vocab_size (and through it the
      # model's) follows bpe_vocab_size.
      config.data.tokenizer = "bpe"
      config.data.bpe_vocab_size = 4096
      config.data.vocab_size = config.data.get_ref("bpe_vocab_size")
    else:
      # Byte values (via the shared reference; unused by text_files).
      config.data.vocab_size = 256
    config.data.seq_len = 256
    config.data.batch_size = 4
    config.train.num_steps = 2000
    config.train.log_every = 50
    config.eval.every_steps = 250
    config.eval.num_batches = 16
    config.checkpoint.every_steps = 500
  if "kda_only" in variants:
    config.model.attention_pattern = "KKKK"
  if "mla_only" in variants:
    config.model.attention_pattern = "MMMM"
  if "dense" in variants:
    config.model.num_experts = 0
  if "mtp" in variants:
    config.model.num_mtp_layers = 1
  return config
