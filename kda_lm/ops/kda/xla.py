"""Chunked KDA in plain XLA: the WY/UT form with in-chunk segment resets.

Shape glossary: B batch, H heads, N chunks, C chunk size, c sub-block size,
K key dim, V value dim; `L...` stands for leading batch dims (B, H, chunks).

Per chunk of C rows with state S entering it and `G = cumsum(g)` inside the
chunk (derivation in docs/kda.md):

  Aqk[r,s] = sum_d q_r k_s exp(G_r - G_s)            s <= r, same segment
  M[r,s]   = beta_r sum_d k_r k_s exp(G_r - G_s)     s <  r, same segment
  w = (I+M)^-1 (beta k exp(G)) [rows of the chunk's first segment only]
  u = (I+M)^-1 (beta v)
  v_new = u - w S
  o = (q exp(G)) [first segment] S + Aqk v_new          (q pre-scaled)
  S' = exp(G_last) S [if no reset in the chunk]
       + (k exp(G_last - G))^T [last segment] v_new

Segments never need realignment: every cross-segment term is masked, and a
padding row has zero q, k, v, beta and g, so it is transparent.

Pairwise decays are factorised around anchors at the first row of each
c-row sub-block, `exp(G_r - G_s) = exp(G_r - n_i) exp(n_i - G_s)`, where both
factors are <= 1 for every earlier sub-block. Inside a diagonal sub-block the
second factor can overflow (a -1000 gate), so the exact path computes the
pairwise decay there with the exponent (not the result) masked. With
`safe_gate` (every gate >= -5, so a sub-block decays by at most e^80) the
diagonal sub-blocks are factorised too: all matmuls, no pairwise tensor.

Chunks are processed in groups: an outer `lax.scan` over groups whose body is
`jax.checkpoint`ed does the intra-chunk work vectorised over the group's
chunks and an inner scan carries the state. Autodiff keeps only one state per
group plus the inputs, and recomputes a group at a time in the backward pass,
so training memory is O(T*H*(K+V) + (T/C)*H*K*V) and never a state per token.
"""

import functools

import jax
import jax.numpy as jnp

from kda_lm.ops.kda import common

SUB_BLOCK = common.SUB_BLOCK  # c: rows per anchored sub-block, solve block
GROUP_CHUNKS = 8      # chunks per checkpointed group


def _local_frames(g, run, *, sub):
  """Block-local cumulative gates and the sums that chain sub-blocks.

  Every decay the chunk needs is rebuilt from gates of one segment only, in
  frames that restart at each sub-block and each segment start, so values stay
  small (precise) and one document never perturbs another's rounding.

  Each exponent is a masked sum of exactly the gates it spans (never a
  difference of two cumulative sums), so autodiff sends a decay's gradient only
  to the gates between its two ends: gate gradients gather no +x/-x pairs that
  cancel in float32 (strong gates otherwise cost ~100x precision in dA_log).

  Args:
    g: [B,H,G,C,K] log decay (<= 0; 0 at padding).
    run: [B,G,C] segment-run index.
    sub: sub-block size c.

  Returns:
    L [B,H,G,nb,c,K]: cumulative gate from max(block start, segment start) to
      each row; R [B,H,G,nb,c,K]: sum of the same segment's gates after each
      row up to the block's end; tot [B,H,G,nb,K]: L at each block's last row;
      same_b [B,1,G,nb,c,c]: same-segment mask inside each block;
      reach_end [B,1,G,nb,c,1]: the row's segment reaches its block's end.
  """
  *lead, C, K = g.shape
  nb = C // sub
  run_b = run.reshape(*run.shape[:-1], nb, sub)[:, None]      # [B,1,G,nb,c]
  same_b = run_b[..., :, None] == run_b[..., None, :]
  tri = jnp.tril(jnp.ones((sub, sub), bool))
  g_b = g.reshape(*lead, nb, sub, K)
  L = (same_b & tri).astype(jnp.float32) @ g_b
  R = (same_b & ~tri).astype(jnp.float32) @ g_b
  reach_end = (run_b == run_b[..., -1:])[..., None]
  return L, R, L[..., -1, :], same_b, reach_end


@jax.custom_jvp
def _pair_exponents(g_b, L):
  """[..., r, s, K]: G_r - G_s inside each sub-block (same-segment pairs).

  The exponent of the exact pairwise decay exp(G_r - G_s), s <= r. The
  primal is the difference of the segment-local cumulative gates `L` (from
  `_local_frames`, computed from `g_b`); the custom JVP takes the tangent
  from the gates each pair spans, `sum_{s < t <= r} dg_t`, and none through
  `L`, so its transpose (reverse mode) sends each pair's cotangent straight
  to exactly those gates (see `_local_frames` for why). Entries for other
  pairs are finite and must be masked out by the caller, so their
  cotangents are zero.

  Args:
    g_b: [..., c, K] gates of each sub-block.
    L: [..., c, K] their segment-local cumulative sums.
  """
  del g_b  # only its derivative path
  return L[..., :, None, :] - L[..., None, :, :]


@_pair_exponents.defjvp
def _pair_exponents_jvp(primals, tangents):
  g_b, L = primals
  dg, _ = tangents
  sub = g_b.shape[-2]
  r, s, t = (jnp.arange(sub)[:, None, None], jnp.arange(sub)[None, :, None],
             jnp.arange(sub)[None, None, :])
  span = ((s < t) & (t <= r)).astype(jnp.float32)            # [c,c,c]
  return (_pair_exponents(g_b, L),
          jnp.einsum("rst,...tk->...rsk", span, dg))


def _decayed_products(xs, k, g, L, R, tot, same_b, reach_end, *, safe):
  """Returns [sum_d x_r k_s exp(G_r - G_s)]_{r,s} for each x in xs.

  Only same-segment entries with s <= r are meaningful; every other entry is
  finite (the caller masks it). Off-diagonal sub-blocks (rows in block i,
  columns in block j < i) factorise as
  `exp(L_r) * exp(sum of block totals strictly between) * exp(tot_j - L_s)`,
  all exponents <= 0. Diagonal sub-blocks use the exact pairwise decay with the
  exponent masked, or with `safe` (gates >= -5, so -L_s <= 5c) the factorised
  `exp(L_r) * exp(-L_s)`.

  Args:
    xs: tuple of [L...,C,K] row-side operands (q and/or k).
    k: [L...,C,K] column-side keys.
    g: [L...,C,K] gates.
    L, R, tot, same_b, reach_end: from `_local_frames`.
    safe: factorise the diagonal sub-blocks too.

  Returns:
    Tuple of [L...,C,C] float32 matrices, one per entry of `xs`.
  """
  *lead, nb, sub, K = L.shape
  C = nb * sub
  neg_inf = jnp.array(-jnp.inf, jnp.float32)
  blk = lambda x: x.reshape(*lead, nb, sub, K)
  e_row = jnp.exp(L)                                         # <= 1
  k_b = blk(k)
  # Column factor: decay from s to the end of its block (its segment must
  # reach that end), times the decay of the full blocks strictly between.
  k_col = k_b * jnp.exp(jnp.where(reach_end, R, neg_inf))
  between_mask = (jnp.arange(nb)[None, :, None] < jnp.arange(nb)[None, None, :]
                  ) & (jnp.arange(nb)[None, None, :] < jnp.arange(nb)[:, None,
                                                                      None])
  # between_mask[i, j, m]: j < m < i.
  between = jnp.einsum("ijm,...mk->...ijk",
                       between_mask.astype(jnp.float32), tot)
  lower_blocks = jnp.tril(jnp.ones((nb, nb), bool), -1)[:, :, None]
  e_between = jnp.exp(jnp.where(lower_blocks, between, neg_inf))  # [..,i,j,K]
  if safe:
    k_diag = k_b * jnp.exp(-L)                               # <= e^(5c)
  else:
    tri = jnp.tril(jnp.ones((sub, sub), bool))
    diff = _pair_exponents(blk(g), L)                        # [L,nb,c,c,K]
    decay = jnp.exp(jnp.where((tri & same_b)[..., None], diff, neg_inf))
  eye = jnp.eye(nb, dtype=jnp.float32)
  outs = []
  for x in xs:
    x_row = blk(x) * e_row                                   # [L,nb,c,K]
    x_off = x_row[..., :, :, None, :] * e_between[..., :, None, :, :]
    a = jnp.einsum("...irjk,...jsk->...irjs", x_off, k_col)  # [L,i,c,j,c]
    if safe:
      diag = jnp.einsum("...irk,...isk->...irs", x_row, k_diag)
    else:
      xd = blk(x)[..., :, None, :] * decay                   # [L,nb,c,c,K]
      diag = jnp.einsum("...rsk,...sk->...rs", xd, k_b)      # [L,nb,c,c]
    a = a + jnp.einsum("...irs,ij->...irjs", diag, eye)
    outs.append(a.reshape(*lead, C, C))
  return tuple(outs)


def _block_inverse(m):
  """Inverse of I + m for strictly lower-triangular m [L...,c,c], small c.

  Row-by-row forward substitution, `p_r = e_r - m[r, :r] p[:r]`, as c small
  batched matmuls. (jaxlib's CPU triangular-solve kernel deadlocks its
  2-thread pool on large batches, so it is not used.)
  """
  *lead, c, _ = m.shape
  eye = jnp.eye(c, dtype=m.dtype)
  rows = [jnp.broadcast_to(eye[0], (*lead, c))]
  for r in range(1, c):
    prev = jnp.stack(rows, axis=-2)                          # [L,r,c]
    rows.append(eye[r] - jnp.einsum("...s,...sc->...c", m[..., r, :r], prev))
  return jnp.stack(rows, axis=-2)


def _unit_lower_inverse(m, sub):
  """Inverse of I + m for strictly lower-triangular m [L...,C,C].

  Blocked forward substitution: row-by-row substitution inside the c x c
  diagonal blocks, matmuls for the rest (backward stable, unlike a Neumann
  series).
  """
  *lead, C, _ = m.shape
  nb = C // sub
  blk = lambda i, j: m[..., i * sub:(i + 1) * sub, j * sub:(j + 1) * sub]
  diag = _block_inverse(jnp.stack([blk(i, i) for i in range(nb)], axis=-3))
  p = [[None] * nb for _ in range(nb)]
  for i in range(nb):
    p[i][i] = diag[..., i, :, :]
    for j in range(i):
      acc = sum(blk(i, n) @ p[n][j] for n in range(j, i))
      p[i][j] = -(p[i][i] @ acc)
  zero = jnp.zeros((*lead, sub, sub), m.dtype)
  rows = [jnp.concatenate([p[i][j] if j <= i else zero for j in range(nb)],
                          axis=-1) for i in range(nb)]
  return jnp.concatenate(rows, axis=-2)


def _intra(q, k, v, g, beta, run, run_prev, *, sub, safe):
  """Everything that does not depend on the carried state, for many chunks.

  Args:
    q, k, g: [B,H,G,C,K] (q pre-scaled); v: [B,H,G,C,V]; beta: [B,H,G,C].
    run: [B,G,C] int32 segment-run index; run_prev: [B,G] run of the token
      before each chunk.

  Returns:
    w [B,H,G,C,K], u [B,H,G,C,V], aqk [B,H,G,C,C], qg [B,H,G,C,K],
    kd [B,H,G,C,K], decay [B,H,G,K] (state decay across the chunk, 0 if the
    chunk contains a reset).
  """
  f32 = jnp.float32
  *lead, C, K = q.shape
  nb = C // sub
  neg_inf = jnp.array(-jnp.inf, f32)
  L, R, tot, same_b, reach_end = _local_frames(g, run, sub=sub)
  aqk, akk = _decayed_products((q, k), k, g, L, R, tot, same_b, reach_end,
                               safe=safe)
  same = (run[..., :, None] == run[..., None, :])[:, None]   # [B,1,G,C,C]
  tri = jnp.tril(jnp.ones((C, C), bool))
  strict = jnp.tril(jnp.ones((C, C), bool), -1)
  aqk = aqk * (same & tri).astype(f32)
  m = akk * (same & strict).astype(f32) * beta[..., None]
  p = _unit_lower_inverse(m, sub)
  # Chunk-frame decays, rebuilt from block-local ones: from the chunk start to
  # row r (rows of the first segment only) and from row s to the chunk end
  # (rows of the last segment only); exponents masked, never results.
  blocks_before = jnp.tril(jnp.ones((nb, nb), f32), -1)     # [i, m]: m < i
  before = jnp.einsum("im,...mk->...ik", blocks_before, tot)[..., None, :]
  after = jnp.einsum("mi,...mk->...ik", blocks_before, tot)[..., None, :]
  first = (run == run_prev[..., None])[:, None]              # [B,1,G,C]
  last = (run == run[..., -1:])[:, None]
  carry = (run[..., -1] == run_prev)[:, None, :, None]       # [B,1,G,1]
  blk_mask = lambda m: m.reshape(*m.shape[:-1], nb, sub)[..., None]
  from_start = jnp.exp(jnp.where(blk_mask(first), L + before, neg_inf))
  to_end = jnp.exp(jnp.where(blk_mask(last), R + after, neg_inf))
  from_start = from_start.reshape(*lead, C, K)
  to_end = to_end.reshape(*lead, C, K)
  w = p @ (beta[..., None] * k * from_start)
  u = p @ (beta[..., None] * v)
  kd = k * to_end
  decay = jnp.exp(jnp.where(carry, jnp.sum(tot, axis=-2), neg_inf))
  return w, u, aqk, q * from_start, kd, decay


def _group_step(S, xs, *, sub, safe):
  """One group of chunks: intra work vectorised, then the state recurrence."""
  q, k, v, g, beta, run, run_prev = xs
  w, u, aqk, qg, kd, decay = _intra(q, k, v, g, beta, run, run_prev,
                                    sub=sub, safe=safe)

  def state_step(S, x):  # S [B,H,K,V]
    w_c, u_c, kd_c, decay_c = x
    v_new = u_c - w_c @ S
    S_next = decay_c[..., None] * S + jnp.swapaxes(kd_c, -1, -2) @ v_new
    return S_next, (v_new, S)

  chunk_major = lambda x: jnp.moveaxis(x, 2, 0)              # G to front
  S, (v_new, S_in) = jax.lax.scan(
      state_step, S, tuple(map(chunk_major, (w, u, kd, decay))))
  v_new = jnp.moveaxis(v_new, 0, 2)                          # [B,H,G,C,V]
  S_in = jnp.moveaxis(S_in, 0, 2)                            # [B,H,G,K,V]
  o = qg @ S_in + aqk @ v_new
  return S, o


def kda_chunked(q, k, v, g, beta, segs, h0, scale, *, chunk_size=64,
                safe_gate=False, group_chunks=GROUP_CHUNKS):
  """Chunked KDA over canonical inputs (see `common` and `reference`).

  Args:
    q, k, g: [B,T,H,K] float32, zero at padding.
    v: [B,T,H,V] float32.
    beta: [B,T,H] float32.
    segs: `common.Segments`.
    h0: [B,H,K,V] float32.
    scale: float multiplying q.
    chunk_size: C, a multiple of 16 (or any size <= 16).
    safe_gate: every gate is >= -5 (the bounded gate form): use the
      all-matmul fast path.
    group_chunks: chunks per checkpointed group (memory/speed trade-off).

  Returns:
    o [B,T,H,V] float32 (zero at padding) and the final state [B,H,K,V].
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  sub = min(SUB_BLOCK, C)
  n_chunks = -(-T // C)
  n_groups = -(-n_chunks // group_chunks)
  gc = -(-n_chunks // n_groups)                              # chunks per group
  Tp = n_groups * gc * C
  run = jnp.cumsum(segs.reset.astype(jnp.int32), axis=1)      # [B,T]
  if Tp != T:  # trailing padding is transparent: zero inputs, same run
    extra = [(0, 0), (0, Tp - T)]
    pad = lambda x: jnp.pad(x, extra + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = map(pad, (q, k, v, g, beta))
    run = jnp.pad(run, extra, mode="edge")
  q = q * scale

  def grouped(x):  # [B,Tp,H,X] -> [n_groups,B,H,gc,C,X]
    x = x.reshape(B, n_groups, gc, C, H, -1)
    return jnp.transpose(x, (1, 0, 4, 2, 3, 5))

  run_c = run.reshape(B, n_groups * gc, C)
  run_prev = jnp.concatenate(
      [jnp.zeros((B, 1), jnp.int32), run_c[:, :-1, -1]], axis=1)
  run_c = jnp.moveaxis(run_c.reshape(B, n_groups, gc, C), 1, 0)
  run_prev = jnp.moveaxis(run_prev.reshape(B, n_groups, gc), 1, 0)
  xs = (grouped(q), grouped(k), grouped(v), grouped(g),
        grouped(beta[..., None])[..., 0], run_c, run_prev)
  step = jax.checkpoint(
      functools.partial(_group_step, sub=sub, safe=safe_gate))
  final, o = jax.lax.scan(step, h0, xs)                  # o [n,B,H,gc,C,V]
  o = jnp.transpose(o, (1, 0, 3, 4, 2, 5)).reshape(B, Tp, H, V)[:, :T]
  o = jnp.where(segs.pad[:, :, None, None], 0.0, o)
  return o, final
