"""Typed configs: one frozen dataclass per config section, validated once.

A training config (`configs/ling3_tiny.py`) is an `ml_collections.ConfigDict`
with the sections `model`, `data`, `opt`, `train`, `eval`, `checkpoint` and
`mesh`, so that every field can be overridden on the command line
(`--config.model.d_model=64`). Inside the code each section is read once into
its dataclass here (`data`'s live beside the datasets, in `data/pipeline.py`):
the dataclass fields are the section's keys, their defaults are the one home
of the defaults, and `__post_init__` raises a `ValueError` naming the field.

  model_config = config.ModelConfig.from_config(cfg.model)
  cfg.model = config.config_dict(config.ModelConfig)   # in a config file

The model's section is read where it enters, once: `check_config` (a run's
config; `RunConfig.model`), the command lines and the Hugging Face import.
The library below takes the typed `ModelConfig`; `typed_model` is its one
refusal of anything else.
"""

import dataclasses
from typing import Any, NamedTuple, Optional

import ml_collections
import numpy as np

from data import pipeline, sections
from kda_lm.layers import kda, mla, moe, rope
from kda_lm.ops import gmm
from kda_lm.ops.kda import api as kda_api
from kda_lm.ops.kda import common as kda_common
from kda_lm.ops.kda.pallas import options as pallas_options
from kda_lm.parallel import sharding

LAYER_KINDS = {"K": "kda", "M": "mla"}
# What a layer keeps for the backward pass (`config.train.remat`; each is
# described in `kda_lm/stack.py`), from most memory to least.
REMAT_POLICIES = ("none", "save_dots", "save_outputs", "full")


def check_remat(remat: str) -> str:
  """`remat` if it names a policy of `REMAT_POLICIES`, else ValueError."""
  if remat not in REMAT_POLICIES:
    raise ValueError(f"config.train.remat must be one of {REMAT_POLICIES}, "
                     f"got {remat!r}.")
  return remat
DTYPES = ("float32", "bfloat16", "float16")

# Reading a ConfigDict section into a dataclass: one home, in `data`, which
# imports nothing from kda_lm.
config_dict = sections.config_dict
check_keys = sections.check_keys
field_names = sections.field_names
from_config = sections.from_config
NOT_A_KEY = sections.NOT_A_KEY


def _set(obj: Any, name: str, value: Any) -> None:
  object.__setattr__(obj, name, value)


def _is_int(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _int_at_least(obj: Any, section: str, low: int, *names: str) -> None:
  """Checks (and casts to int) fields that must be ints >= `low`."""
  for name in names:
    value = getattr(obj, name)
    if not _is_int(value) or value < low:
      what = "a positive int" if low == 1 else f"an int >= {low}"
      raise ValueError(f"{section}.{name} must be {what}, got {value!r}.")
    _set(obj, name, int(value))


# ---------------------------------------------------------------------------
# The model.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The hybrid decoder's shape (`kda_lm.model.build`), validated.

  Dimensions use the letters of docs/glossary.md. None defaults are
  resolved in `__post_init__` (the resolved value is what the model reads).
  """
  # Token ids lie in [0, vocab_size).
  vocab_size: int
  # D, residual width (channels).
  d_model: int
  # One character per layer, K = KDA, M = MLA; its length is the number of
  # layers (`ling_pattern` writes Ling 3.0's layout rule).
  attention_pattern: str
  # H, KDA heads (and MLA heads unless mla_num_heads).
  num_heads: int
  # K, KDA query/key dims per head.
  head_dim: int
  # MLA compressed KV latent (dims per token).
  kv_lora_rank: int
  # MLA query/key dims per head without RoPE.
  qk_nope_head_dim: int
  # MLA query dims per head (and shared key dims) with RoPE; even.
  qk_rope_head_dim: int
  # MLA value dims per head.
  v_head_dim: int
  # F, dense SwiGLU hidden width (channels).
  mlp_hidden_dim: int
  # V, KDA value dims per head; None = head_dim.
  kda_head_v_dim: Optional[int] = None
  # MLA heads; None = num_heads.
  mla_num_heads: Optional[int] = None
  # Bias in the KDA short convolutions.
  conv_bias: bool = False
  # RMSNorm epsilon (all norms).
  norm_eps: float = 1e-6
  # Embedding init stddev; None = 1.0 untied, 1/sqrt(d_model) tied.
  embed_init_std: Optional[float] = None
  # Stored parameters' dtype.
  param_dtype: str = "float32"
  # Activations' dtype ("bfloat16" on accelerators).
  compute_dtype: str = "float32"
  # chunk_kda implementation: auto | reference | xla | pallas.
  kda_impl: str = "auto"
  # chunk_kda chunk length (tokens); None = the op's choice per
  # implementation and backend (32 for xla on CPU, 64 otherwise).
  kda_chunk_size: Optional[int] = None
  # Pallas kernel settings, a sub-section: any field of
  # `kda_lm.ops.kda.pallas.KernelOptions` but `interpret` (heads per
  # program, dot precision per matmul family, VMEM limit, warps, ...), 0 or
  # "" = the platform's default. A resume may change them.
  kda_kernel: pallas_options.KernelSettings = dataclasses.field(
      default_factory=pallas_options.KernelSettings)
  # Routed experts' grouped matmul (`kda_lm/ops/gmm.py`): auto (on TPU
  # megablox, or ragged_dot for at most 8 experts; xla elsewhere) |
  # xla | megablox | ragged_dot (dense over the experts: the reference).
  moe_impl: str = "auto"
  # KDA gates: "ling" (full-rank, bounded gate in (-5, 0)) or "kimi"
  # (low-rank, softplus gate).
  kda_gate: str = "ling"
  # Short-conv taps (tokens) per channel.
  conv_size: int = 4
  # MLA query latent rank (dims); 0 = a direct W_q.
  q_lora_rank: int = 0
  # RoPE base (Ling 3.0 uses 6e6 at 128k).
  rope_theta: float = 10000.0
  # RoPE scaling of the MLA layers, a sub-section (`kda_lm.layers.rope.
  # RopeScaling`: type "none" or "yarn" and YaRN's parameters, named as in
  # transformers' `rope_parameters`).
  rope_scaling: rope.RopeScaling = dataclasses.field(
      default_factory=rope.RopeScaling)
  # True = no RoPE (Kimi Linear's MLA).
  use_nope: bool = False
  # Head-wise sigmoid output gate on MLA (Ling 3.0).
  mla_output_gate: bool = False
  # Biases in MLA's q_a_proj (with a query latent), kv_a_proj and o_proj
  # (the HF formats' `attention_bias`).
  mla_bias: bool = False
  # Share the embedding with the LM head.
  tie_embeddings: bool = False
  # E routed experts per MoE layer (kda_lm/layers/moe.py); 0 = dense FFNs.
  num_experts: int = 0
  # Hidden width of each expert (channels); None = mlp_hidden_dim.
  moe_intermediate_size: Optional[int] = None
  # A experts per token (top-k).
  num_experts_per_tok: int = 1
  # Experts every token goes through.
  num_shared_experts: int = 0
  # Leading layers that keep the dense FFN.
  first_k_dense_replace: int = 0
  # Multiplies the renormalised expert weights.
  routed_scaling_factor: float = 1.0
  # Expert groups (group-limited top-k) and groups a token may pick from.
  n_group: int = 1
  topk_group: int = 1
  # Expert parallelism (mesh.expert = n > 1) only: None = no (token,
  # expert) pair is dropped (exchange buffers sized for the worst case,
  # n x the pairs); c > 0 = each device takes at most ceil(c * M * A / n)
  # pairs from each device per layer (M its tokens), the rest dropped
  # (docs/expert_parallel.md).
  moe_capacity_factor: Optional[float] = None
  # Selection-bias step per update (aux-loss-free balancing; 0 = frozen).
  router_bias_update_rate: float = 1e-3
  # Multi-token prediction layers after the stack (layers/mtp.py); 0 = none.
  num_mtp_layers: int = 0
  # Weight of the MTP cross-entropy in the loss.
  mtp_loss_scale: float = 0.1
  # Mixer of the MTP blocks: K or M.
  mtp_layer_kind: str = "M"
  # Run the repeated layer group (`kda_lm/stack.py`) under one scan:
  # parameters stacked on a leading axis, compile time flat in depth.
  scan_layers: bool = False
  # Options the Hugging Face formats need (kda_lm/hf/): the MLA latent
  # norms' (q_a, kv_a) epsilon, None = norm_eps (Kimi Linear: 1e-6 beside
  # 1e-5); the `ling` KDA forget gate's lower bound, in [-5, 0); whether
  # the top-k expert weights are renormalised (`norm_topk_prob`).
  mla_norm_eps: Optional[float] = None
  kda_lower_bound: float = kda_common.GATE_FLOOR
  moe_renormalize: bool = True
  # Per-layer SwiGLU clamps of the MoE layers (`layers/mlp.swiglu`; Ling
  # 3.0's late layers, `expert_swiglu_limit_list` and
  # `share_expert_swiglu_limit_list` in its config.json): one value per
  # layer, 0 = none; () = none anywhere. Routed and shared experts.
  expert_swiglu_limits: tuple = ()
  shared_swiglu_limits: tuple = ()

  @classmethod
  def from_config(cls, values: Any) -> "ModelConfig":
    """`config.model` (a ConfigDict, mapping or ModelConfig) as a
    ModelConfig."""
    return from_config(cls, values, "model")

  def __post_init__(self):
    if not isinstance(self.rope_scaling, rope.RopeScaling):
      _set(self, "rope_scaling", from_config(
          rope.RopeScaling, self.rope_scaling, "model.rope_scaling"))
    if not isinstance(self.kda_kernel, pallas_options.KernelSettings):
      _set(self, "kda_kernel", from_config(
          pallas_options.KernelSettings, self.kda_kernel,
          "model.kda_kernel"))
    self._check_pattern()
    _int_at_least(self, "model", 1, "vocab_size", "d_model", "num_heads",
                  "head_dim", "mlp_hidden_dim", "conv_size")
    if self.kda_chunk_size is not None:
      _int_at_least(self, "model", 1, "kda_chunk_size")
    for name, default in (("kda_head_v_dim", self.head_dim),
                          ("mla_num_heads", self.num_heads)):
      if getattr(self, name) is None:
        _set(self, name, default)
      _int_at_least(self, "model", 1, name)
    if self.kda_gate not in kda.GATES:
      raise ValueError(f"model.kda_gate must be one of {kda.GATES}, got "
                       f"{self.kda_gate!r}.")
    if self.kda_impl not in kda_api.IMPLS:
      raise ValueError(f"model.kda_impl must be one of {kda_api.IMPLS}, "
                       f"got {self.kda_impl!r}.")
    if self.moe_impl not in gmm.IMPLS:
      raise ValueError(f"model.moe_impl must be one of {gmm.IMPLS}, got "
                       f"{self.moe_impl!r}.")
    mla.check_dims(num_heads=self.mla_num_heads,
                   q_lora_rank=self.q_lora_rank,
                   kv_lora_rank=self.kv_lora_rank,
                   qk_nope_head_dim=self.qk_nope_head_dim,
                   qk_rope_head_dim=self.qk_rope_head_dim,
                   v_head_dim=self.v_head_dim, use_nope=self.use_nope,
                   rope_scaling=self.rope_scaling)
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"model.{name} must be one of {DTYPES}, got "
                         f"{getattr(self, name)!r}.")
    if self.embed_init_std is None:
      _set(self, "embed_init_std",
           self.d_model ** -0.5 if self.tie_embeddings else 1.0)
    if self.mla_norm_eps is None:
      _set(self, "mla_norm_eps", self.norm_eps)
    if not (self.embed_init_std > 0 and self.rope_theta > 0
            and self.norm_eps > 0 and self.mla_norm_eps > 0):
      raise ValueError("model.embed_init_std, rope_theta, norm_eps and "
                       "mla_norm_eps must be positive.")
    kda_common.check_lower_bound(self.kda_lower_bound,
                                 "model.kda_lower_bound")
    self._check_moe_and_mtp()

  def _check_pattern(self):
    pattern = self.attention_pattern
    if not isinstance(pattern, str) or not pattern:
      raise ValueError(f"model.attention_pattern must be a non-empty string "
                       f"of {sorted(LAYER_KINDS)}, got {pattern!r}.")
    bad = sorted(set(pattern) - set(LAYER_KINDS))
    if bad:
      raise ValueError(f"model.attention_pattern {pattern!r} has invalid "
                       f"characters {bad}; use 'K' (KDA) and 'M' (MLA).")

  def _check_moe_and_mtp(self):
    _int_at_least(self, "model", 0, "num_experts", "num_shared_experts",
                  "first_k_dense_replace", "num_mtp_layers")
    if self.num_experts:
      if self.moe_intermediate_size is None:
        _set(self, "moe_intermediate_size", self.mlp_hidden_dim)
      _int_at_least(self, "model", 1, "moe_intermediate_size",
                    "num_experts_per_tok", "n_group", "topk_group")
      moe.check_dims(num_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok,
                     n_group=self.n_group, topk_group=self.topk_group)
    if self.moe_capacity_factor is not None and not (
        self.moe_capacity_factor > 0):
      raise ValueError(f"model.moe_capacity_factor must be None or > 0, got "
                       f"{self.moe_capacity_factor!r}.")
    if self.mtp_layer_kind not in LAYER_KINDS:
      raise ValueError(f"model.mtp_layer_kind must be one of "
                       f"{sorted(LAYER_KINDS)}, got "
                       f"{self.mtp_layer_kind!r}.")
    if not (self.router_bias_update_rate >= 0 and self.mtp_loss_scale >= 0):
      raise ValueError("model.router_bias_update_rate and mtp_loss_scale "
                       "must be >= 0.")
    for name in ("expert_swiglu_limits", "shared_swiglu_limits"):
      _set(self, name, self._limits(name))

  def _limits(self, name: str) -> tuple:
    """A per-layer clamp list as a tuple of floats >= 0, checked."""
    values = getattr(self, name)
    try:
      limits = tuple(float(v) for v in values)
    except (TypeError, ValueError):
      limits = None
    if limits is None or any(not v >= 0 for v in limits) or (
        limits and len(limits) != len(self.attention_pattern)):
      raise ValueError(
          f"model.{name} must be () or one number >= 0 per layer "
          f"({len(self.attention_pattern)}), got {values!r}.")
    return limits

  @property
  def num_layers(self) -> int:
    return len(self.attention_pattern)

  def is_moe_layer(self, i: int) -> bool:
    """Whether decoder layer `i` (0-based) has a MoE feed-forward."""
    return bool(self.num_experts) and i >= self.first_k_dense_replace

  def swiglu_limits(self, i: int) -> tuple[float, float]:
    """Layer `i`'s (routed, shared) experts' SwiGLU clamps; 0 = none."""
    pick = lambda limits: limits[i] if limits else 0.0
    return (pick(self.expert_swiglu_limits),
            pick(self.shared_swiglu_limits))

  @property
  def has_aux_outputs(self) -> bool:
    """The training step needs `apply(..., return_aux=True)` (MoE or MTP)."""
    return bool(self.num_experts or self.num_mtp_layers)


def typed_model(model_config: Any, where: str) -> ModelConfig:
  """`model_config` unchanged if it is a `ModelConfig`; anything else (a
  ConfigDict, a dict) is a TypeError naming `where` (the function that
  needs it) and how to read one."""
  if isinstance(model_config, ModelConfig):
    return model_config
  raise TypeError(
      f"{where} takes a kda_lm.config.ModelConfig, got "
      f"{type(model_config).__name__}: pass "
      f"kda_lm.config.ModelConfig.from_config(config.model).")


# ---------------------------------------------------------------------------
# Training sections.


MOMENT_DTYPES = ("float32", "bfloat16")
INIT_RNGS = ("auto", "threefry", "unsafe_rbg")


@dataclasses.dataclass(frozen=True)
class OptConfig:
  """`config.opt`: AdamW, linear warmup then cosine decay, clipping."""
  # Learning rate after warmup (per step).
  peak_lr: float = 3e-3
  # Linear warmup from 0 (steps).
  warmup_steps: int = 50
  # Final lr as a fraction of peak_lr.
  end_lr_ratio: float = 0.1
  # Warmup + cosine length (steps); None = train.num_steps.
  decay_steps: Optional[int] = None
  # Decoupled decay (fraction of lr per step); which parameters decay is
  # `kda_lm.optimizer.weight_decay_mask`'s rule.
  weight_decay: float = 0.1
  # Adam moment decays and epsilon.
  b1: float = 0.9
  b2: float = 0.98
  eps: float = 1e-8
  # Global gradient-norm clip; 0 = none.
  clip_norm: float = 1.0
  # dtype of both Adam moments: "float32", or "bfloat16" (half the
  # optimizer state's bytes and of its traffic each step, as DeepSeek-V3
  # trained; the update itself is computed in float32).
  moment_dtype: str = "float32"

  def __post_init__(self):
    if self.warmup_steps < 0 or not self.peak_lr >= 0:
      raise ValueError("config.opt.warmup_steps and peak_lr must be >= 0.")
    if self.moment_dtype not in MOMENT_DTYPES:
      raise ValueError(f"config.opt.moment_dtype must be one of "
                       f"{MOMENT_DTYPES}, got {self.moment_dtype!r}.")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """`config.train`: length, logging, seed."""
  # Optimizer steps in the run.
  num_steps: int = 400
  # Steps between metric rows (host syncs).
  log_every: int = 20
  # Parameter init / state rng seed.
  seed: int = 0
  # Stop once eval accuracy reaches this (fraction); None = run all steps.
  stop_at_eval_accuracy: Optional[float] = None
  # Also write tensorboardX event files.
  tensorboard: bool = False
  # JAX's persistent compilation cache, so that a rerun or a resume reads
  # its compiled steps back: "workdir" (<workdir>/jax_cache), a folder, or
  # "" (off). A cache folder set by JAX_COMPILATION_CACHE_DIR wins.
  compilation_cache: str = "workdir"
  # Progress bar: None = on a terminal only, True/False = always/never.
  progress_bar: Optional[bool] = None
  # Resume even though model or data keys differ from the checkpoint's
  # config (the new values take effect: the data stream restarts under
  # them; config_history.jsonl records the change). Off: such a resume is
  # refused, listing `key: saved -> given`.
  allow_config_change: bool = False
  # Rematerialisation per layer: none | save_dots | save_outputs | full
  # (REMAT_POLICIES; what each keeps: kda_lm/stack.py).
  remat: str = "none"
  # Micro-batches per optimizer step: the step's batch (data.batch_size
  # rows) runs in this many slices of batch_size / n rows, gradients and
  # statistics summed, the update that of the whole batch.
  grad_accum_steps: int = 1
  # Strided pieces of each row that the LM head and the cross-entropy run
  # in (kda_lm/losses.py): n > 1 holds one piece's [B, T/n, W] float32
  # logits at a time (recomputed in the backward pass) instead of the
  # whole row's, for the main and the MTP heads, in training and in the
  # eval step. Must divide T (and T/n the context axis). 1 = the model
  # returns logits as usual.
  loss_chunks: int = 1
  # Also log `update_norm`, the global norm of the optimizer's update. Off
  # by default: it is one more pass over every parameter's update, which
  # XLA cannot fuse into the update itself (7% of the 4-layer benchmark
  # step on a TPU v5e, docs/performance.md). `grad_norm` is always logged:
  # the clipping computes it anyway.
  log_update_norm: bool = False
  # The random-number generator of the parameters' initialisation:
  # "threefry" (JAX's default; the same values on every backend and mesh),
  # "unsafe_rbg" (XLA's RngBitGenerator, as MaxText's training uses; the
  # values depend on the backend), or "auto": unsafe_rbg on accelerators,
  # threefry on the CPU. On a TPU v5e ling3_tiny's state initialisation
  # compiles in 11 s with unsafe_rbg against 45 s with threefry
  # (docs/performance.md). The state's own rng is threefry.
  init_rng: str = "auto"

  def __post_init__(self):
    if self.init_rng not in INIT_RNGS:
      raise ValueError(f"config.train.init_rng must be one of {INIT_RNGS}, "
                       f"got {self.init_rng!r}.")
    for name in ("num_steps", "log_every", "grad_accum_steps",
                 "loss_chunks"):
      if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
        raise ValueError(f"config.train.{name} must be an int >= 1, got "
                         f"{getattr(self, name)!r}.")
    check_remat(self.remat)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """`config.eval`: periodic validation."""
  # Steps between evals (0 = no eval).
  every_steps: int = 50
  # Batches per eval (data.batch_size rows each); None = the whole split.
  num_batches: Optional[int] = None

  def __post_init__(self):
    if self.every_steps < 0:
      raise ValueError("config.eval.every_steps must be >= 0 (0: no eval).")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """`config.checkpoint`: Orbax checkpoints, in <workdir>/checkpoints or
  `directory`."""
  # Save and auto-resume.
  enabled: bool = True
  # Steps between saves (and the last step).
  every_steps: int = 100
  # Seconds between saves, beside every_steps (whichever comes first);
  # checked at log steps (train.log_every). None: steps only.
  every_seconds: Optional[float] = None
  # Newest checkpoints kept.
  max_to_keep: int = 3
  # Write arrays in a background thread: True, False, or None = when the
  # train state is at least 256 MiB per process (a smaller one is written
  # faster than the loop loses to the thread: manager.ASYNC_MIN_BYTES).
  async_save: Optional[bool] = None
  # Where the checkpoints go: None = <workdir>/checkpoints, or a URL
  # (gs://bucket/run/checkpoints, through etils.epath) or a local path (a
  # relative one from the workdir); the workdir keeps the lock, config.json
  # (which inference reads) and the metrics.
  directory: Optional[str] = None

  def __post_init__(self):
    if self.every_steps < 1:
      raise ValueError("config.checkpoint.every_steps must be >= 1.")
    if self.directory is not None and not (
        isinstance(self.directory, str) and self.directory.strip()):
      raise ValueError("config.checkpoint.directory must be None or a path "
                       f"or URL, got {self.directory!r}.")
    if self.async_save not in (None, True, False):
      raise ValueError("config.checkpoint.async_save must be None, True or "
                       f"False, got {self.async_save!r}.")
    if self.every_seconds is not None and not (
        isinstance(self.every_seconds, (int, float))
        and not isinstance(self.every_seconds, bool)
        and self.every_seconds > 0):
      raise ValueError("config.checkpoint.every_seconds must be None or a "
                       f"number > 0, got {self.every_seconds!r}.")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """`config.mesh`: devices as a (data, fsdp, expert, context) mesh."""
  # Data-parallel devices; -1 = all / (fsdp * expert * context).
  data: int = -1
  # Devices each parameter is sharded over.
  fsdp: int = 1
  # Expert parallelism: devices the routed experts are split over (E must
  # be a multiple; more data parallelism for the other layers); see
  # docs/expert_parallel.md. May change on resume.
  expert: int = 1
  # Context parallelism: devices each row's tokens are split over (T must
  # be a multiple); see kda_lm/parallel/context.py. May change on resume.
  context: int = 1
  # jax.distributed.initialize (multi-host).
  distributed: bool = False
  # jax.distributed.initialize arguments; None = auto-detect.
  coordinator_address: Optional[str] = None
  num_processes: Optional[int] = None
  process_id: Optional[int] = None
  # Seconds every process may take to reach the coordinator (distributed).
  coordinator_timeout_s: int = 300
  # Seconds without a heartbeat after which the coordination service
  # declares a process dead and stops the others (distributed).
  heartbeat_timeout_s: int = 100
  # MiB of host memory the TPU runtime pins for transfers (libtpu's
  # TPU_PREMAPPED_BUFFER_SIZE, which wins if set; 0 = libtpu's 4 GiB). Less
  # starts it seconds sooner (v5e: 5-10 s at 4 GiB, 1.1-2.3 s at 64-256
  # MiB), but transfers larger than it are 7-28x slower: small models only.
  tpu_premapped_buffer_mib: int = 0


# The sections of a training config besides `data` (see data/pipeline.py).
SECTIONS = {"model": ModelConfig, "opt": OptConfig, "train": TrainConfig,
            "eval": EvalConfig, "checkpoint": CheckpointConfig,
            "mesh": MeshConfig}


# ---------------------------------------------------------------------------
# A whole training config.

# Every section's name, in the order a config prints them.
RUN_SECTIONS = ("model", "data", *[s for s in SECTIONS if s != "model"])


class RunConfig(NamedTuple):
  """The sections of a training config, typed and validated."""
  model: ModelConfig
  data: pipeline.DataConfig
  opt: OptConfig
  train: TrainConfig
  eval: EvalConfig
  checkpoint: CheckpointConfig
  mesh: MeshConfig


def check_config(config: ml_collections.ConfigDict) -> RunConfig:
  """Reads every section into its dataclass; rejects unknown keys.

  Args:
    config: the full training config.

  Returns:
    The typed sections.

  Raises:
    ValueError: an unknown or missing section or key (the message names it),
      a value out of range, data with more token ids than the model, or
      routed experts that do not divide over `config.mesh.expert`.
  """
  keys = set(config.keys()) if hasattr(config, "keys") else set()
  unknown = sorted(keys - set(RUN_SECTIONS))
  if unknown:
    raise ValueError(f"Unknown config section 'config.{unknown[0]}'; known "
                     f"sections: {list(RUN_SECTIONS)}.")
  missing = [s for s in RUN_SECTIONS if s not in keys]
  if missing:
    raise ValueError(f"Missing config sections: {missing}.")
  typed = {name: from_config(cls, config[name], name,
                             required=name != "model")
           for name, cls in SECTIONS.items()}
  run = RunConfig(data=pipeline.DataConfig.from_config(config.data), **typed)
  sharding.check_expert_axis(run.mesh.expert, run.model.num_experts)
  data_vocab = run.data.vocab_size()
  if data_vocab > run.model.vocab_size:
    raise ValueError(
        f"The data has {data_vocab} token ids (config.data: "
        f"{run.data.name} and its tokenizer) but the model only "
        f"{run.model.vocab_size} (config.model.vocab_size). Give "
        f"the model {data_vocab}: --config.model.vocab_size={data_vocab}, "
        f"or, where the config makes the model's follow the data's as "
        f"configs/ling3_tiny.py does, --config.data.vocab_size={data_vocab} "
        f"(then config.json records {data_vocab} for both); "
        f"configs/ling3_tiny.py:text_bytes (bytes) and :text (a BPE) set "
        f"it for you.")
  return run
