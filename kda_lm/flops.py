"""Parameter counts, analytic training FLOPs, and device peaks: for MFU.

One home for the numbers the training log (TFLOP/s per device, MFU), the
fit report and the compile checks share:

- `count_params`: total / activated / MTP parameters. "Activated" is what
  one token reads: every parameter but the embedding table, and of the
  routed experts' weights only k of E.
- `step_flops`: training FLOPs of one step of B rows of T tokens (all
  devices): 6 x activated parameters x tokens, plus causal MLA attention
  and the KDA chunk core (forward and backward, 3x the forward).
- `peak_flops`: a device kind's dense bfloat16 peak, from its vendor's
  data sheet; None where unknown (CPUs).
"""

from typing import Any, Optional

import numpy as np

from kda_lm import config as config_lib
from kda_lm import model as model_lib
from kda_lm.ops.kda import api as kda_api

# Dense bfloat16 peak per chip, TFLOP/s (Google Cloud TPU and NVIDIA data
# sheets), by `jax.Device.device_kind` prefix; longest prefix first.
PEAK_BF16_TFLOPS = {
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,        # v5e
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v5": 459.0,             # v5p reports "TPU v5"
    "TPU v6 lite": 918.0,        # v6e (Trillium)
    "TPU v6e": 918.0,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100": 989.0,        # SXM
    "NVIDIA H200": 989.0,
    "NVIDIA B200": 2250.0,
}


def count_params(cfg: config_lib.ModelConfig, params: Any = None
                 ) -> dict[str, int]:
  """Total / activated / MTP parameters.

  Args:
    cfg: the model's settings.
    params: its parameters (or their shapes), any layout; None: traced with
      `jax.eval_shape` (no memory).

  Returns:
    `total` (main model), `activated`, `mtp` (all MTP-layer parameters) and
    `mtp_activated`.
  """
  if params is None:
    params = model_lib.abstract_params(cfg, seq_len=1)
  E, k = cfg.num_experts, cfg.num_experts_per_tok
  out = dict(total=0, activated=0, mtp=0, mtp_activated=0)
  for module, entries in params.items():
    for name, p in entries.items():
      n = int(np.prod(p.shape))
      active = n
      if module == "embed":
        active = 0
      elif module.endswith("/moe") and name in ("gate_proj", "up_proj",
                                                "down_proj"):
        active = n // E * k
      mtp = module.startswith("mtp_")
      out["mtp" if mtp else "total"] += n
      out["mtp_activated" if mtp else "activated"] += active
  return out


def step_flops(cfg: config_lib.ModelConfig, B: int, T: int,
               params: Any = None) -> float:
  """Training FLOPs of one step of B rows of T tokens (all devices): the
  main stack, the MTP layers, and the LM head once for the main output
  and once per MTP layer (a tied head is the embedding table, which
  `count_params` leaves out of `activated`).

  Args:
    cfg: the model's settings.
    B: rows per step.
    T: tokens per row.
    params: as `count_params`'s.
  """
  counts = count_params(cfg, params)
  n_mtp = cfg.num_mtp_layers
  heads = (1 + n_mtp if cfg.tie_embeddings else n_mtp) * (
      cfg.d_model * cfg.vocab_size)
  matmul = 6.0 * (counts["activated"] + counts["mtp_activated"] + heads
                  ) * B * T
  pairs = B * T * (T + 1) / 2.0                 # causal query-key pairs
  kinds = cfg.attention_pattern + cfg.mtp_layer_kind * n_mtp
  mla_layers = kinds.count("M")
  mla = 3.0 * mla_layers * pairs * 2 * cfg.mla_num_heads * (
      cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
  H, K, V = cfg.num_heads, cfg.head_dim, cfg.kda_head_v_dim
  C = kda_api.default_chunk_size("pallas")
  # Per token and head: q k^T and k k^T over the chunk (causal half), the
  # intra-chunk outputs, and the q S, k S and k^T v state products.
  kda_token = 2 * (C / 2) * K * 2 + 2 * (C / 2) * V + 3 * 2 * K * V
  kda = 3.0 * kinds.count("K") * B * T * H * kda_token
  return matmul + mla + kda


def peak_flops(device_kind: str) -> Optional[float]:
  """Dense bfloat16 FLOP/s of one chip of `device_kind`, or None."""
  for prefix in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
    if device_kind.startswith(prefix):
      return PEAK_BF16_TFLOPS[prefix] * 1e12
  return None
