"""MultiHeadLatentAttention: DeepSeek-V2/V3 MLA with packed-document masks.

Shape glossary (docs/glossary.md): B batch rows, T tokens (S: key tokens,
t: a block of T), D model width, H heads, U = qk_nope_head_dim,
R = qk_rope_head_dim, K = U + R (query/key head dims), V = v_head_dim,
Q = q_lora_rank, Z = kv_lora_rank; X = U + V (kv_b_proj's output per head).

  Q:   [q_nope, q_rope] = RMSNorm(x W_qa) W_qb      (or x W_q when Q = 0)
  KV:  [c_kv, k_rope] = x W_kva; [k_nope, v] = RMSNorm(c_kv) W_kvb
  RoPE (interleaved, per-document positions) on q_rope and on the single
       k_rope shared by all heads; skipped with `use_nope` (Kimi Linear).
  s = (q_nope . k_nope + q_rope . k_rope) / sqrt(U + R)
  mask = causal & same segment & key not padding
  o = softmax(s) v  [* sigmoid(x W_g) per head, Ling 3.0's gated MLA]
  y = o W_o

Scores and softmax are float32. A padding query attends to nothing and
outputs zeros. Rows longer than `q_block` attend in causal query blocks
(block [a, b) reads keys [0, b) only), each rematerialised in the backward
pass, so long rows neither compute the upper triangle's blocks nor store
the [T,T] probabilities.

Under context parallelism (`kda_lm/context_parallel.py`) `c_kv`, the RoPE
key and the ids are gathered whole, and each shard attends for one early
and one late piece of the row, so causal work is the same on every shard
(`_attend_shard_balanced`).

Decoding (`kda_lm.decoding`): `max_len=S` (a prefill) also returns an
`MLACache`: the normalised latent `c_kv` and the rotated shared RoPE key of
every position up to `S` (Z + R values per token), with the first valid slot
and the length of each row (left padding before a row's last document is
masked). Passing `cache` decodes one token per row in the absorbed form
(DeepSeek-V2): `W_kvb`'s key part is folded into the query
(`q_lat = W_uk q_nope`, [B,H,Z]) and its value part applied after the
softmax, so the step attends in latent space and never expands keys or
values:

  s = (q_lat . c_kv + q_rope . k_rope) / sqrt(U + R)      [B,H,S]
  o = (softmax(s) c_kv) W_uv                               [B,H,V]
"""

import functools
from typing import Any, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp

from kda_lm import context_parallel, segments
from kda_lm.layers import linear, norm, rope

# A large finite negative: exp() of it underflows to exactly 0, and a row
# with every entry masked stays finite (no NaN) in forward and backward.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _block_mask(t_t, s_S, piece_Bt, piece_BS, valid_BS):
  """Mask of queries at positions `t_t [t]` against keys at positions
  `s_S [S]`: [B or 1,1,t,S]."""
  mask = (t_t[:, None] >= s_S[None, :])[None]
  if piece_Bt is not None:
    same = piece_Bt[:, :, None] == piece_BS[:, None, :]
    mask = mask & same & valid_BS[:, None, :]
  return mask[:, None]


def _masked_scores(q_BtHK, k_BSHK, t_t, s_S, piece_Bt, piece_BS, valid_BS,
                   scale):
  """Scaled float32 scores [B,H,t,S], MASK_VALUE where masked."""
  s_BHtS = jnp.einsum("bthp,bshp->bhts", q_BtHK, k_BSHK,
                      preferred_element_type=jnp.float32) * scale
  mask = _block_mask(t_t, s_S, piece_Bt, piece_BS, valid_BS)
  return jnp.where(mask, s_BHtS, MASK_VALUE)


def _attend_block(q_BtHK, k_BSHK, v_BSHV, t_t, piece_Bt, piece_BS, valid_BS,
                  *, scale):
  """Softmax attention of queries at positions `t_t` over keys [0, S).

  Returns:
    [B,t,H,V] float32.
  """
  s_BHtS = _masked_scores(q_BtHK, k_BSHK, t_t, jnp.arange(k_BSHK.shape[1]),
                          piece_Bt, piece_BS, valid_BS, scale)
  p_BHtS = jax.nn.softmax(s_BHtS, axis=-1).astype(v_BSHV.dtype)
  return jnp.einsum("bhts,bshe->bthe", p_BHtS, v_BSHV,
                    preferred_element_type=jnp.float32)


def _attend_block_lse(q_BtHK, k_BSHK, v_BSHV, t_t, s_S, piece_Bt, piece_BS,
                      valid_BS, *, scale):
  """`_attend_block` over keys at positions `s_S`, with the log-sum-exp of
  each query's masked scores (to merge attention over several key sets).

  Returns:
    (o [B,t,H,V] float32, lse [B,t,H] float32).
  """
  s_BHtS = _masked_scores(q_BtHK, k_BSHK, t_t, s_S, piece_Bt, piece_BS,
                          valid_BS, scale)
  lse_BHt = jax.nn.logsumexp(s_BHtS, axis=-1)
  p_BHtS = jnp.exp(s_BHtS - lse_BHt[..., None]).astype(v_BSHV.dtype)
  o_BtHV = jnp.einsum("bhts,bshe->bthe", p_BHtS, v_BSHV,
                      preferred_element_type=jnp.float32)
  return o_BtHV, jnp.swapaxes(lse_BHt, 1, 2)


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
  s_BHS = jnp.where(valid_BS[:, None], s_BHS, MASK_VALUE)
  p_BHS = jax.nn.softmax(s_BHS, axis=-1)
  o_lat_BHZ = jnp.einsum("bhs,bsc->bhc", p_BHS.astype(c_BSZ.dtype), c_BSZ,
                         preferred_element_type=f32)
  o_BHV = jnp.einsum("bhc,che->bhe", o_lat_BHZ, w_ZHV.astype(f32))
  return o_BHV, cache._replace(c_kv=c_BSZ, k_rope=r_BSR,
                               lengths=cache.lengths + 1)


def _slice(x, start, stop):
  return None if x is None else x[:, start:stop]


def _attend(q_BTHK, k_BTHK, v_BTHV, piece_BT, valid_BT, *, scale, q_block):
  """Masked softmax attention of all queries: [B,T,H,V] float32.

  Rows longer than `q_block` attend in causal query blocks: block [a, b)
  only reads keys [0, b), and its scores are recomputed in the backward pass
  instead of stored.
  """
  T = q_BTHK.shape[1]
  t_T = jnp.arange(T)
  if T <= q_block:
    return _attend_block(q_BTHK, k_BTHK, v_BTHV, t_T, piece_BT, piece_BT,
                         valid_BT, scale=scale)
  outs = []
  for start in range(0, T, q_block):
    stop = min(start + q_block, T)
    attend = jax.checkpoint(functools.partial(_attend_block, scale=scale))
    outs.append(attend(q_BTHK[:, start:stop], k_BTHK[:, :stop],
                       v_BTHV[:, :stop], t_T[start:stop],
                       _slice(piece_BT, start, stop),
                       _slice(piece_BT, 0, stop), _slice(valid_BT, 0, stop)))
  return jnp.concatenate(outs, axis=1)


def _split_keys(kv_BSHX, k_rope_BSR, U):
  """Keys [B,S,H,K] (the no-RoPE part of `kv_b_proj`'s output and the shared
  RoPE key, broadcast to every head) and values [B,S,H,V]."""
  B, S, H, _ = kv_BSHX.shape
  k_BSHK = jnp.concatenate([kv_BSHX[..., :U], jnp.broadcast_to(
      k_rope_BSR[:, :, None], (B, S, H, k_rope_BSR.shape[-1]))], axis=-1)
  return k_BSHK, kv_BSHX[..., U:]


def _expand_keys(whole, w_ZHX, U):
  """Whole-row keys and values from the gathered latent and RoPE key.

  Args:
    whole: [c_kv [B,S,Z], k_rope [B,S,R], piece ids [B,S], valid [B,S]].
    w_ZHX: kv_b_proj's weight [Z,H,U+V].
    U: the unrotated (no-RoPE) dims of a head.

  Returns:
    [k [B,S,H,K], v [B,S,H,V], piece ids [B,S], valid [B,S]].
  """
  c_BSZ, k_rope_BSR, piece_BS, valid_BS = whole
  kv_BSHX = jnp.einsum("bsc,chx->bshx", c_BSZ, w_ZHX.astype(c_BSZ.dtype),
                       preferred_element_type=c_BSZ.dtype)
  return [*_split_keys(kv_BSHX, k_rope_BSR, U), piece_BS, valid_BS]


def _attend_shard_contiguous(offset, local, whole, params, *, U, scale,
                             q_block):
  """One context-parallel shard of MLA, its own queries against the whole
  row (the unbalanced layout, for an odd number of tokens per shard).

  Args:
    offset: int32 global position of the shard's first query.
    local: [q [B,t,H,K], piece ids [B,t]] of the shard's queries.
    whole: [c_kv [B,S,Z], k_rope [B,S,R], piece ids [B,S], valid [B,S]] of
      the whole row (all-gathered).
    params: [kv_b_proj weight [Z,H,U+V]].
    U: the unrotated (no-RoPE) dims of a head.
    scale: score scale.
    q_block: queries per rematerialised block.

  Returns:
    [B,t,H,V] float32.
  """
  q_BtHK, piece_Bt = local
  k_BSHK, v_BSHV, piece_BS, valid_BS = _expand_keys(whole, params[0], U)
  S, t = k_BSHK.shape[1], q_BtHK.shape[1]
  t_t = offset + jnp.arange(t)
  attend = jax.checkpoint(functools.partial(_attend_block, scale=scale))
  outs = []
  for start in range(0, t, q_block):
    stop = min(start + q_block, t)
    # Keys the last shard's block reads ([0, S - t + stop)); earlier shards
    # read fewer, so this static bound covers every shard.
    keys = S - t + stop
    outs.append(attend(q_BtHK[:, start:stop], k_BSHK[:, :keys],
                       v_BSHV[:, :keys], t_t[start:stop],
                       piece_Bt[:, start:stop], piece_BS[:, :keys],
                       valid_BS[:, :keys]))
  return jnp.concatenate(outs, axis=1)


def _attend_piece(q_BtHK, piece_Bt, p, kp, keys, *, diagonal, scale,
                  q_block):
  """Queries of piece `p` against the keys of piece `kp` (pieces of t
  tokens: piece p holds global positions [p t, (p + 1) t)).

  Args:
    q_BtHK: [B,t,H,K] queries; piece_Bt: [B,t] their piece ids.
    p, kp: int32 (traced) piece indices, kp <= p.
    keys: [k [B,S,H,K], v [B,S,H,V], piece ids [B,S], valid [B,S]] of the
      whole row.
    diagonal: kp == p; query block [a, b) of the piece then reads the
      piece's keys [0, b) only (the causal block skip).
    scale: score scale.
    q_block: queries per rematerialised block.

  Returns:
    (o [B,t,H,V], lse [B,t,H]) float32, as `_attend_block_lse`.
  """
  t = q_BtHK.shape[1]
  k_BtHK, v_BtHV, pk_Bt, valid_Bt = [
      jax.lax.dynamic_slice_in_dim(a, kp * t, t, axis=1) for a in keys]
  t_t, s_t = p * t + jnp.arange(t), kp * t + jnp.arange(t)
  attend = jax.checkpoint(functools.partial(_attend_block_lse, scale=scale))
  outs = []
  for start in range(0, t, q_block):
    stop = min(start + q_block, t)
    width = stop if diagonal else t
    outs.append(attend(q_BtHK[:, start:stop], k_BtHK[:, :width],
                       v_BtHV[:, :width], t_t[start:stop], s_t[:width],
                       piece_Bt[:, start:stop], pk_Bt[:, :width],
                       valid_Bt[:, :width]))
  return tuple(jnp.concatenate(parts, axis=1)
               for parts in zip(*outs, strict=True))


def _merge_pieces(results, members):
  """Softmax attention over the union of several key sets: [B,t,H,V].

  Args:
    results: (o [B,t,H,V], lse [B,t,H]) per key set.
    members: bool (traced) per key set: whether it belongs to this query
      piece; the others get weight 0 (exactly, for a query with any key).
  """
  o_stack = jnp.stack([o for o, _ in results])      # [key sets,B,t,H,V]
  lse_stack = jnp.stack([
      jnp.where(keep, lse, MASK_VALUE)
      for (_, lse), keep in zip(results, members, strict=True)])
  w_stack = jax.nn.softmax(lse_stack, axis=0)
  return jnp.einsum("mbth,mbthe->bthe", w_stack, o_stack)


def _attend_shard_balanced(offset, local, whole, params, *, U, scale,
                           q_block):
  """One context-parallel shard of MLA with balanced causal work.

  The row is cut into 2n pieces of t/2 tokens; shard i holds pieces 2i
  and 2i + 1. It attends for its first piece A = 2i and for the second piece
  of its mirror shard n - 1 - i, B = 2n - 1 - 2i (the two swap their second
  pieces' queries and outputs by `ppermute`), so every shard reads 2n + 1
  key pieces: A's and B's diagonal pieces (causal block skip) and 2n - 1
  earlier pieces, pieces 0..2i-1 for A and 0..2n-2-2i for B. The diagonal
  pieces sit at static positions in the work list, the others are sliced
  at traced offsets, and the partial softmaxes merge by log-sum-exp.

  Args and Returns: as `_attend_shard_contiguous` (t even).
  """
  q_BtHK, piece_Bt = local
  keys = _expand_keys(whole, params[0], U)
  t = q_BtHK.shape[1]
  half, n = t // 2, keys[0].shape[1] // t
  i = offset // t
  swap = functools.partial(context_parallel.swap_with_mirror, n=n)
  q_a, q_b = q_BtHK[:, :half], swap(q_BtHK[:, half:])
  piece_a, piece_b = piece_Bt[:, :half], swap(piece_Bt[:, half:])
  p_a, p_b = 2 * i, 2 * n - 1 - 2 * i
  attend = functools.partial(_attend_piece, keys=keys, scale=scale,
                             q_block=q_block)
  res_a = [attend(q_a, piece_a, p_a, p_a, diagonal=True)]
  res_b = [attend(q_b, piece_b, p_b, p_b, diagonal=True)]
  first = [True]
  for m in range(2 * n - 1):
    is_a = m < p_a
    res = attend(jnp.where(is_a, q_a, q_b), jnp.where(is_a, piece_a, piece_b),
                 jnp.where(is_a, p_a, p_b), jnp.where(is_a, m, m - p_a),
                 diagonal=False)
    res_a.append(res)
    res_b.append(res)
    first.append(is_a)
  o_a = _merge_pieces(res_a, first)
  o_b = _merge_pieces(res_b, [True] + [~f for f in first[1:]])
  return jnp.concatenate([o_a, swap(o_b)], axis=1)


def _attend_context_parallel(q_BTHK, c_kv_BTZ, k_rope_BTR, segment_ids,
                             w_ZHX, *, U, scale, q_block):
  """The attention core with T split over the `context` mesh axis: local
  queries, the latent, RoPE key and piece ids gathered over all shards.
  Balanced (`_attend_shard_balanced`) when each shard holds an even number
  of tokens."""
  B, T = q_BTHK.shape[:2]
  ids_BT = (jnp.ones((B, T), jnp.int32) if segment_ids is None
            else segment_ids)
  piece_BT = segments.piece_ids(ids_BT)
  balanced = (T // context_parallel.context_size()) % 2 == 0
  shard = _attend_shard_balanced if balanced else _attend_shard_contiguous
  return context_parallel.gather_map(
      functools.partial(shard, U=U, scale=scale, q_block=q_block),
      [q_BTHK, piece_BT], [c_kv_BTZ, k_rope_BTR, piece_BT, ids_BT != 0],
      [w_ZHX])


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
  for key, arr in (("segment_ids", segment_ids), ("positions", positions)):
    if arr is not None and arr.shape != (B, T):
      raise ValueError(f"{key} must be [B,T] = {(B, T)}, got {arr.shape}.")
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
  k_BTHK, v_BTHV = _split_keys(kv_BTHX, k_rope_BTR, U)
  if segment_ids is None:
    piece_BT = valid_BT = None
  else:
    piece_BT, valid_BT = segments.piece_ids(segment_ids), segment_ids != 0
  return _attend(q_BTHK, k_BTHK, v_BTHV, piece_BT, valid_BT, scale=scale,
                 q_block=q_block)


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
      kv_lora_rank: Z, rank of the compressed KV latent.
      qk_nope_head_dim: U, per-head query/key dims without RoPE.
      qk_rope_head_dim: R, per-head query dims (and shared key dims) that
        carry RoPE; even unless `use_nope`.
      v_head_dim: V, per-head value dims.
      rope_theta: RoPE base.
      use_nope: no positional rotation (Kimi Linear's NoPE MLA); the R dims
        still exist and the scale still uses U + R.
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
    self.q_lora_rank = q_lora_rank
    self.kv_lora_rank = kv_lora_rank
    self.qk_nope_head_dim = qk_nope_head_dim
    self.qk_rope_head_dim = qk_rope_head_dim
    self.v_head_dim = v_head_dim
    self.rope_theta = rope_theta
    self.use_nope = use_nope
    self.output_gate = output_gate
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
    # Modules are built inside __call__ so their names carry no method scope.
    dense = lambda size, name: linear.Dense(
        size, param_dtype=self.param_dtype, name=name)
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
      q_rope_BTHR = rope.apply_rope(q_rope_BTHR, positions, self.rope_theta)
      k_rope_BT1R = rope.apply_rope(k_rope_BT1R, positions, self.rope_theta)
    scale = (U + R) ** -0.5
    if cache is not None:
      o_BHV, new_cache = _decode_attend(
          q_nope_BTHU[:, 0], q_rope_BTHR[:, 0], c_kv_BTZ[:, 0],
          k_rope_BT1R[:, 0, 0], cache,
          _kv_b_weight(Z, H, U + V, self.param_dtype), scale)
      return (_output(x, o_BHV[:, None], None, dense, self.output_gate),
              new_cache)
    q_BTHK = jnp.concatenate([q_nope_BTHU, q_rope_BTHR], axis=-1)
    if context_parallel.context_size() > 1:
      if max_len is not None:
        raise ValueError("An MLA prefill (max_len) is not supported under "
                         "context parallelism.")
      o_BTHV = _attend_context_parallel(
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
  D, H, U, R = d_model, num_heads, qk_nope_head_dim, qk_rope_head_dim
  V, Q, Z = v_head_dim, q_lora_rank, kv_lora_rank
  n = (D * Q + Q + Q * H * (U + R)) if Q else D * H * (U + R)
  n += D * (Z + R) + Z + Z * H * (U + V) + H * V * D
  if output_gate:
    n += D * H
  return int(n)
