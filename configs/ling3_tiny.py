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
  :text      byte-level language model on the `text_files` dataset.
  :kda_only  attention_pattern "KKKK".
  :mla_only  attention_pattern "MMMM".
  :dense     dense SwiGLU feed-forward in every layer (num_experts=0).
  :mtp       one MTP layer (MLA + MoE) with loss weight 0.1.

`get_config(arg)` takes the text after `:` in `--config=path.py:arg`;
variants combine with commas, e.g. `:text,kda_only`.
"""

import ml_collections

from data import pipeline


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
  # Mixture of experts (Bailing / DeepSeek-V3, kda_lm/layers/moe.py).
  m.num_experts = 8               # E routed experts; 0 = dense SwiGLU FFNs.
  m.num_experts_per_tok = 2       # k experts per token (top-k).
  m.num_shared_experts = 1        # Experts every token goes through.
  m.moe_intermediate_size = 128   # Hidden width of each expert (channels).
  m.first_k_dense_replace = 1     # Leading layers that keep the dense FFN.
  m.routed_scaling_factor = 2.5   # Multiplies the renormalised weights.
  m.n_group = 1                   # Expert groups (group-limited top-k).
  m.topk_group = 1                # Groups a token may pick experts from.
  # Selection-bias step per update (aux-loss-free balancing; 0 = frozen).
  m.router_bias_update_rate = 0.01
  # Multi-token prediction layers after the stack; 0 = none.
  m.num_mtp_layers = 0
  m.mtp_loss_scale = 0.1          # Weight of the MTP cross-entropy.
  m.mtp_layer_kind = "M"          # Mixer of the MTP blocks: K or M.
  return m


def data_config() -> ml_collections.ConfigDict:
  """The `data` dict read by `data.pipeline` (see its docstring)."""
  d = pipeline.default_config()
  d.name = "delayed_copy"         # Dataset: delayed_copy | text_files.
  # TFDS build/cache dir; None = <workdir>/tfds.
  d.data_dir = ml_collections.FieldReference(None, field_type=str)
  d.seq_len = 128                 # Tokens per packed row.
  # Rows per step, global (all processes). 4 reaches 99% soonest on 2 CPU
  # cores: 16 needs as many steps (~100) at 4x the cost per step.
  d.batch_size = 4
  d.seed = 0                      # Shuffle seed of the training stream.
  d.reset_at_document_boundaries = True  # Per-document segment ids/resets.
  d.shuffle_buffer = 1024         # Documents in the shuffle buffer.
  d.pack_window_rows = 64         # Rows' worth of documents packed together.
  d.vocab_size = 32               # delayed_copy: token ids in [0, 32).
  d.delay = 32                    # delayed_copy: t[i] = t[i - delay] (tokens).
  d.min_len = 64                  # delayed_copy: shortest document (tokens).
  d.max_len = 128                 # delayed_copy: longest document (tokens).
  d.num_train_docs = 10_000       # delayed_copy: train documents.
  d.num_eval_docs = 256           # delayed_copy: validation documents.
  d.dataset_seed = 0              # delayed_copy: generator seed.
  d.glob = ""                     # text_files: files ("" = Python stdlib .py).
  d.validation_percent = 5        # text_files: % of files for validation.
  return d


def opt_config() -> ml_collections.ConfigDict:
  """The `opt` dict: AdamW, linear warmup then cosine decay, clipping."""
  o = ml_collections.ConfigDict()
  o.peak_lr = 3e-3                # Learning rate after warmup (per step).
  o.warmup_steps = 50             # Linear warmup from 0 (steps).
  # Warmup + cosine length (steps); None = train.num_steps.
  o.decay_steps = ml_collections.FieldReference(None, field_type=int)
  o.end_lr_ratio = 0.1            # Final lr as a fraction of peak_lr.
  o.weight_decay = 0.1            # Decoupled decay (fraction of lr per step);
  #                                 not on norms, biases, A_log, dt_bias.
  o.b1 = 0.9                      # Adam first-moment decay.
  o.b2 = 0.98                     # Adam second-moment decay.
  o.eps = 1e-8                    # Adam epsilon.
  o.clip_norm = 1.0               # Global gradient-norm clip; 0 = none.
  return o


def train_config() -> ml_collections.ConfigDict:
  """The `train` dict: length, logging, seed."""
  t = ml_collections.ConfigDict()
  t.num_steps = 400               # Optimizer steps in the run.
  t.log_every = 20                # Steps between metric rows (host syncs).
  t.seed = 0                      # Parameter init / state rng seed.
  # Stop once eval accuracy reaches this (fraction); None = run all steps.
  t.stop_at_eval_accuracy = ml_collections.FieldReference(
      None, field_type=float)
  t.tensorboard = False           # Also write tensorboardX event files.
  # Progress bar: None = on a terminal only, True/False = always/never.
  t.progress_bar = ml_collections.FieldReference(None, field_type=bool)
  return t


def eval_config() -> ml_collections.ConfigDict:
  """The `eval` dict: periodic validation."""
  e = ml_collections.ConfigDict()
  e.every_steps = 50              # Steps between evals (0 = no eval).
  # Batches per eval (data.batch_size rows each); None = the whole split.
  e.num_batches = ml_collections.FieldReference(None, field_type=int)
  return e


def checkpoint_config() -> ml_collections.ConfigDict:
  """The `checkpoint` dict: Orbax checkpoints in <workdir>/checkpoints."""
  c = ml_collections.ConfigDict()
  c.enabled = True                # Save and auto-resume.
  c.every_steps = 100             # Steps between saves (and the last step).
  c.max_to_keep = 3               # Newest checkpoints kept.
  c.async_save = True             # Write arrays in a background thread.
  return c


def mesh_config() -> ml_collections.ConfigDict:
  """The `mesh` dict: devices as a (data, fsdp) mesh."""
  m = ml_collections.ConfigDict()
  m.data = -1                     # Data-parallel devices; -1 = all / fsdp.
  m.fsdp = 1                      # Devices each parameter is sharded over.
  m.distributed = False           # jax.distributed.initialize (multi-host).
  # jax.distributed.initialize arguments; None = auto-detect.
  m.coordinator_address = ml_collections.FieldReference(None, field_type=str)
  m.num_processes = ml_collections.FieldReference(None, field_type=int)
  m.process_id = ml_collections.FieldReference(None, field_type=int)
  # Seconds every process may take to reach the coordinator (distributed).
  m.coordinator_timeout_s = 300
  return m


VARIANTS = ("text", "kda_only", "mla_only", "dense", "mtp")


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
  config.opt = opt_config()
  config.train = train_config()
  config.eval = eval_config()
  config.checkpoint = checkpoint_config()
  config.mesh = mesh_config()
  # The model's vocabulary follows the delayed-copy vocabulary.
  config.model.vocab_size = config.data.get_ref("vocab_size")
  if "text" in variants:
    config.data.name = "text_files"
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
