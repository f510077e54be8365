"""Shared pieces of every KDA implementation: gates, norms, segments.

Shape glossary (batch-first, as in FLA):
  B: batch rows          T: tokens per row       H: heads
  K: key/query head dim  V: value head dim       n_chunks: T / C
  C: chunk size          c: sub-block size inside a chunk (`SUB_BLOCK`)

Every implementation receives the *canonical* form built here: float32
q, k, v, g (an activated log-decay, <= 0), beta, all exactly zero at padding
tokens, plus two boolean masks: `reset [B,T]` (the state is zeroed before this
token) and `pad [B,T]` (the token is padding and changes nothing).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kda_lm import segments

L2NORM_EPS = 1e-6
# The bounded gate's floor: `lower_bound` lies in [GATE_FLOOR, 0), and
# Ling 3.0 takes the floor itself. Sixteen such gates decay by at most e^80,
# within float32's range, which the chunked paths' factorised decays need.
GATE_FLOOR = -5.0
# c: rows per sub-block inside a chunk, in every chunked implementation (the
# anchored decay factorisation and the blocked triangular solve).
SUB_BLOCK = 16
# Bounded gates let the diagonal sub-blocks factorise their decays as
# exp(L_r) * exp(-L_s), with exp(L_r) down to e^-80 (5 * SUB_BLOCK). Times a
# small component of q or k that leaves float32's normal range (a TPU
# flushes it to zero) and takes the digits of the undecayed terms q_r k_r
# with it: relative error 5e-5 at K = 128. Every implementation that
# factorises so multiplies the row factors by SAFE_BALANCE and divides the
# column factors by it (exact, a power of two): both stay within about
# e^+-44 and their products are unchanged.
SAFE_BALANCE = 2.0 ** 64


def l2norm(x, dtype=jnp.float32):
  """FLA's l2norm_fwd: `x / sqrt(sum(x^2) + 1e-6)` over the last axis, in
  `dtype` (float32; float64 only for a test oracle)."""
  x = x.astype(dtype)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def check_lower_bound(value, where="lower_bound"):
  """Raises ValueError unless `value` lies in [GATE_FLOOR, 0)."""
  if not GATE_FLOOR <= float(value) < 0.0:
    raise ValueError(f"{where} must lie in [{GATE_FLOOR:g}, 0), got "
                     f"{value!r}.")


def kda_gate(g_raw, A_log, dt_bias, lower_bound=None, dtype=jnp.float32):
  """Turns the raw gate projection into a per-channel log decay.

  Args:
    g_raw: [B,T,H,K] raw gate projection.
    A_log: [H] float32.
    dt_bias: [H*K] float32 (head-major) or None.
    lower_bound: None for the softplus form, else a float in [-5, 0) for the
      bounded form.
    dtype: the compute dtype (float32; float64 only for a test oracle).

  Returns:
    [B,T,H,K] log decay in `dtype`: `-exp(A_log) * softplus(g + dt_bias)` or
    `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`.
  """
  H, K = g_raw.shape[-2:]
  x = g_raw.astype(dtype)
  if dt_bias is not None:
    x = x + dt_bias.astype(dtype).reshape(H, K)
  a = jnp.exp(A_log.astype(dtype))[:, None]  # [H,1]
  if lower_bound is None:
    return -a * jax.nn.softplus(x)
  return lower_bound * jax.nn.sigmoid(a * x)


class Segments(NamedTuple):
  """Per-token segment structure derived from `segment_ids`.

  Attributes:
    pad: [B,T] bool, True at padding tokens (segment id 0).
    reset: [B,T] bool, True where the state is zeroed before the token: a
      segment start that is not the row's first segment (the first segment
      starts from `initial_state`).
  """
  pad: jax.Array
  reset: jax.Array


def segments_from_ids(segment_ids):
  """Builds the reset and padding masks from int32 `segment_ids [B,T]`.

  The definition is `kda_lm.segments`': a segment starts at every non-padding
  token whose id differs from the previous token's id. Any layout is allowed:
  ids need not be consecutive, padding may sit between documents, and a
  document interrupted by padding is two segments.
  """
  return Segments(pad=segment_ids == 0, reset=segments.resets(segment_ids))


def canonicalize(q, k, v, g, beta, masks, *, A_log, dt_bias, lower_bound,
                 use_gate_in_kernel, use_qk_l2norm_in_kernel,
                 dtype=jnp.float32):
  """Casts to `dtype`, applies in-kernel gate and norm, zeroes padding.

  Zeroing happens with `where` after the gate and the norm, so the gradient
  reaching any padding input is exactly zero (and finite). Every
  implementation runs in float32; float64 serves only the tests' oracle.
  """
  if use_qk_l2norm_in_kernel:
    q, k = l2norm(q, dtype), l2norm(k, dtype)
  else:
    q, k = q.astype(dtype), k.astype(dtype)
  if use_gate_in_kernel:
    g = kda_gate(g, A_log, dt_bias, lower_bound, dtype)
  else:
    g = g.astype(dtype)
  v = v.astype(dtype)
  beta = beta.astype(dtype)
  keep = ~masks.pad
  keep4 = keep[:, :, None, None]
  zero = jnp.zeros((), dtype)
  q = jnp.where(keep4, q, zero)
  k = jnp.where(keep4, k, zero)
  v = jnp.where(keep4, v, zero)
  g = jnp.where(keep4, g, zero)
  beta = jnp.where(keep[:, :, None], beta, zero)
  return q, k, v, g, beta


def chunk_flops_per_token_head(K, V, C, backward=False):
  """Matmul FLOPs of chunked KDA per token and head (multiply-add = 2).

  Per chunk of C rows: Aqk = (q)(k)^T and Akk = (k)(k)^T with decays, 2 x
  2C^2K; the triangular inverse (I + M)^-1, C^3/3; w = P (beta k e^G), 2C^2K;
  u = P (beta v), 2C^2V; v_new = u - w S, 2CKV; o = (q e^G) S + Aqk v_new,
  2CKV + 2C^2V; S' = e^G_C S + (k e^(G_C - G))^T v_new, 2CKV. Divided by C:

    F = 6CK + 4CV + 6KV + C^2/3        (~1.82e5 for C=64, K=V=128)

  Forward+backward counts 3F (the backward's matmuls are ~2x the forward's;
  the recomputation of checkpointed chunks is not counted). Elementwise work
  (exp, masks) is not counted either.
  """
  f = 6 * C * K + 4 * C * V + 6 * K * V + C * C / 3
  return 3 * f if backward else f
