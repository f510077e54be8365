"""Softmax attention over packed documents, on one device and split over
`context` shards: the core that `MultiHeadLatentAttention` runs.

Shape glossary (docs/glossary.md): B rows, T query tokens (t: a block of
T), S key tokens, H heads, K query/key dims, V value dims, U no-RoPE dims,
R RoPE dims, Z key/value latent rank, X = U + V.

A query attends to the keys of its own piece (`segments.piece_ids`: one
document not interrupted by padding) at or before its position; padding
keys are never read, and a padding query outputs zeros. Scores and softmax
are float32. Rows longer than `q_block` attend in causal query blocks
(block [a, b) reads keys [0, b) only), each rematerialised in the backward
pass. Under context parallelism the latent, the RoPE key and the piece ids
are gathered whole, and each shard attends for one early and one late piece
of the row, so causal work is the same on every shard
(`_attend_shard_balanced`).
"""

import functools

import jax
import jax.numpy as jnp

from kda_lm import segments
from kda_lm.parallel import context as context_parallel
from kda_lm.parallel import maps as parallel_maps

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


def _slice(x, start, stop):
  return None if x is None else x[:, start:stop]


def attend(q_BTHK, k_BTHK, v_BTHV, piece_BT, valid_BT, *, scale, q_block):
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


def split_keys(kv_BSHX, k_rope_BSR, U):
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
  return [*split_keys(kv_BSHX, k_rope_BSR, U), piece_BS, valid_BS]


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


def attend_context_parallel(q_BTHK, c_kv_BTZ, k_rope_BTR, segment_ids,
                             w_ZHX, *, U, scale, q_block):
  """The attention core with T split over the `context` mesh axis: local
  queries, the latent, RoPE key and piece ids gathered over all shards.
  Balanced (`_attend_shard_balanced`) when each shard holds an even number
  of tokens."""
  B, T = q_BTHK.shape[:2]
  ids_BT = (jnp.ones((B, T), jnp.int32) if segment_ids is None
            else segment_ids)
  piece_BT = segments.piece_ids(ids_BT)
  balanced = (T // parallel_maps.context_size()) % 2 == 0
  shard = _attend_shard_balanced if balanced else _attend_shard_contiguous
  return context_parallel.gather_map(
      functools.partial(shard, U=U, scale=scale, q_block=q_block),
      [q_BTHK, piece_BT], [c_kv_BTZ, k_rope_BTR, piece_BT, ids_BT != 0],
      [w_ZHX])
