"""Chunked KDA in plain XLA: the WY/UT form with in-chunk segment resets.

Shape glossary: B batch, H heads, N chunks, C chunk size, c sub-block size,
K key dim, V value dim; `L...` stands for leading batch dims (B, H, chunks).

Per chunk of C rows with state S entering it and `G = cumsum(g)` inside the
chunk (facts in ../shared/notes/kda-math.md):

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

SUB_BLOCK = 16        # c: rows per anchored sub-block (and per solve block)
GROUP_CHUNKS = 8      # chunks per checkpointed group


def _decayed_products(xs, k, G, *, sub, safe):
  """Returns [sum_d x_r k_s exp(G_r - G_s)]_{r,s} for each x in xs.

  Only entries with s <= r are meaningful (the rest are finite garbage that
  the caller masks).

  Args:
    xs: tuple of [L...,C,K] row-side operands (q and/or k).
    k: [L...,C,K] column-side keys.
    G: [L...,C,K] in-chunk cumulative log decay (non-increasing).
    sub: sub-block size c (divides C).
    safe: factorise the diagonal sub-blocks too (needs gates >= -5).

  Returns:
    Tuple of [L...,C,C] float32 matrices, one per entry of `xs`.
  """
  *lead, C, K = k.shape
  nb = C // sub
  neg_inf = jnp.array(-jnp.inf, jnp.float32)
  blk = lambda x: x.reshape(*lead, nb, sub, x.shape[-1])
  G_b = blk(G)
  anchor = G_b[..., :1, :]                                   # [L,nb,1,K]
  e_row = jnp.exp(G_b - anchor)                              # <= 1
  # Column factor exp(n_i - G_s) for the columns block i may use: those
  # before it (exact) or up to its end (safe); exponent masked elsewhere.
  limit = (jnp.arange(nb) + (1 if safe else 0)) * sub
  col_ok = jnp.arange(C)[None, :] < limit[:, None]           # [nb,C]
  expo = anchor - G[..., None, :, :]                         # [L,nb,C,K]
  k_col = k[..., None, :, :] * jnp.exp(
      jnp.where(col_ok[:, :, None], expo, neg_inf))
  outs = []
  for x in xs:
    a = jnp.einsum("...irk,...isk->...irs", blk(x) * e_row, k_col)
    outs.append(a)                                           # [L,nb,c,C]
  if not safe:
    tri = jnp.tril(jnp.ones((sub, sub), bool))
    diff = G_b[..., :, None, :] - G_b[..., None, :, :]       # [L,nb,c,c,K]
    decay = jnp.exp(jnp.where(tri[:, :, None], diff, neg_inf))
    eye = jnp.eye(nb, dtype=jnp.float32)
    k_b = blk(k)
    for i, x in enumerate(xs):
      xd = blk(x)[..., :, None, :] * decay                   # [L,nb,c,c,K]
      diag = jnp.einsum("...rsk,...sk->...rs", xd, k_b)      # [L,nb,c,c]
      diag = jnp.einsum("...irs,ij->...irjs", diag, eye)
      outs[i] = outs[i] + diag.reshape(*lead, nb, sub, C)
  return tuple(a.reshape(*lead, C, C) for a in outs)


def _unit_lower_inverse(m, sub):
  """Inverse of I + m for strictly lower-triangular m [L...,C,C].

  Blocked forward substitution: triangular solves on the c x c diagonal blocks,
  matmuls for the rest (backward stable, unlike a Neumann series).
  """
  *lead, C, _ = m.shape
  nb = C // sub
  tri_solve = functools.partial(
      jax.lax.linalg.triangular_solve, left_side=True, lower=True,
      unit_diagonal=True)
  eye = jnp.broadcast_to(jnp.eye(sub, dtype=m.dtype), (*lead, sub, sub))
  blk = lambda i, j: m[..., i * sub:(i + 1) * sub, j * sub:(j + 1) * sub]
  p = [[None] * nb for _ in range(nb)]
  for i in range(nb):
    p[i][i] = tri_solve(blk(i, i), eye)
    for j in range(i):
      acc = sum(blk(i, l) @ p[l][j] for l in range(j, i))
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
  G = jnp.cumsum(g, axis=-2)
  aqk, akk = _decayed_products((q, k), k, G, sub=sub, safe=safe)
  C = q.shape[-2]
  same = (run[..., :, None] == run[..., None, :])[:, None]   # [B,1,G,C,C]
  tri = jnp.tril(jnp.ones((C, C), bool))
  strict = jnp.tril(jnp.ones((C, C), bool), -1)
  aqk = aqk * (same & tri).astype(f32)
  m = akk * (same & strict).astype(f32) * beta[..., None]
  first = (run == run_prev[..., None])[:, None, :, :, None].astype(f32)
  last = (run == run[..., -1:])[:, None, :, :, None].astype(f32)
  carry = (run[..., -1] == run_prev)[:, None, :, None].astype(f32)
  p = _unit_lower_inverse(m, sub)
  eG = jnp.exp(G)                                            # <= 1
  bk = beta[..., None] * k
  w = p @ (bk * eG * first)
  u = p @ (beta[..., None] * v)
  G_last = G[..., -1:, :]
  kd = k * jnp.exp(G_last - G) * last                        # exponent <= 0
  decay = carry * jnp.exp(G_last[..., 0, :])
  return w, u, aqk, q * eG * first, kd, decay


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
