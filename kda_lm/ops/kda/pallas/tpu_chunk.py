"""Per-chunk KDA math of the TPU kernels, on 2-D values.

The TPU kernels (`tpu.py`) run `chunk_forward` and `chunk_backward` on the
values of one chunk of several heads loaded from VMEM: per-head math, with
the triangular inverses of a group of heads in one block-diagonal matrix.
They are plain `jax.numpy` on 2-D arrays (interpret mode runs them on
CPU), written for Mosaic: masks from 2-D iotas, static slices at multiples
of 8 rows (plus single rows), no cumsum (a 0/1 matmul), columns made from
rows with an identity mask, transposed operands through
`dot_general` contractions.

Shape glossary: C chunk (64 rows), c sub-block (16 rows), nb = C/c, K key
dim, V value dim; `_col` [n,1] and `_row` [1,n] vectors.

Forward, per chunk with state S entering it (q pre-scaled, gates bounded
below by -5, padding rows all zero):

  G      = gate cumulated from max(chunk start, segment start) to each row
  L      = the same, from max(sub-block start, segment start)
  Aqk, Akk: for the rows of sub-block i, one matmul of the stacked rows
           [q; k] * exp(L) against k * exp(x_i), where the column exponent
           x_i is G[a_i - 1] - G for columns before the sub-block (a_i its
           first row; the anchor's segment only; <= 0) and -L on the
           sub-block (<= 80: the bounded gates make this factorisation
           safe; row and column factors balanced, `common.SAFE_BALANCE`);
           masked to same-segment pairs s <= r (Aqk), s < r (Akk)
  P      = (I + beta Akk)^-1 by blocked doubling: X = I - M at block size 2,
           then X <- X - X (M_b X) with M_b the coupling of the halves of
           each 2b-block, up to b = C/2 (exact block algebra, no series);
           a group of heads shares block-diagonal matrices
  w, u   = P [beta k F | beta v]      F = exp(G) on the first segment
  v_new  = u - w S
  o      = (q F) S + Aqk v_new
  S'     = Dv S + (k E)^T v_new       E = exp(G_last - G) on the last
                                      segment, Dv = exp(G_last) if the chunk
                                      holds no reset
The backward (`chunk_backward`) takes the forward's P and S and the
cotangent dS' of the state leaving the chunk:

  dv_new = Aqk^T do + (k E) dS'
  dS     = Dv dS' + (q F)^T do - w^T dv_new     (the reverse recurrence)
  [dX | dY] = P^T [-dv_new S^T | dv_new]
  dM     = -(dX w^T + dY u^T), strictly lower, same segment
           (from dM = -P^T dP P^T with [w|u] = P [X|Y])
  dAqk   = mask(do v_new^T),  dAkk = beta dM,
  dbeta  = rowsum(dM Akk) + rowsum(dX k F) + rowsum(dY v)
and the cotangents of the decayed products, F, E and Dv go back to the
gates through the transposed cumsum masks.

Every exponent is masked before `exp`, and G and L are masked sums of one
segment's gates, so changing one document never changes another's values.
"""

from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from kda_lm.ops.kda import common

F32 = jnp.float32
BF16 = jnp.bfloat16
CHUNK = 64
SUB = 16
NEG_INF = -float("inf")
PRECISIONS = ("highest", "bf16_3x", "bf16")
BALANCE = common.SAFE_BALANCE   # row factors times it, columns over it


def dot(a, b, dims, precision):
  """dot_general over `dims` in float32: IEEE ("highest"), three bfloat16
  products of the operands' high and low parts ("bf16_3x": hi hi + hi lo +
  lo hi, about 16 bits), or with bfloat16 operands ("bf16"); float32
  accumulation."""
  if precision == "bf16_3x":
    a_hi, b_hi = a.astype(BF16).astype(F32), b.astype(BF16).astype(F32)
    return (dot(a_hi, b_hi, dims, "bf16") + dot(a_hi, b - b_hi, dims, "bf16")
            + dot(a - a_hi, b_hi, dims, "bf16"))
  if precision == "bf16":
    a, b = a.astype(BF16), b.astype(BF16)
    prec = lax.Precision.DEFAULT
  else:
    prec = lax.Precision.HIGHEST
  return lax.dot_general(a, b, (dims, ((), ())), precision=(prec, prec),
                         preferred_element_type=F32)


def mm(a, b, precision):
  """a @ b."""
  return dot(a, b, ((1,), (0,)), precision)


def mm_nt(a, b, precision):
  """a @ b.T."""
  return dot(a, b, ((1,), (1,)), precision)


def mm_tn(a, b, precision):
  """a.T @ b."""
  return dot(a, b, ((0,), (0,)), precision)


def _split3(x):
  """x = hi + mid + lo, each exactly representable in bfloat16."""
  hi = x.astype(BF16).astype(F32)
  mid = (x - hi).astype(BF16).astype(F32)
  return hi, mid, x - hi - mid


def mask_mm(mask, x, transpose=False):
  """mask @ x (or mask.T @ x) to float32 accuracy for a 0/1 `mask`: three
  bfloat16 matmuls of x's exact bfloat16 parts, float32 accumulation."""
  f = mm_tn if transpose else mm
  hi, mid, lo = _split3(x)
  return f(mask, hi, "bf16") + f(mask, mid, "bf16") + f(mask, lo, "bf16")


class Precisions(NamedTuple):
  """Dot precision per matmul family (each one of `PRECISIONS`)."""
  chunk: str       # chunk-local products: Aqk, Akk, the inverse, w, u, ...
  state: str       # products with the carried state or its cotangent
  gate_grad: str   # the decayed products' backward, whose row and column
  #                  terms cancel in the gate gradient


def iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


def block_of(x, n):
  """x // n for a non-negative int32 iota and a power of two n (a shift:
  Mosaic's floor division asks for the chip generation)."""
  return lax.shift_right_logical(x, jnp.int32(n.bit_length() - 1))


def row_to_col(x_row):
  """[1,n] -> [n,1] (an identity mask and a lane sum: exact)."""
  n = x_row.shape[1]
  eye = iota((n, n), 0) == iota((n, n), 1)
  return jnp.sum(jnp.where(eye, x_row, 0.0), axis=1, keepdims=True)


def col_to_row(x_col):
  """[n,1] -> [1,n] (exact)."""
  n = x_col.shape[0]
  eye = iota((n, n), 0) == iota((n, n), 1)
  return jnp.sum(jnp.where(eye, x_col, 0.0), axis=0, keepdims=True)


class Masks(NamedTuple):
  """Segment masks of one chunk, shared by its heads (see `chunk_masks`)."""
  gl: jax.Array        # [2C,C] f32: G's mask over L's mask (s <= r, same
  #                      segment; L's also same sub-block)
  qk: jax.Array        # [C,C] f32: same segment, s <= r
  kk: jax.Array        # [C,C] f32: same segment, s < r
  first: jax.Array     # [C,1] bool: rows of the segment entering the chunk
  last: jax.Array      # [C,1] bool: rows of the segment leaving it
  carry: jax.Array     # [1,1] bool: no reset in the chunk
  diag: tuple          # per sub-block i: [C,1] bool, rows of sub-block i
  off: tuple           # per sub-block i: [C,1] bool, rows before it in the
  #                      segment of its first row (None for i = 0)
  row: jax.Array       # [C,1] int32 row index
  keep: jax.Array      # [C,1] bool: not padding


def chunk_masks(seg):
  """The masks of one chunk from its segment rows.

  Args:
    seg: [8,C] float32: row 0 the segment-run index of each token, row 1
      1.0 where the token belongs to the segment entering the chunk, row 2
      1.0 where it belongs to the segment leaving it (rows 3-7 unused).

  Returns:
    `Masks`.
  """
  C = seg.shape[1]
  nb = C // SUB
  run_row = seg[0:1, :]
  run_col = row_to_col(run_row)
  first = row_to_col(seg[1:2, :]) > 0.5
  last = row_to_col(seg[2:3, :]) > 0.5
  r, s = iota((C, C), 0), iota((C, C), 1)
  same = run_col == run_row
  le = same & (s <= r)
  blk = block_of(r, SUB) == block_of(s, SUB)
  gl = jnp.concatenate([le.astype(F32), (le & blk).astype(F32)], axis=0)
  row = iota((C, 1), 0)
  diag, off = [], [None]
  for i in range(nb):
    diag.append(block_of(row, SUB) == i)
    if i:
      anchor = run_col[i * SUB:i * SUB + 1, :]
      off.append((row < i * SUB) & (run_col == anchor))
  return Masks(gl=gl, qk=le.astype(F32), kk=(same & (s < r)).astype(F32),
               first=first, last=last, carry=first[C - 1:C, :],
               diag=tuple(diag), off=tuple(off), row=row,
               keep=row_to_col(seg[3:4, :]) > 0.5)


def _exp_where(mask, x):
  """exp(x) where mask else 0, masking the exponent."""
  return jnp.exp(jnp.where(mask, x, NEG_INF))


def block_diag(mats):
  """[C,C] matrices -> their block-diagonal [nC,nC]."""
  n = len(mats)
  if n == 1:
    return mats[0]
  C = mats[0].shape[0]
  zero = jnp.zeros((C, C), F32)
  return jnp.concatenate(
      [jnp.concatenate([m if j == i else zero for j in range(n)], axis=1)
       for i, m in enumerate(mats)], axis=0)


def unit_lower_inverse(m, precision):
  """(I + m)^-1 for a block-diagonal m [nC,nC] of strictly lower-triangular
  [C,C] blocks (one per head).

  Blocked doubling: the inverse at block size 2 is I - m on those blocks;
  each level b = 2, 4, ..., C/2 then couples the two b-halves of every
  2b-block, X <- X - X (m_b X), exactly (m_b X m_b = 0). The heads' blocks
  never mix, so n heads share each matmul (a 128-row matmul for 2).
  """
  n = m.shape[0]
  r, s = iota((n, n), 0), iota((n, n), 1)
  x = (jnp.where(r == s, 1.0, 0.0)
       - m * (block_of(r, 2) == block_of(s, 2)).astype(F32))
  b = 2
  while b < CHUNK:
    level = ((block_of(r, 2 * b) == block_of(s, 2 * b))
             & (block_of(r, b) != block_of(s, b))).astype(F32)
    x = x - mm(x, mm(m * level, x, precision), precision)
    b *= 2
  return x


class Intra(NamedTuple):
  """The state-free quantities of one chunk and head."""
  G: jax.Array       # [C,K]
  L: jax.Array       # [C,K]
  e_row: jax.Array   # [C,K] exp(L) * BALANCE
  left: tuple        # per sub-block: [2c,K] [q; k] rows * exp(L)
  cf: tuple          # per sub-block: [C,K] column factors exp(x_i)
  kc: tuple          # per sub-block: [C,K] k * cf
  aqk: jax.Array     # [C,C] masked
  akk: jax.Array     # [C,C] masked (before beta)
  F: jax.Array       # [C,K]
  E: jax.Array       # [C,K]
  g_last: jax.Array  # [1,K] G of the chunk's last row
  dv_row: jax.Array  # [1,K] Dv
  X: jax.Array       # [C,K] beta k F
  Y: jax.Array       # [C,V] beta v


def intra(q, k, v, g, beta_col, masks, prec):
  """Everything in a chunk of one head that needs neither the state nor P."""
  C = q.shape[0]
  nb = C // SUB
  gl = mask_mm(masks.gl, g)
  G, L = gl[:C], gl[C:]
  e_row = jnp.exp(L) * BALANCE
  left, cf, kc, rows = [], [], [], []
  for i in range(nb):
    blk = slice(i * SUB, (i + 1) * SUB)
    x = jnp.where(masks.diag[i], -L, NEG_INF)
    if i:
      x = jnp.where(masks.off[i], G[i * SUB - 1:i * SUB, :] - G, x)
    f = jnp.exp(x) * (1.0 / BALANCE)
    lf = jnp.concatenate([q[blk], k[blk]], axis=0) * jnp.concatenate(
        [e_row[blk], e_row[blk]], axis=0)
    left.append(lf)
    cf.append(f)
    kc.append(k * f)
    rows.append(mm_nt(lf, kc[-1], prec.chunk))             # [2c,C]
  aqk = jnp.concatenate([a[:SUB] for a in rows], axis=0) * masks.qk
  akk = jnp.concatenate([a[SUB:] for a in rows], axis=0) * masks.kk
  g_last = G[C - 1:C, :]
  F = _exp_where(masks.first, G)
  E = _exp_where(masks.last, g_last - G)
  dv_row = _exp_where(masks.carry, g_last)
  return Intra(G=G, L=L, e_row=e_row, left=tuple(left), cf=tuple(cf),
               kc=tuple(kc), aqk=aqk, akk=akk, F=F, E=E, g_last=g_last,
               dv_row=dv_row, X=beta_col * k * F, Y=beta_col * v)


def _groups(n, size):
  return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


def _stacked_apply(p, parts, transpose, precision):
  """p @ rows (or p.T @ rows) for the stacked [C, X] `parts` of a group."""
  C = parts[0].shape[0]
  f = mm_tn if transpose else mm
  out = f(p, jnp.concatenate(parts, axis=0), precision)
  return [out[i * C:(i + 1) * C] for i in range(len(parts))]


class Head(NamedTuple):
  """One head's inputs for one chunk."""
  q: jax.Array         # [C,K] pre-scaled
  k: jax.Array         # [C,K]
  v: jax.Array         # [C,V]
  g: jax.Array         # [C,K]
  beta_col: jax.Array  # [C,1]


def _intra_and_wu(heads, masks, prec, group, ps=None):
  """intra for each head, then per group of `group` heads the inverse P
  (block-diagonal over the group; or the given `ps`) and [w|u] = P [X|Y].

  Returns:
    (its, ws, us, ps).
  """
  its = [intra(*h, masks, prec) for h in heads]
  K = heads[0].k.shape[1]
  ws, us, out_ps = [], [], []
  for n, idx in enumerate(_groups(len(heads), group)):
    if ps is None:
      p = unit_lower_inverse(
          block_diag([its[i].akk * heads[i].beta_col for i in idx]),
          prec.chunk)
    else:
      p = ps[n]
    out_ps.append(p)
    wu = _stacked_apply(
        p, [jnp.concatenate([its[i].X, its[i].Y], axis=1) for i in idx],
        False, prec.chunk)
    ws += [x[:, :K] for x in wu]
    us += [x[:, K:] for x in wu]
  return its, ws, us, out_ps


def chunk_forward(heads, states, masks, prec, group):
  """One chunk of several heads.

  Args:
    heads: list of `Head`.
    states: list of [K,V] states entering the chunk.
    masks: `chunk_masks` of the chunk.
    prec: `Precisions`.
    group: heads per block-diagonal inverse.

  Returns:
    (outputs [C,V] per head, states leaving the chunk per head, P per
    group of heads [gC,gC]).
  """
  its, ws, us, ps = _intra_and_wu(heads, masks, prec, group)
  outs, nexts = [], []
  for h, it, w, u, S in zip(heads, its, ws, us, states, strict=True):
    C = h.q.shape[0]
    qws = mm(jnp.concatenate([h.q * it.F, w], axis=0), S, prec.state)
    v_new = u - qws[C:]
    outs.append(qws[:C] + mm(it.aqk, v_new, prec.chunk))
    nexts.append(row_to_col(it.dv_row) * S
                 + mm_tn(h.k * it.E, v_new, prec.state))
  return outs, nexts, ps


class Grads(NamedTuple):
  dq: jax.Array     # [C,K] (of the pre-scaled q)
  dk: jax.Array     # [C,K]
  dv: jax.Array     # [C,V]
  dg: jax.Array     # [C,K]
  dbeta: jax.Array  # [C,1]
  dS: jax.Array     # [K,V] cotangent of the state entering the chunk


def _state_backward(h, it, w, u, S, dS_next, do, prec):
  """The state part of one head's backward: (dS, dqF, dw, dvn, dkE, ddv_row,
  v_new)."""
  C = h.q.shape[0]
  qw = jnp.concatenate([h.q * it.F, w], axis=0)
  v_new = u - mm(w, S, prec.state)
  dvn = mm_tn(it.aqk, do, prec.chunk) + mm(h.k * it.E, dS_next, prec.state)
  y = jnp.concatenate([do, -dvn], axis=0)
  dS = row_to_col(it.dv_row) * dS_next + mm_tn(qw, y, prec.state)
  dqw = mm_nt(y, S, prec.state)                              # [2C,K]
  dkE = mm_nt(v_new, dS_next, prec.state)
  ddv_row = col_to_row(jnp.sum(S * dS_next, axis=1, keepdims=True))
  return dS, dqw[:C], dqw[C:], dvn, dkE, ddv_row, v_new


def chunk_backward(heads, states, ps, dstates, dos, masks, prec, group):
  """Gradients of one chunk of several heads.

  Args:
    heads: list of `Head`.
    states: [K,V] states entering the chunk, per head.
    ps: the forward's P per group.
    dstates: cotangents of the states leaving the chunk, per head.
    dos: [C,V] output cotangents, per head.
    masks, prec, group: as for `chunk_forward`.

  Returns:
    list of `Grads`, one per head.
  """
  its, ws, us, _ = _intra_and_wu(heads, masks, prec, group, ps)
  parts = [_state_backward(*a, prec) for a in
           zip(heads, its, ws, us, states, dstates, dos, strict=True)]
  K = heads[0].k.shape[1]
  dxys = []
  for p, idx in zip(ps, _groups(len(heads), group), strict=True):
    dxys += _stacked_apply(
        p, [jnp.concatenate([parts[i][2], parts[i][3]], axis=1)
            for i in idx], True, prec.chunk)
  return [_head_grads(h, it, w, u, part, dxy[:, :K], dxy[:, K:], do, masks,
                      prec)
          for h, it, w, u, part, dxy, do in zip(
              heads, its, ws, us, parts, dxys, dos, strict=True)]


def _head_grads(h, it, w, u, part, dX, dY, do, masks, prec):
  """One head's gradients from its state part and dX = P^T dw, dY = P^T
  dv_new."""
  q, k, v, beta_col = h.q, h.k, h.v, h.beta_col
  C = q.shape[0]
  dS, dqF, _, _, dkE, ddv_row, v_new = part
  daqk = mm_nt(do, v_new, prec.chunk) * masks.qk
  dm = -mm_nt(jnp.concatenate([dX, dY], axis=1),
              jnp.concatenate([w, u], axis=1), prec.chunk) * masks.kk
  dbeta = (jnp.sum(dm * it.akk, axis=1, keepdims=True)
           + jnp.sum(dX * k * it.F, axis=1, keepdims=True)
           + jnp.sum(dY * v, axis=1, keepdims=True))
  dq = it.F * dqF
  dk = beta_col * it.F * dX + it.E * dkE
  zE = it.E * k * dkE
  dG = it.F * (beta_col * k * dX + q * dqF) - zE
  dG_last = jnp.sum(zE, axis=0, keepdims=True) + it.dv_row * ddv_row
  dG = dG + jnp.where(masks.row == C - 1, dG_last, 0.0)
  dq_p, dk_p, dk_c, dG_p, dL = _products_backward(
      it, daqk, dm * beta_col, masks, prec.gate_grad)
  dg = mask_mm(masks.gl, jnp.concatenate([dG + dG_p, dL], axis=0),
               transpose=True)
  return Grads(dq=dq + dq_p, dk=dk + dk_p + dk_c, dv=beta_col * dY, dg=dg,
               dbeta=dbeta, dS=dS)


def _products_backward(it, daqk, dakk, masks, precision):
  """Cotangents through the decayed products Aqk and Akk.

  Returns:
    (dq, dk) of the row side, dk of the column side, and the cotangents of
    G and L ([C,K] each).
  """
  C, K = it.G.shape
  nb = C // SUB
  dq_rows, dk_rows, dL_rows = [], [], []
  dk_col = jnp.zeros((C, K), F32)
  dG = jnp.zeros((C, K), F32)
  dL_col = jnp.zeros((C, K), F32)
  for i in range(nb):
    blk = slice(i * SUB, (i + 1) * SUB)
    da = jnp.concatenate([daqk[blk], dakk[blk]], axis=0)      # [2c,C]
    dleft = mm(da, it.kc[i], precision)                       # [2c,K]
    dkc = mm_tn(da, it.left[i], precision)                    # [C,K]
    dq_rows.append(dleft[:SUB] * it.e_row[blk])
    dk_rows.append(dleft[SUB:] * it.e_row[blk])
    z_row = dleft * it.left[i]
    dL_rows.append(z_row[:SUB] + z_row[SUB:])
    dk_col = dk_col + dkc * it.cf[i]
    z = dkc * it.kc[i]
    dL_col = dL_col - jnp.where(masks.diag[i], z, 0.0)
    if i:
      z_off = jnp.where(masks.off[i], z, 0.0)
      dG = dG - z_off + jnp.where(masks.row == i * SUB - 1,
                                  jnp.sum(z_off, axis=0, keepdims=True), 0.0)
  dL = jnp.concatenate(dL_rows, axis=0) + dL_col
  return (jnp.concatenate(dq_rows, axis=0), jnp.concatenate(dk_rows, axis=0),
          dk_col, dG, dL)


# The raw inputs of one chunk and head, and their preparation in the kernel:
# the q/k L2 norm, the query scale, the bounded gate and the zeroing of
# padding (`common.canonicalize` does the same outside the kernel for the
# other implementations).


class Prep(NamedTuple):
  """Static settings of the preparation (hashable)."""
  scale: float        # multiplies the (normalised) q
  lower_bound: float  # the bounded gate's floor, in [-5, 0)
  l2norm: bool        # L2-normalise q and k


class Gate(NamedTuple):
  """One head's gate parameters: g = lower_bound sigmoid(a (g_raw + bias))."""
  a: jax.Array     # [1,K] exp(A_log) of the head, on every lane
  bias: jax.Array  # [1,K] the head's dt_bias (zeros without one)


class Saved(NamedTuple):
  """What the backward of `prepare` needs."""
  rq: jax.Array  # [C,1] 1 / |q| (ones without the norm)
  rk: jax.Array  # [C,1] 1 / |k|
  x: jax.Array   # [C,K] g_raw + bias
  s: jax.Array   # [C,K] sigmoid(a x)


def _inv_norm(x, on):
  if not on:
    return jnp.ones((x.shape[0], 1), F32)
  return lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + common.L2NORM_EPS)


def prepare(raw, gate, keep, prep):
  """The `Head` of one chunk from its raw float32 `Head` (q, k, v, the raw
  gate and beta as given to `chunk_kda`), and what its backward needs."""
  rq, rk = _inv_norm(raw.q, prep.l2norm), _inv_norm(raw.k, prep.l2norm)
  x = raw.g + gate.bias
  s = 1.0 / (1.0 + jnp.exp(-(gate.a * x)))
  zero = lambda y: jnp.where(keep, y, 0.0)
  head = Head(q=zero(raw.q * rq * prep.scale), k=zero(raw.k * rk),
              v=zero(raw.v), g=zero(prep.lower_bound * s),
              beta_col=zero(raw.beta_col))
  return head, Saved(rq=rq, rk=rk, x=x, s=s)


class RawGrads(NamedTuple):
  """Gradients of one chunk and head with respect to the raw inputs."""
  dq: jax.Array     # [C,K]
  dk: jax.Array     # [C,K]
  dv: jax.Array     # [C,V]
  dg: jax.Array     # [C,K] of the raw gate
  dbeta: jax.Array  # [C,1]
  da: jax.Array     # [1,K] of `Gate.a`, summed over the chunk
  dbias: jax.Array  # [1,K] of `Gate.bias`, summed over the chunk
  dS: jax.Array     # [K,V] cotangent of the state entering the chunk


def _norm_backward(x, r, dy, on):
  """d/dx of y = x r (r = 1/|x|) given dy."""
  if not on:
    return dy
  y = x * r
  return r * (dy - y * jnp.sum(y * dy, axis=1, keepdims=True))


def prepare_backward(raw, saved, grads, gate, keep, prep):
  """Chains one head's `Grads` (of its prepared `Head`) to the raw inputs."""
  zero = lambda y: jnp.where(keep, y, 0.0)
  dq = _norm_backward(raw.q, saved.rq, prep.scale * grads.dq, prep.l2norm)
  dk = _norm_backward(raw.k, saved.rk, grads.dk, prep.l2norm)
  dz = zero(grads.dg * (prep.lower_bound * saved.s * (1.0 - saved.s)))
  dx = dz * gate.a
  return RawGrads(
      dq=zero(dq), dk=zero(dk), dv=zero(grads.dv), dg=dx,
      dbeta=zero(grads.dbeta),
      da=jnp.sum(dz * saved.x, axis=0, keepdims=True),
      dbias=jnp.sum(dx, axis=0, keepdims=True), dS=grads.dS)
