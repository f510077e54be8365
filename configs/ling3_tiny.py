r"""ling3_tiny: a 4-layer KKKM hybrid (3 KDA : 1 MLA) small enough for 2 CPUs.

Usage:

  python -m kda_lm.model --config=configs/ling3_tiny.py
  python -m kda_lm.model --config=configs/ling3_tiny.py \
      --config.model.attention_pattern=KKKK

`get_config(arg)` takes the text after `:` in `--config=path.py:arg`; only
the default (None or "") exists so far.
"""

import ml_collections


def model_config() -> ml_collections.ConfigDict:
  """The `model` dict read by `kda_lm.model.build`."""
  m = ml_collections.ConfigDict()
  # Token ids lie in [0, vocab_size); 256 covers delayed_copy's default and
  # the byte-level text_files vocabulary.
  m.vocab_size = 256
  m.d_model = 128                 # D, residual width (channels).
  # One character per layer, K = KDA, M = MLA; its length is the number of
  # layers. "KKKM" = Ling 3.0's layer_group_size=4 rule with 4 layers.
  m.attention_pattern = "KKKM"
  m.num_heads = 4                 # H, KDA heads (and MLA heads by default).
  m.head_dim = 32                 # K, KDA query/key dims per head.
  # V, KDA value dims per head; None = head_dim.
  m.kda_head_v_dim = ml_collections.FieldReference(None, field_type=int)
  # KDA gates: "ling" (full-rank, bounded gate in (-5, 0)) or "kimi"
  # (low-rank, softplus gate).
  m.kda_gate = "ling"
  m.conv_size = 4                 # Short-conv taps (tokens) per channel.
  m.conv_bias = False             # Bias in the short convolutions.
  # MLA heads; None = num_heads.
  m.mla_num_heads = ml_collections.FieldReference(None, field_type=int)
  m.q_lora_rank = 0               # Query latent rank (dims); 0 = direct W_q.
  m.kv_lora_rank = 64             # Compressed KV latent (dims per token).
  m.qk_nope_head_dim = 32         # Query/key dims per head without RoPE.
  m.qk_rope_head_dim = 16         # Query dims per head (and shared key dims)
  #                                 with RoPE; even.
  m.v_head_dim = 32               # Value dims per head.
  m.rope_theta = 10000.0          # RoPE base (Ling 3.0 uses 6e6 at 128k).
  m.use_nope = False              # True = no RoPE (Kimi Linear's MLA).
  m.mla_output_gate = True        # Head-wise sigmoid output gate (Ling 3.0).
  m.mlp_hidden_dim = 384          # F, SwiGLU hidden width (channels).
  m.tie_embeddings = False        # Share the embedding with the LM head.
  # Embedding init stddev; None = 1.0 untied, 1/sqrt(d_model) tied.
  m.embed_init_std = ml_collections.FieldReference(None, field_type=float)
  m.norm_eps = 1e-6               # RMSNorm epsilon (all norms).
  m.param_dtype = "float32"       # Stored parameters.
  m.compute_dtype = "float32"     # Activations ("bfloat16" on accelerators).
  m.kda_impl = "auto"             # chunk_kda impl: auto | reference | xla.
  m.kda_chunk_size = 64           # chunk_kda chunk length (tokens).
  return m


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Returns the config.

  Args:
    arg: the variant after `:` in `--config=configs/ling3_tiny.py:arg`;
      None or "" for the default.

  Returns:
    A ConfigDict with a `model` sub-dict.

  Raises:
    ValueError: an unknown variant.
  """
  if arg:
    raise ValueError(f"Unknown ling3_tiny variant {arg!r}; expected none.")
  config = ml_collections.ConfigDict()
  config.model = model_config()
  return config
