"""MultiHeadLatentAttention: DeepSeek-V2/V3 MLA with packed-document masks.

Shape glossary (docs/glossary.md): B batch rows, T tokens (S: key tokens,
t: a block of T), D model width, H heads, U = qk_nope_head_dim,
R = qk_rope_head_dim, K = U + R (query/key head dims), V = v_head_dim,
Q = q_lora_rank, Z = kv_lora_rank; X = U + V (kv_b_proj's output per head).

  Q:   [q_nope, q_rope] = RMSNorm(x W_qa) W_qb      (or x W_q when Q = 0)
  KV:  [c_kv, k_rope] = x W_kva; [k_nope, v] = RMSNorm(c_kv) W_kvb
       (with `bias`: x W_qa + b_qa, x W_kva + b_kva and y = o W_o + b_o)
  RoPE (interleaved, per-document positions) on q_rope and on the single
       k_rope shared by all heads; skipped with `use_nope` (Kimi Linear).
       With YaRN (`rope_scaling`, `kda_lm/layers/rope.py`) its frequencies
       are blended and both rotated parts multiplied by its attention factor.
  s = (q_nope . k_nope + q_rope . k_rope) * scale,
      scale = m / sqrt(U + R), m = YaRN's `softmax_scale_factor` (else 1)
  mask = causal & same segment & key not padding
  o = softmax(s) v  [* sigmoid(x W_g) per head, Ling 3.0's gated MLA]
  y = o W_o

Scores and softmax are float32. A padding query attends to nothing and
outputs zeros. Rows longer than `q_block` attend in causal query blocks
(block [a, b) reads keys [0, b) only), each rematerialised in the backward
pass, so long rows neither compute the upper triangle's blocks nor store
the [T,T] probabilities.

The softmax attention itself, on one device and under context
parallelism, is `kda_lm/layers/attention.py`.

Decoding (`kda_lm.infer.decoding`): `max_len=S` (a prefill) also returns an
`MLACache`: the normalised latent `c_kv` and the rotated shared RoPE key of
every position up to `S` (Z + R values per token), with the first valid slot
and the length of each row (left padding before a row's last document is
masked). Passing `cache` decodes one token per row in the absorbed form
(DeepSeek-V2): `W_kvb`'s key part is folded into the query
(`q_lat = W_uk q_nope`, [B,H,Z]) and its value part applied after the
softmax, so the step attends in latent space and never expands keys or
values:

  s = (q_lat . c_kv + q_rope . k_rope) * scale           [B,H,S]
  o = (softmax(s) c_kv) W_uv                               [B,H,V]
"""

from typing import Any, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp

from kda_lm import segments
from kda_lm.layers import attention, linear, norm, rope
from kda_lm.parallel import maps as parallel_maps

# The projections that get a bias with `bias` (as the formats'
# `attention_bias`: never q_proj, q_b_proj, kv_b_proj or g_proj).
_BIASED = ("q_a_proj", "kv_a_proj", "o_proj")


class MLACache(NamedTuple):
  """An MLA layer's decode cache (S = max_len slots).

  Attributes:
    c_kv: [B,S,Z] normalised KV latents (`kv_a_norm(c_kv)`), zero beyond
      `lengths`.
    k_rope: [B,S,R] shared RoPE keys, rotated at their positions.
    starts: [B] int32, each row's first valid slot (left padding before).
    lengths: [B] int32, slots filled (the next token's slot); the next
      token's position is `lengths - starts`.
  """
  c_kv: jax.Array
  k_rope: jax.Array
  starts: jax.Array
  lengths: jax.Array


def prefill_cache(c_BTZ: jax.Array, k_rope_BTR: jax.Array,
                  segment_ids: Optional[jax.Array], max_len: int
                  ) -> MLACache:
  """The cache after a prefill: every row continues its last segment.

  Args:
    c_BTZ: [B,T,Z] normalised latents.
    k_rope_BTR: [B,T,R] rotated RoPE keys.
    segment_ids: [B,T] ids or None (one document per row).
    max_len: S >= T, the slots to allocate.

  Returns:
    The `MLACache`.

  Raises:
    ValueError: T > max_len.
  """
  B, T, _ = c_BTZ.shape
  if isinstance(max_len, bool) or not isinstance(max_len, int) or (
      max_len < T):
    raise ValueError(f"max_len must be an int >= the prompt length {T}, got "
                     f"{max_len!r}.")
  pad = ((0, 0), (0, max_len - T), (0, 0))
  if segment_ids is None:
    n_last_B = jnp.full((B,), T, jnp.int32)
  else:
    n_last_B = jnp.where(segment_ids[:, -1] != 0,
                         segments.offsets(segment_ids)[:, -1] + 1, 0)
  return MLACache(c_kv=jnp.pad(c_BTZ, pad), k_rope=jnp.pad(k_rope_BTR, pad),
                  starts=(T - n_last_B).astype(jnp.int32),
                  lengths=jnp.full((B,), T, jnp.int32))


def _output(x, o_BTHV, segment_ids, dense, output_gate):
  """Zeroes padding, applies the output gate and `o_proj`: [B,T,D].

  A function, not a method, so that the modules it builds inside `__call__`
  carry no method scope in their names.
  """
  B, T, D = x.shape
  H, V = o_BTHV.shape[2:]
  if segment_ids is not None:
    o_BTHV = jnp.where((segment_ids != 0)[:, :, None, None], o_BTHV, 0.0)
  if output_gate:
    gate_BTH = jax.nn.sigmoid(dense(H, "g_proj")(x).astype(jnp.float32))
    o_BTHV = o_BTHV * gate_BTH[..., None]
  o_BTHV = o_BTHV.astype(x.dtype)
  return dense(D, "o_proj")(o_BTHV.reshape(B, T, H * V))


def _decode_attend(q_nope_BHU, q_rope_BHR, c_BZ, k_rope_BR, cache, w_ZHX,
                   scale):
  """One token per row against the cache, in the absorbed form.

  Returns:
    (o [B,H,V] float32, the cache with the token written).
  """
  B = c_BZ.shape[0]
  U = q_nope_BHU.shape[-1]
  rows = jnp.arange(B)
  c_BSZ = cache.c_kv.at[rows, cache.lengths].set(c_BZ.astype(
      cache.c_kv.dtype))
  r_BSR = cache.k_rope.at[rows, cache.lengths].set(k_rope_BR.astype(
      cache.k_rope.dtype))
  w_ZHU, w_ZHV = w_ZHX[..., :U], w_ZHX[..., U:]
  f32 = jnp.float32
  q_lat_BHZ = jnp.einsum("bhn,chn->bhc", q_nope_BHU, w_ZHU.astype(
      q_nope_BHU.dtype), preferred_element_type=f32)
  s_BHS = (jnp.einsum("bhc,bsc->bhs", q_lat_BHZ.astype(c_BSZ.dtype), c_BSZ,
                      preferred_element_type=f32)
           + jnp.einsum("bhr,bsr->bhs", q_rope_BHR, r_BSR,
                        preferred_element_type=f32)) * scale
  slot_S = jnp.arange(c_BSZ.shape[1])
  valid_BS = ((slot_S >= cache.starts[:, None])
              & (slot_S <= cache.lengths[:, None]))
  s_BHS = jnp.where(valid_BS[:, None], s_BHS, attention.MASK_VALUE)
  p_BHS = jax.nn.softmax(s_BHS, axis=-1)
  o_lat_BHZ = jnp.einsum("bhs,bsc->bhc", p_BHS.astype(c_BSZ.dtype), c_BSZ,
                         preferred_element_type=f32)
  o_BHV = jnp.einsum("bhc,che->bhe", o_lat_BHZ, w_ZHV.astype(f32))
  return o_BHV, cache._replace(c_kv=c_BSZ, k_rope=r_BSR,
                               lengths=cache.lengths + 1)


def _kv_b_weight(Z, H, X, param_dtype):
  """`kv_b_proj`'s weight as [Z,H,X] (X = U + V), for the absorbed decode.

  The same parameter `linear.Dense(H * X, name="kv_b_proj")` creates in the
  full forward (called from `__call__`, so it lands in the same scope).
  """
  with hk.name_scope("kv_b_proj"):
    w_ZHX = hk.get_parameter("w", [Z, H * X], param_dtype,
                             init=hk.initializers.TruncatedNormal(Z ** -0.5))
  return w_ZHX.reshape(Z, H, X)


def _check_shapes(x, segment_ids, positions, cache):
  """Returns (B, T, D) of `x`.

  Raises:
    ValueError: `x` is not [B,T,D], an id/position array is not [B,T], or a
      decode step (`cache`) gets T != 1, segment ids or positions.
  """
  if x.ndim != 3:
    raise ValueError(f"x must be [B,T,D], got shape {x.shape}.")
  B, T, D = x.shape
  if positions is not None and positions.shape != (B, T):
    raise ValueError(f"positions must be [B,T] = {(B, T)}, got "
                     f"{positions.shape}.")
  if cache is not None and (T != 1 or segment_ids is not None
                            or positions is not None):
    raise ValueError(f"An MLA decode step (cache) takes one token per row "
                     f"and no segment_ids or positions; got T={T}.")
  return B, T, D


def _rope_positions(B, T, segment_ids, positions, cache):
  """RoPE positions [B,T]: the given ones, the next slot's when decoding,
  else per document (restarting at 0) or 0..T-1."""
  if cache is not None:
    return (cache.lengths - cache.starts)[:, None]
  if positions is not None:
    return positions
  if segment_ids is None:
    return jnp.broadcast_to(jnp.arange(T), (B, T))
  return segments.positions_from_segment_ids(segment_ids)


def _attend_one_device(q_BTHK, c_kv_BTZ, k_rope_BTR, segment_ids, dense, *,
                       U, V, scale, q_block):
  """The attention core on one device: keys and values expanded from the
  latent by `kv_b_proj` (built here, in the caller's module scope), the
  shared RoPE key broadcast to every head. Returns [B,T,H,V] float32."""
  B, T, H, _ = q_BTHK.shape
  kv_BTHX = dense(H * (U + V), "kv_b_proj")(c_kv_BTZ).reshape(
      B, T, H, U + V)
  k_BTHK, v_BTHV = attention.split_keys(kv_BTHX, k_rope_BTR, U)
  if segment_ids is None:
    piece_BT = valid_BT = None
  else:
    piece_BT, valid_BT = segments.piece_ids(segment_ids), segment_ids != 0
  return attention.attend(q_BTHK, k_BTHK, v_BTHV, piece_BT, valid_BT,
                          scale=scale, q_block=q_block)


class MultiHeadLatentAttention(hk.Module):
  """MLA with an optional low-rank query and an optional output gate."""

  def __init__(self, num_heads: int, *, q_lora_rank: int, kv_lora_rank: int,
               qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
               rope_theta: float = 10000.0,
               rope_scaling: rope.RopeScaling = rope.NO_SCALING,
               use_nope: bool = False, output_gate: bool = False,
               bias: bool = False, norm_eps: float = 1e-6,
               q_block: int = 512, param_dtype=jnp.float32,
               name: Optional[str] = None):
    """Initialises the module.

    Args:
      num_heads: H.
      q_lora_rank: Q, rank of the query compression; 0 = a direct `W_q`.
      kv_lora_rank: Z, rank of the compressed KV latent.
      qk_nope_head_dim: U, per-head query/key dims without RoPE.
      qk_rope_head_dim: R, per-head query dims (and shared key dims) that
        carry RoPE; even unless `use_nope`.
      v_head_dim: V, per-head value dims.
      rope_theta: RoPE base.
      rope_scaling: YaRN's frequencies, rotation factor and softmax scale
        (`kda_lm.layers.rope.RopeScaling`); none by default.
      use_nope: no positional rotation (Kimi Linear's NoPE MLA); the R dims
        still exist and the scale still uses U + R.
      output_gate: multiply each head's output by `sigmoid(x W_g)_h`.
      bias: biases in `q_a_proj` (when Q > 0), `kv_a_proj` and `o_proj`
        (the formats' `attention_bias`).
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
               use_nope=use_nope, rope_scaling=rope_scaling)
    self.num_heads = num_heads
    self.q_lora_rank = q_lora_rank
    self.kv_lora_rank = kv_lora_rank
    self.qk_nope_head_dim = qk_nope_head_dim
    self.qk_rope_head_dim = qk_rope_head_dim
    self.v_head_dim = v_head_dim
    self.rope_theta = rope_theta
    self.rope_scaling = rope_scaling
    self.use_nope = use_nope
    self.output_gate = output_gate
    self.bias = bias
    self.norm_eps = norm_eps
    self.q_block = q_block
    self.param_dtype = param_dtype

  def __call__(self, x: jax.Array, segment_ids: Optional[jax.Array] = None,
               positions: Optional[jax.Array] = None, *,
               cache: Optional[MLACache] = None,
               max_len: Optional[int] = None) -> Any:
    """Attends within each document.

    Args:
      x: [B,T,D] inputs (the compute dtype).
      segment_ids: optional [B,T] int ids (0 = padding); None = one document
        per row.
      positions: optional [B,T] int RoPE positions; None = derived from
        `segment_ids` (restarting at 0 per document), or 0..T-1.
      cache: optional `MLACache` of the tokens before `x` (decoding: T = 1,
        no `segment_ids` or `positions`; the position comes from the cache).
      max_len: a prefill: also return the cache, with this many slots.

    Returns:
      [B,T,D] in `x`'s dtype; with `cache` or `max_len`, `(y, MLACache)`.

    Raises:
      ValueError: `x` is not [B,T,D], an id/position array is not [B,T],
        or a decode step gets T != 1, segment ids or positions.
    """
    B, T, _ = _check_shapes(x, segment_ids, positions, cache)
    segment_ids = segments.check(segment_ids, (B, T))
    # Modules are built inside __call__ so their names carry no method scope.
    biased = _BIASED if self.bias else ()
    dense = lambda size, name: linear.Dense(
        size, with_bias=name in biased, param_dtype=self.param_dtype,
        name=name)
    rms = lambda name: norm.RMSNorm(self.norm_eps, self.param_dtype,
                                    name=name)
    H, U, R = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
    V, Z = self.v_head_dim, self.kv_lora_rank

    if self.q_lora_rank:
      c_q = rms("q_a_norm")(dense(self.q_lora_rank, "q_a_proj")(x))
      q_BTHK = dense(H * (U + R), "q_b_proj")(c_q)
    else:
      q_BTHK = dense(H * (U + R), "q_proj")(x)
    q_BTHK = q_BTHK.reshape(B, T, H, U + R)
    kv_a = dense(Z + R, "kv_a_proj")(x)
    c_kv_BTZ = rms("kv_a_norm")(kv_a[..., :Z])
    k_rope_BTR = kv_a[..., Z:]
    q_nope_BTHU, q_rope_BTHR = q_BTHK[..., :U], q_BTHK[..., U:]
    k_rope_BT1R = k_rope_BTR[:, :, None, :]
    if R and not self.use_nope:
      positions = _rope_positions(B, T, segment_ids, positions, cache)
      q_rope_BTHR, k_rope_BT1R = (
          rope.apply_rope(a, positions, self.rope_theta, self.rope_scaling)
          for a in (q_rope_BTHR, k_rope_BT1R))
    scale = (U + R) ** -0.5 * rope.softmax_scale_factor(self.rope_scaling)
    if cache is not None:
      o_BHV, new_cache = _decode_attend(
          q_nope_BTHU[:, 0], q_rope_BTHR[:, 0], c_kv_BTZ[:, 0],
          k_rope_BT1R[:, 0, 0], cache,
          _kv_b_weight(Z, H, U + V, self.param_dtype), scale)
      return (_output(x, o_BHV[:, None], None, dense, self.output_gate),
              new_cache)
    q_BTHK = jnp.concatenate([q_nope_BTHU, q_rope_BTHR], axis=-1)
    if parallel_maps.context_size() > 1:
      if max_len is not None:
        raise ValueError("An MLA prefill (max_len) is not supported under "
                         "context parallelism.")
      o_BTHV = attention.attend_context_parallel(
          q_BTHK, c_kv_BTZ, k_rope_BT1R[:, :, 0], segment_ids,
          _kv_b_weight(Z, H, U + V, self.param_dtype), U=U, scale=scale,
          q_block=self.q_block)
      return _output(x, o_BTHV, segment_ids, dense, self.output_gate)
    o_BTHV = _attend_one_device(q_BTHK, c_kv_BTZ, k_rope_BT1R[:, :, 0],
                                segment_ids, dense, U=U, V=V, scale=scale,
                                q_block=self.q_block)
    y = _output(x, o_BTHV, segment_ids, dense, self.output_gate)
    if max_len is None:
      return y
    return y, prefill_cache(c_kv_BTZ, k_rope_BT1R[:, :, 0], segment_ids,
                            max_len)


def check_dims(*, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
               qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
               use_nope: bool,
               rope_scaling: rope.RopeScaling = rope.NO_SCALING) -> None:
  """Validates MLA dimensions (and that RoPE scaling has a RoPE).

  Raises:
    ValueError: a non-int or out-of-range value, no query/key dims at all,
      an odd RoPE dimension with RoPE on, or RoPE scaling with `use_nope`.
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
  if use_nope and rope_scaling.active:
    raise ValueError(f"MLA rope_scaling.type {rope_scaling.type!r} needs "
                     f"RoPE, and use_nope is set; use type 'none'.")


def param_count(d_model: int, num_heads: int, *, q_lora_rank: int,
                kv_lora_rank: int, qk_nope_head_dim: int,
                qk_rope_head_dim: int, v_head_dim: int,
                output_gate: bool, bias: bool = False) -> int:
  """Parameters of one MLA layer, by shape arithmetic (for tests)."""
  D, H, U, R = d_model, num_heads, qk_nope_head_dim, qk_rope_head_dim
  V, Q, Z = v_head_dim, q_lora_rank, kv_lora_rank
  n = (D * Q + Q + Q * H * (U + R)) if Q else D * H * (U + R)
  n += D * (Z + R) + Z + Z * H * (U + V) + H * V * D
  if output_gate:
    n += D * H
  if bias:
    n += Q + Z + R + D
  return int(n)
