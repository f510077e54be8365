"""Per-chunk KDA math, forward and hand-derived backward, as array code.

Backend-neutral: plain `jax.numpy` on arrays with any leading batch dims
`L...` (batch, heads, chunks), so the same functions run vectorised over many
chunks in `xla.py`. Derivation of the forward in docs/kda.md; notation as in
`xla.py`'s docstring. Shape glossary: C chunk size, c sub-block size, nb = C/c
sub-blocks, K key dim, V value dim.

Forward, per chunk with state S entering it (q pre-scaled):

  L, R, tot    block-local cumulative gates (`local_frames`)
  Aqk, Akk     decayed products (`decayed_products`), masked to same-segment
               pairs s <= r (Aqk) and s < r (Akk)
  P = (I + diag(beta) Akk)^-1,  X = beta k F,  w = P X,  u = P (beta v)
  v_new = u - w S,  o = (q F) S + Aqk v_new,  S' = Dv S + (k E)^T v_new
  F = exp(G) on the first segment, E = exp(G_last - G) on the last one,
  Dv = exp(G_last) if the chunk holds no reset.

Backward (`chunk_grads`), given S, v_new, the cotangent dS' of the state
leaving the chunk and dv_new (both from the caller's reverse recurrence):

  dv_new = Aqk^T do + (k E) dS'           d(q F) = do S^T,  d(k E) = v_new dS'^T
  dAqk = mask(do v_new^T),  dw = -dv_new S^T,  dX = P^T dw,  d(bv) = P^T dv_new
  dP = dv_new (beta v)^T + dw X^T,  dM = -mask(P^T dP P^T)
  dbeta = rowsum(dM Akk) + rowsum(dX k F) + rowsum(d(bv) v),  dAkk = beta dM
  (dS entering the chunk, Dv dS' + (q F)^T do - w^T dv_new, is the caller's
  recurrence.)

Gate gradients follow the forward's exponents exactly: every exponent is a
masked sum of the gates it spans (`L`: gates from the block or segment start
up to a row; `R`: gates after a row up to the block end; `tot`: whole
blocks), so the cotangent of each exponent goes back through the transpose
of that same masked sum, and no +x/-x pair cancels in float32 (the
chunk-level exponents of F, E and Dv are the same linear maps of the gates,
so their cotangents go back through one [C, 2C] matmul). Exact
(unbounded) gates use the pairwise decay inside diagonal sub-blocks, whose
cotangent reaches exactly the gates each pair spans (`span` below).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kda_lm.ops.kda import common

_F32 = jnp.float32
_NEG_INF = -jnp.inf


def _mT(x):
  return jnp.swapaxes(x, -1, -2)


def _blk(x, nb):
  """[L...,C,X] -> [L...,nb,c,X]."""
  *lead, C, X = x.shape
  return x.reshape(*lead, nb, C // nb, X)


def _unblk(x):
  """[L...,nb,c,X] -> [L...,C,X]."""
  *lead, nb, c, X = x.shape
  return x.reshape(*lead, nb * c, X)


def _masked_exp(mask, x):
  """exp(x) where mask else 0, masking the exponent (finite gradients)."""
  return jnp.exp(jnp.where(mask, x, _NEG_INF))


class Frames(NamedTuple):
  """Block-local gate frames of one chunk (see `local_frames`)."""
  wl: jax.Array         # [B,1,G,nb,c,c] f32: same segment and s <= r
  wr: jax.Array         # [B,1,G,nb,c,c] f32: same segment and s > r
  L: jax.Array          # [L...,nb,c,K]
  R: jax.Array          # [L...,nb,c,K]
  tot: jax.Array        # [L...,nb,K]
  same_b: jax.Array     # [B,1,G,nb,c,c] bool
  reach_end: jax.Array  # [B,1,G,nb,c,1] bool


def local_frames(g, run, *, sub):
  """Block-local cumulative gates and the sums that chain sub-blocks.

  Every decay the chunk needs is rebuilt from gates of one segment only, in
  frames that restart at each sub-block and each segment start, so values
  stay small (precise) and one document never perturbs another's rounding.
  Each exponent is a masked sum of exactly the gates it spans (never a
  difference of two cumulative sums).

  Args:
    g: [B,H,G,C,K] log decay (<= 0; 0 at padding).
    run: [B,G,C] segment-run index.
    sub: sub-block size c.

  Returns:
    `Frames`: L, the cumulative gate from max(block start, segment start) to
    each row; R, the sum of the same segment's gates after each row up to
    the block's end; tot, L at each block's last row; the masks.
  """
  *lead, C, K = g.shape
  nb = C // sub
  run_b = run.reshape(*run.shape[:-1], nb, sub)[:, None]      # [B,1,G,nb,c]
  same_b = run_b[..., :, None] == run_b[..., None, :]
  tri = jnp.tril(jnp.ones((sub, sub), bool))
  wl = (same_b & tri).astype(_F32)
  wr = (same_b & ~tri).astype(_F32)
  g_b = _blk(g, nb)
  L = wl @ g_b
  R = wr @ g_b
  reach_end = (run_b == run_b[..., -1:])[..., None]
  return Frames(wl, wr, L, R, L[..., -1, :], same_b, reach_end)


def _between_mask(nb):
  """[nb,nb,nb] f32: [i, j, m] = 1 where j < m < i."""
  i = jnp.arange(nb)[:, None, None]
  j = jnp.arange(nb)[None, :, None]
  m = jnp.arange(nb)[None, None, :]
  return ((j < m) & (m < i)).astype(_F32)


def _span(sub):
  """[c,c,c] f32: [t, r, s] = 1 where s < t <= r (gates a pair spans)."""
  t = jnp.arange(sub)[:, None, None]
  r = jnp.arange(sub)[None, :, None]
  s = jnp.arange(sub)[None, None, :]
  return ((s < t) & (t <= r)).astype(_F32)


class Decays(NamedTuple):
  """Decay factors of the decayed products (see `decay_factors`)."""
  e_row: jax.Array      # [L...,nb,c,K] exp(L) (safe: times SAFE_BALANCE)
  e_col: jax.Array      # [L...,nb,c,K] exp(R) where the segment reaches the
  #                       block end, else 0 (safe: over SAFE_BALANCE)
  e_between: jax.Array  # [L...,nb,nb,K] exp(sum of tot strictly between),
  #                       0 unless j < i
  diag: jax.Array       # exact: [L...,nb,c,c,K] pairwise exp(L_r - L_s),
  #                       masked; safe: [L...,nb,c,K] exp(-L) / balance


def decay_factors(fr, *, safe):
  """The factors of exp(G_r - G_s) for every pair of sub-blocks.

  Off-diagonal sub-blocks (rows in block i, columns in block j < i)
  factorise as `exp(L_r) * exp(sum of block totals strictly between) *
  exp(R_s)`, all exponents <= 0. Diagonal sub-blocks use the exact pairwise
  decay with the exponent masked, or with `safe` (gates >= -5, so
  -L_s <= 5c) the factorised `exp(L_r) * exp(-L_s)`.
  """
  nb, sub = fr.L.shape[-3:-1]
  between = jnp.einsum("ijm,...mk->...ijk", _between_mask(nb), fr.tot)
  lower = jnp.tril(jnp.ones((nb, nb), bool), -1)[:, :, None]
  bal = common.SAFE_BALANCE if safe else 1.0  # (see there)
  if safe:
    diag = jnp.exp(-fr.L) / bal
  else:
    tri = jnp.tril(jnp.ones((sub, sub), bool))
    diff = fr.L[..., :, None, :] - fr.L[..., None, :, :]      # [L,nb,c,c,K]
    diag = _masked_exp((tri & fr.same_b)[..., None], diff)
  return Decays(e_row=jnp.exp(fr.L) * bal,
                e_col=_masked_exp(fr.reach_end, fr.R) / bal,
                e_between=_masked_exp(lower, between), diag=diag)


def _below(x_row, e_between, j):
  """[L...,(nb-1-j)*c,K]: rows of the blocks i > j, times exp(between)."""
  *lead, nb, sub, K = x_row.shape
  x = x_row[..., j + 1:, :, :] * e_between[..., j + 1:, j, None, :]
  return x.reshape(*lead, (nb - 1 - j) * sub, K)


def decayed_products(xs, k, dec, *, safe):
  """Returns [sum_d x_r k_s exp(G_r - G_s)]_{r,s} for each x in xs.

  Only same-segment entries with s <= r are meaningful; every other entry is
  finite (the caller masks it).

  Args:
    xs: tuple of [L...,C,K] row-side operands (q and/or k).
    k: [L...,C,K] column-side keys.
    dec: `Decays`.
    safe: the diagonal sub-blocks are factorised.

  Returns:
    Tuple of [L...,C,C] float32 matrices, one per entry of `xs`.
  """
  *lead, nb, sub, K = dec.e_row.shape
  k_b = _blk(k, nb)
  k_col = k_b * dec.e_col
  k_diag = k_b * dec.diag if safe else None
  outs = []
  for x in xs:
    x_b = _blk(x, nb)
    x_row = x_b * dec.e_row                                   # [L,nb,c,K]
    if safe:
      diag = jnp.einsum("...irk,...isk->...irs", x_row, k_diag)
    else:
      # One fused multiply-reduce: no [c,c,K] product is materialised.
      diag = jnp.sum(x_b[..., :, None, :] * dec.diag * k_b[..., None, :, :],
                     axis=-1)                                 # [L,nb,c,c]
    cols = []
    for j in range(nb):  # column block j: zeros, diagonal, blocks below
      col = [jnp.zeros((*lead, j * sub, sub), _F32), diag[..., j, :, :]]
      if j < nb - 1:
        col.append(_below(x_row, dec.e_between, j) @ _mT(k_col[..., j, :, :]))
      cols.append(jnp.concatenate(col, axis=-2))
    outs.append(jnp.concatenate(cols, axis=-1))
  return tuple(outs)


def _below_bwd(ct, x_row, k_col, e_between):
  """Cotangents of the blocks below the diagonal, given ct [L...,C,C].

  Returns:
    (dx_row [L...,nb,c,K], d_between [L...,nb,nb,K], dk_col [L...,nb,c,K]).
  """
  *lead, nb, sub, K = x_row.shape
  dx_row = [jnp.zeros_like(x_row[..., 0, :, :])] * nb
  d_between = [[jnp.zeros_like(x_row[..., 0, 0, :])] * nb for _ in range(nb)]
  dk_col = []
  for j in range(nb):
    if j == nb - 1:
      dk_col.append(jnp.zeros_like(x_row[..., 0, :, :]))
      continue
    ct_j = ct[..., (j + 1) * sub:, j * sub:(j + 1) * sub]     # [L,(..)c,c]
    dk_col.append(_mT(ct_j) @ _below(x_row, e_between, j))
    d_below = ct_j @ k_col[..., j, :, :]                      # [L,(..)c,K]
    for i in range(j + 1, nb):
      d = d_below[..., (i - j - 1) * sub:(i - j) * sub, :]
      dx_row[i] = dx_row[i] + d * e_between[..., i, j, None, :]
      if i - j > 1:  # (adjacent blocks have nothing between them)
        d_between[i][j] = jnp.sum(d * x_row[..., i, :, :], axis=-2)
  d_between = jnp.stack([jnp.stack(row, axis=-2) for row in d_between],
                        axis=-3)
  return (jnp.stack(dx_row, axis=-3), d_between, jnp.stack(dk_col, axis=-3))


def decayed_products_bwd(xs, cts, k, fr, dec, *, safe):
  """Cotangents of `decayed_products` (given cotangents `cts`, one per x).

  Returns:
    (dxs, dk, zL, zR, dtot, dg_pair): cotangents of each x and of k; of the
    exponents L (row side), R (column side) and tot; and `dg_pair`
    [L...,C,K], the gate cotangent of the exact pairwise decays (None with
    `safe`).
  """
  *lead, nb, sub, K = dec.e_row.shape
  k_b = _blk(k, nb)
  k_col = k_b * dec.e_col
  dk_col = jnp.zeros_like(k_b)
  d_between = jnp.zeros_like(dec.e_between)
  zL = jnp.zeros_like(k_b)
  dk_b = jnp.zeros_like(k_b)
  pair = None
  dxs = []
  for x, ct in zip(xs, cts, strict=True):
    x_b = _blk(x, nb)
    x_row = x_b * dec.e_row
    dx_row, d_btw, dk_c = _below_bwd(ct, x_row, k_col, dec.e_between)
    d_between = d_between + d_btw
    dk_col = dk_col + dk_c
    cd = jnp.stack([ct[..., i * sub:(i + 1) * sub, i * sub:(i + 1) * sub]
                    for i in range(nb)], axis=-3)             # diag blocks
    if safe:
      dx_row = dx_row + jnp.einsum("...irs,...isk->...irk", cd,
                                   k_b * dec.diag)
      dk_diag = jnp.einsum("...irs,...irk->...isk", cd, x_row)
      dk_b = dk_b + dk_diag * dec.diag
      zL = zL - dk_diag * k_b * dec.diag
      dx_b = dx_row * dec.e_row
    else:
      dx_b = dx_row * dec.e_row + jnp.sum(
          cd[..., None] * dec.diag * k_b[..., None, :, :], axis=-2)
      t = cd[..., None] * x_b[..., :, None, :]                # [L,nb,c,c,K]
      pair = t if pair is None else pair + t
    zL = zL + dx_row * x_row
    dxs.append(_unblk(dx_b))
  dk_b = dk_b + dk_col * dec.e_col
  zR = dk_col * k_col
  d_between = d_between * dec.e_between
  dtot = jnp.einsum("ijm,...ijk->...mk", _between_mask(nb), d_between)
  dg_pair = None
  if not safe:
    pair = pair * dec.diag                                    # [L,nb,r,s,K]
    dk_b = dk_b + jnp.sum(pair, axis=-3)
    dg_pair = _unblk(jnp.einsum("trs,...rsk->...tk", _span(sub),
                                pair * k_b[..., None, :, :]))
  return tuple(dxs), _unblk(dk_b), zL, zR, dtot, dg_pair


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


def unit_lower_inverse(m, sub):
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


class Intra(NamedTuple):
  """Everything in a chunk that does not depend on the carried state."""
  fr: Frames
  dec: Decays
  aqk: jax.Array        # [L...,C,C] masked
  akk: jax.Array        # [L...,C,C] masked, s < r, before beta
  p: jax.Array          # [L...,C,C] (I + diag(beta) Akk)^-1
  F: jax.Array          # [L...,C,K] exp(G) on the first segment, else 0
  E: jax.Array          # [L...,C,K] exp(G_last - G) on the last segment
  Dv: jax.Array         # [L...,K] exp(G_last) if no reset in the chunk
  X: jax.Array          # [L...,C,K] beta k F
  w: jax.Array          # [L...,C,K] P X
  u: jax.Array          # [L...,C,V] P (beta v)
  first_b: jax.Array    # [B,1,G,nb,c,1] rows of the first segment
  last_b: jax.Array     # [B,1,G,nb,c,1] rows of the last segment


def _chunk_masks(run):
  """[B,1,G,C,C] masks of token pairs in one segment run: (s <= t, s < t)."""
  same = (run[..., :, None] == run[..., None, :])[:, None]   # [B,1,G,C,C]
  C = run.shape[-1]
  tri = jnp.tril(jnp.ones((C, C), bool))
  strict = jnp.tril(jnp.ones((C, C), bool), -1)
  return (same & tri).astype(_F32), (same & strict).astype(_F32)


def intra(q, k, v, g, beta, run, run_prev, *, sub, solve, safe, saved=None):
  """Everything that does not depend on the carried state, for many chunks.

  Args:
    q, k, g: [B,H,G,C,K] (q pre-scaled); v: [B,H,G,C,V]; beta: [B,H,G,C].
    run: [B,G,C] int32 segment-run index; run_prev: [B,G] run of the token
      before each chunk.
    sub: sub-block size c of the decay factorisation.
    solve: block size of the blocked triangular inverse (divides C).
    safe: every gate is >= -5: factorise the diagonal sub-blocks too.
    saved: (aqk, akk, p) of an earlier call on the same chunks, to skip the
      decayed products and the triangular inverse.

  Returns:
    `Intra`.
  """
  C = q.shape[-2]
  nb = C // sub
  fr = local_frames(g, run, sub=sub)
  dec = decay_factors(fr, safe=safe)
  if saved is None:
    aqk, akk = decayed_products((q, k), k, dec, safe=safe)
    mask_qk, mask_kk = _chunk_masks(run)
    aqk = aqk * mask_qk
    akk = akk * mask_kk
    p = unit_lower_inverse(akk * beta[..., None], solve)
  else:
    aqk, akk, p = saved
  # Chunk-frame decays, rebuilt from block-local ones: from the chunk start
  # to row r (rows of the first segment only) and from row s to the chunk end
  # (rows of the last segment only); exponents masked, never results.
  blocks_before = jnp.tril(jnp.ones((nb, nb), _F32), -1)    # [i, m]: m < i
  before = jnp.einsum("im,...mk->...ik", blocks_before, fr.tot)[..., None, :]
  after = jnp.einsum("mi,...mk->...ik", blocks_before, fr.tot)[..., None, :]
  blk_mask = lambda m: m.reshape(*m.shape[:-1], nb, sub)[..., None]
  first_b = blk_mask((run == run_prev[..., None])[:, None])
  last_b = blk_mask((run == run[..., -1:])[:, None])
  carry = (run[..., -1] == run_prev)[:, None, :, None]       # [B,1,G,1]
  F = _unblk(_masked_exp(first_b, fr.L + before))
  E = _unblk(_masked_exp(last_b, fr.R + after))
  Dv = _masked_exp(carry, jnp.sum(fr.tot, axis=-2))
  X = beta[..., None] * k * F
  w = p @ X
  u = p @ (beta[..., None] * v)
  return Intra(fr=fr, dec=dec, aqk=aqk, akk=akk, p=p, F=F, E=E, Dv=Dv, X=X,
               w=w, u=u, first_b=first_b, last_b=last_b)


def state_bwd_inputs(it, k, q, do):
  """The state-free parts of the backward recurrence, for many chunks.

  Returns:
    (ado [L...,C,V] = Aqk^T do, qdo [L...,K,V] = (q F)^T do, kd = k E).
  """
  return _mT(it.aqk) @ do, _mT(q * it.F) @ do, k * it.E


def chunk_grads(q, k, v, beta, run, run_prev, it, S, v_new, dS, dvn, do, *,
                safe):
  """Per-row gradients of many chunks, given the state S entering each, the
  cotangent dS of the state leaving it, and v_new and its cotangent.

  Args:
    q, k: [L...,C,K] (q pre-scaled); v: [L...,C,V]; beta: [L...,C].
    run, run_prev: as for `intra`.
    it: `intra(...)` of the same chunks.
    S: [L...,K,V] state entering each chunk.
    v_new: [L...,C,V] the forward's `u - w S`.
    dS: [L...,K,V] cotangent of the state leaving each chunk.
    dvn: [L...,C,V] cotangent of v_new, `Aqk^T do + (k E) dS` (from the
      reverse state recurrence).
    do: [L...,C,V] cotangent of the chunk's outputs.
    safe: as for `intra`.

  Returns:
    (dq, dk, dv, dg, dbeta) with the shapes of (q, k, v, q, beta); dq is the
    cotangent of the pre-scaled q.
  """
  mask_qk, mask_kk = _chunk_masks(run)
  bt = beta[..., None]
  kE = k * it.E
  C = do.shape[-2]
  dqF, dw = jnp.split(jnp.concatenate([do, -dvn], axis=-2) @ _mT(S), [C],
                      axis=-2)                               # one S product
  dkE = v_new @ _mT(dS)
  dDv = jnp.sum(S * dS, axis=-1)
  daqk = (do @ _mT(v_new)) * mask_qk
  pt = _mT(it.p)
  dX = pt @ dw
  dbv = pt @ dvn
  dP = dvn @ _mT(bt * v) + dw @ _mT(it.X)
  dm = -((pt @ dP) @ pt) * mask_kk
  dbeta = (jnp.sum(dm * it.akk, axis=-1) + jnp.sum(dX * k * it.F, axis=-1)
           + jnp.sum(dbv * v, axis=-1))
  dakk = dm * bt
  (dq_p, dk_p), dk_c, zL, zR, dtot, dg_pair = decayed_products_bwd(
      (q, k), (daqk, dakk), k, it.fr, it.dec, safe=safe)
  dq = dqF * it.F + dq_p
  dk = dX * bt * it.F + dkE * it.E + dk_p + dk_c
  dv = dbv * bt
  # Exponent cotangents of F, E and Dv. F's exponent at a row of the first
  # segment is the sum of the chunk's gates up to that row, E's at a row of
  # the last segment the sum of the gates after it, Dv's the sum of all
  # (the forward builds them from block sums, the same linear maps): their
  # transposes are a reverse cumulative sum, a strict cumulative sum and a
  # broadcast, one [C, 2C] matmul.
  zF = (dX * bt * k + dqF * q) * it.F
  zE = dkE * kE
  incl = jnp.tril(jnp.ones((C, C), _F32))                    # [r, s]: s <= r
  spans = jnp.concatenate([incl.T, incl - jnp.eye(C, dtype=_F32)], axis=1)
  dg = jnp.einsum("tr,...rk->...tk", spans,
                  jnp.concatenate([zF, zE], axis=-2))
  dg = dg + (dDv * it.Dv)[..., None, :]
  zL = zL.at[..., -1, :].add(dtot)
  dg = dg + _unblk(_mT(it.fr.wl) @ zL + _mT(it.fr.wr) @ zR)
  if dg_pair is not None:
    dg = dg + dg_pair
  return dq, dk, dv, dg, dbeta
