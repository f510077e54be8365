"""MultiHeadLatentAttention: DeepSeek-V2/V3 MLA with packed-document masks.

Shape glossary (`kda_lm/model.py`'s): B batch rows, T tokens (S: key
tokens), D model width, H heads, Z = qk_nope_head_dim, R = qk_rope_head_dim,
K = Z + R query/key dims per head, V = v_head_dim, Q = q_lora_rank,
L = kv_lora_rank.

  Q:   [q_nope, q_rope] = RMSNorm(x W_qa) W_qb      (or x W_q when Q = 0)
  KV:  [c_kv, k_rope] = x W_kva; [k_nope, v] = RMSNorm(c_kv) W_kvb
  RoPE (interleaved, per-document positions) on q_rope and on the single
       k_rope shared by all heads; skipped with `use_nope` (Kimi Linear).
  s = (q_nope . k_nope + q_rope . k_rope) / sqrt(Z + R)
  mask = causal & same segment & key not padding
  o = softmax(s) v  [* sigmoid(x W_g) per head, Ling 3.0's gated MLA]
  y = o W_o

Scores and softmax are float32. A padding query attends to nothing and
outputs zeros. Rows longer than `q_block` attend in causal query blocks
(block [a, b) reads keys [0, b) only), each rematerialised in the backward
pass, so long rows neither compute the upper triangle's blocks nor store
the [T,T] probabilities.
"""

import functools
from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp

from kda_lm import segments
from kda_lm.layers import linear, norm, rope

# A large finite negative: exp() of it underflows to exactly 0, and a row
# with every entry masked stays finite (no NaN) in forward and backward.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _block_mask(start, stop, S, piece_BT, valid_BT):
  """Mask of queries [start, stop) against keys [0, S): [B or 1,1,t,S]."""
  t = jnp.arange(start, stop)
  mask = (t[:, None] >= jnp.arange(S)[None, :])[None]
  if piece_BT is not None:
    same = piece_BT[:, start:stop, None] == piece_BT[:, None, :S]
    mask = mask & same & valid_BT[:, None, :S]
  return mask[:, None]


def _attend_block(q_BtHK, k_BSHK, v_BSHV, piece_BT, valid_BT, *, start,
                  scale):
  """Softmax attention of queries [start, start+t) over keys [0, S).

  Returns:
    [B,t,H,V] float32.
  """
  stop, S = start + q_BtHK.shape[1], k_BSHK.shape[1]
  s_BHtS = jnp.einsum("bthp,bshp->bhts", q_BtHK, k_BSHK,
                      preferred_element_type=jnp.float32) * scale
  mask = _block_mask(start, stop, S, piece_BT, valid_BT)
  s_BHtS = jnp.where(mask, s_BHtS, MASK_VALUE)
  p_BHtS = jax.nn.softmax(s_BHtS, axis=-1).astype(v_BSHV.dtype)
  return jnp.einsum("bhts,bshe->bthe", p_BHtS, v_BSHV,
                    preferred_element_type=jnp.float32)


def _attend(q_BTHK, k_BTHK, v_BTHV, piece_BT, valid_BT, *, scale, q_block):
  """Masked softmax attention of all queries: [B,T,H,V] float32.

  Rows longer than `q_block` attend in causal query blocks: block [a, b)
  only reads keys [0, b), and its scores are recomputed in the backward pass
  instead of stored.
  """
  T = q_BTHK.shape[1]
  if T <= q_block:
    return _attend_block(q_BTHK, k_BTHK, v_BTHV, piece_BT, valid_BT,
                         start=0, scale=scale)
  outs = []
  for start in range(0, T, q_block):
    stop = min(start + q_block, T)
    attend = jax.checkpoint(functools.partial(
        _attend_block, start=start, scale=scale))
    outs.append(attend(q_BTHK[:, start:stop], k_BTHK[:, :stop],
                       v_BTHV[:, :stop], piece_BT, valid_BT))
  return jnp.concatenate(outs, axis=1)


class MultiHeadLatentAttention(hk.Module):
  """MLA with an optional low-rank query and an optional output gate."""

  def __init__(self, num_heads: int, *, q_lora_rank: int, kv_lora_rank: int,
               qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
               rope_theta: float = 10000.0, use_nope: bool = False,
               output_gate: bool = False, norm_eps: float = 1e-6,
               q_block: int = 512, param_dtype=jnp.float32,
               name: Optional[str] = None):
    """Initialises the module.

    Args:
      num_heads: H.
      q_lora_rank: Q, rank of the query compression; 0 = a direct `W_q`.
      kv_lora_rank: L, rank of the compressed KV latent.
      qk_nope_head_dim: Z, per-head query/key dims without RoPE.
      qk_rope_head_dim: R, per-head query dims (and shared key dims) that
        carry RoPE; even unless `use_nope`.
      v_head_dim: V, per-head value dims.
      rope_theta: RoPE base.
      use_nope: no positional rotation (Kimi Linear's NoPE MLA); the R dims
        still exist and the scale still uses Z + R.
      output_gate: multiply each head's output by `sigmoid(x W_g)_h`.
      norm_eps: epsilon of the q and kv latent RMSNorms.
      q_block: rows longer than this attend in causal query blocks of this
        many tokens, each recomputed in the backward pass: about half the
        score FLOPs and O(T * q_block) instead of O(T^2) saved memory.
      param_dtype: dtype of the stored parameters.
      name: module name.

    Raises:
      ValueError: inconsistent head dimensions or ranks.
    """
    super().__init__(name=name)
    if isinstance(q_block, bool) or not isinstance(q_block, int) or (
        q_block < 1):
      raise ValueError(f"MLA q_block must be a positive int, got {q_block!r}.")
    check_dims(num_heads=num_heads, q_lora_rank=q_lora_rank,
               kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
               qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
               use_nope=use_nope)
    self.num_heads = num_heads
    # Latent ranks (Q, L), then per-head dims (Z, R, V).
    self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
    self.qk_nope_head_dim = qk_nope_head_dim
    self.qk_rope_head_dim = qk_rope_head_dim
    self.v_head_dim = v_head_dim
    self.rope_theta, self.use_nope = rope_theta, use_nope
    self.output_gate = output_gate
    self.norm_eps = norm_eps
    self.q_block = q_block
    self.param_dtype = param_dtype

  def __call__(self, x: jax.Array, segment_ids: Optional[jax.Array] = None,
               positions: Optional[jax.Array] = None) -> jax.Array:
    """Attends within each document.

    Args:
      x: [B,T,D] inputs (the compute dtype).
      segment_ids: optional [B,T] int ids (0 = padding); None = one document
        per row.
      positions: optional [B,T] int RoPE positions; None = derived from
        `segment_ids` (restarting at 0 per document), or 0..T-1.

    Returns:
      [B,T,D] in `x`'s dtype.

    Raises:
      ValueError: `x` is not [B,T,D] or an id/position array is not [B,T].
    """
    if x.ndim != 3:
      raise ValueError(f"x must be [B,T,D], got shape {x.shape}.")
    B, T, D = x.shape
    for key, arr in (("segment_ids", segment_ids), ("positions", positions)):
      if arr is not None and arr.shape != (B, T):
        raise ValueError(f"{key} must be [B,T] = {(B, T)}, got {arr.shape}.")
    # Modules are built inside __call__ so their names carry no method scope.
    dense = lambda size, name: linear.Dense(
        size, param_dtype=self.param_dtype, name=name)
    rms = lambda name: norm.RMSNorm(self.norm_eps, self.param_dtype,
                                    name=name)
    H, Z, R = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
    V, L = self.v_head_dim, self.kv_lora_rank

    if self.q_lora_rank:
      c_q = rms("q_a_norm")(dense(self.q_lora_rank, "q_a_proj")(x))
      q_BTHK = dense(H * (Z + R), "q_b_proj")(c_q)
    else:
      q_BTHK = dense(H * (Z + R), "q_proj")(x)
    q_BTHK = q_BTHK.reshape(B, T, H, Z + R)
    kv_a = dense(L + R, "kv_a_proj")(x)
    c_kv_BTL, k_rope_BTR = kv_a[..., :L], kv_a[..., L:]
    kv_BTHX = dense(H * (Z + V), "kv_b_proj")(
        rms("kv_a_norm")(c_kv_BTL)).reshape(B, T, H, Z + V)
    k_nope_BTHZ, v_BTHV = kv_BTHX[..., :Z], kv_BTHX[..., Z:]
    q_nope_BTHZ, q_rope_BTHR = q_BTHK[..., :Z], q_BTHK[..., Z:]
    k_rope_BT1R = k_rope_BTR[:, :, None, :]
    if R and not self.use_nope:
      if positions is None:
        positions = (jnp.broadcast_to(jnp.arange(T), (B, T))
                     if segment_ids is None else
                     segments.positions_from_segment_ids(segment_ids))
      q_rope_BTHR = rope.apply_rope(q_rope_BTHR, positions, self.rope_theta)
      k_rope_BT1R = rope.apply_rope(k_rope_BT1R, positions, self.rope_theta)
    q_BTHK = jnp.concatenate([q_nope_BTHZ, q_rope_BTHR], axis=-1)
    k_BTHK = jnp.concatenate(
        [k_nope_BTHZ, jnp.broadcast_to(k_rope_BT1R, (B, T, H, R))], axis=-1)

    if segment_ids is None:
      piece_BT = valid_BT = None
    else:
      piece_BT, valid_BT = segments.piece_ids(segment_ids), segment_ids != 0
    o_BTHV = _attend(q_BTHK, k_BTHK, v_BTHV, piece_BT, valid_BT,
                     scale=(Z + R) ** -0.5, q_block=self.q_block)
    if segment_ids is not None:
      o_BTHV = jnp.where((segment_ids != 0)[:, :, None, None], o_BTHV, 0.0)
    if self.output_gate:
      gate_BTH = jax.nn.sigmoid(
          dense(H, "g_proj")(x).astype(jnp.float32))
      o_BTHV = o_BTHV * gate_BTH[..., None]
    o_BTHV = o_BTHV.astype(x.dtype)
    return dense(D, "o_proj")(o_BTHV.reshape(B, T, H * V))


def check_dims(*, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
               qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
               use_nope: bool) -> None:
  """Validates MLA dimensions.

  Raises:
    ValueError: a non-int or out-of-range value, no query/key dims at all,
      or an odd RoPE dimension with RoPE on.
  """
  for key, value, low in (("num_heads", num_heads, 1),
                          ("q_lora_rank", q_lora_rank, 0),
                          ("kv_lora_rank", kv_lora_rank, 1),
                          ("qk_nope_head_dim", qk_nope_head_dim, 0),
                          ("qk_rope_head_dim", qk_rope_head_dim, 0),
                          ("v_head_dim", v_head_dim, 1)):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ValueError(f"MLA {key} must be an int >= {low}, got {value!r}.")
  if qk_nope_head_dim + qk_rope_head_dim < 1:
    raise ValueError("MLA needs qk_nope_head_dim + qk_rope_head_dim >= 1.")
  if not use_nope and qk_rope_head_dim % 2:
    raise ValueError(f"MLA qk_rope_head_dim must be even for (interleaved) "
                     f"RoPE, got {qk_rope_head_dim}; or set use_nope.")


def param_count(d_model: int, num_heads: int, *, q_lora_rank: int,
                kv_lora_rank: int, qk_nope_head_dim: int,
                qk_rope_head_dim: int, v_head_dim: int,
                output_gate: bool) -> int:
  """Parameters of one MLA layer, by shape arithmetic (for tests)."""
  D, H, Z, R = d_model, num_heads, qk_nope_head_dim, qk_rope_head_dim
  V, Q, L = v_head_dim, q_lora_rank, kv_lora_rank
  n = (D * Q + Q + Q * H * (Z + R)) if Q else D * H * (Z + R)
  n += D * (L + R) + L + L * H * (Z + V) + H * V * D
  if output_gate:
    n += D * H
  return int(n)
