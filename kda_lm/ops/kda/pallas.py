"""Chunked KDA as Pallas kernels: one source for TPU (Mosaic) and GPU (Triton).

The math is the chunked WY/UT form of `xla.py` (derived in docs/kda.md),
split into kernels as FLA's chunk_kda does:
the heavy intra-chunk work runs in parallel over chunks, and only a light
recurrence walks the chunks in order. Forward:

  1. `_intra_kernel`, grid (B, H, T/C): per chunk of C=64 tokens, in
     sub-blocks of c=16 rows (i, j index sub-blocks; r, s rows):
     L        = gate cumulated from max(sub-block start, segment start) to
                each row: a [c,c] masked lower-triangular matmul (Mosaic TPU
                cannot lower `cumsum`); tot = L at each sub-block's last row.
     Aqk, Akk = decayed products sum_d x_r k_s exp(G_r - G_s) over
                same-segment pairs. Off-diagonal sub-blocks factorise as
                exp(L_r) exp(tot between) exp(tot_j - L_s), every exponent
                <= 0; diagonal sub-blocks use the exact pairwise decay one
                column at a time, the exponent (not the result) masked.
     P        = (I + diag(beta) Akk)^-1: forward substitution on the 16x16
                diagonal blocks (rank-1 updates), matmuls for the others.
     w, u     = P (beta k exp(G)) [first segment rows], P (beta v);
     and q exp(G), k exp(G_last - G), Dv = exp(G_last) [no reset], Aqk.
  2. `_recur_step` over the chunks in order (see `_recurrence`: a
     `fori_loop` per (B, H, V block) program on GPU, an "arbitrary" grid
     axis with the state in VMEM scratch on TPU), carrying the [K,V]
     float32 state: v_new = u - w S,  S' = Dv S + (k exp(G_last - G))^T
     v_new [rows of the chunk's last segment]; saves each chunk's entering
     S.
  3. `_out_kernel`, grid (B, H, T/C): o = (q exp(G)) S + Aqk v_new.

Segments: the kernels read a float32 run index per token (`run =
cumsum(reset)`, exact below 2^24) and the reset flags, and build every
same-segment, first-segment and last-segment mask in-kernel. Padding tokens
arrive with q, k, v, g, beta = 0 and are transparent.

Backward: `_out_bwd_kernel` (per chunk: Aqk^T do and (q exp(G))^T do, the
parts that do not depend on dS), `_recur_bwd_step` (chunks in reverse:
dv_new = Aqk^T do + (k E) dS', dS = Dv dS' + (q F)^T do - w^T dv_new;
saves each chunk's dS'), and `_chunk_bwd_kernel` (per chunk,
given its S and dS': dq, dk, dv, dg, dbeta, derived by hand in
`_bwd_chunk`). `jax.custom_vjp` joins them; everything around the kernels
(gates, l2norm, layout) is differentiated by JAX. The V blocks of the
recurrences are independent columns of S, so results do not depend on
`v_block` or the recurrence form (bit for bit).

Lowering constraints honoured by the kernel source (checked by cross-lowering
in tests/kda_pallas_test.py): no `cumsum`, no value slicing (Triton has no
slice lowering: sub-blocks are loaded from refs, rows and columns extracted by
masked reductions), every in-kernel array a power of two in size and every dot
at least 16 wide (K and V are zero-padded to powers of two >= 16), blocks of
one chunk's rows (or full T in the GPU recurrences), with full K and V on
TPU (legal for its (8, 128) rule), float32 dots at HIGHEST precision (IEEE
on Triton rather than TF32; `KDA_LM_PALLAS_PRECISION=default` switches to
the backend's fast float32). GPU kernels lower through
Triton (`pallas.triton.CompilerParams`): Mosaic GPU targets warpgroup-level
Hopper kernels (64-row wgmma tiles, explicit shared-memory/TMA management) and
cannot take this generic block-level code with 16x16 solves; Triton lowers it
as is and also runs on pre-Hopper GPUs.
"""

import functools
import math
import os
from typing import NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

from kda_lm.ops.kda import common

CHUNK = 64                 # C: tokens per chunk
SUB = common.SUB_BLOCK     # c: rows per sub-block
NB = CHUNK // SUB          # sub-blocks per chunk
MAX_HEAD_DIM = 256         # K and V limit (state [K,V] f32 stays on chip)
INTERPRET_ENV = "KDA_LM_PALLAS_INTERPRET"
NUM_WARPS_ENV = "KDA_LM_PALLAS_NUM_WARPS"
V_BLOCK_ENV = "KDA_LM_PALLAS_V_BLOCK"
RECURRENCE_ENV = "KDA_LM_PALLAS_RECURRENCE"
PRECISION_ENV = "KDA_LM_PALLAS_PRECISION"

_F32 = jnp.float32
# Precision of every in-kernel dot, set while the kernels are traced (see
# `Options.precision`): HIGHEST is IEEE float32 on Triton and TPU.
_PRECISIONS = {"highest": lax.Precision.HIGHEST,
               "default": lax.Precision.DEFAULT}
_dot_precision = [lax.Precision.HIGHEST]
_NEG_INF = -float("inf")


def interpret_mode():
  """Whether kernels run in interpret mode.

  `KDA_LM_PALLAS_INTERPRET=1|0` decides; unset, interpret only when JAX's
  default backend is CPU. Plain `interpret=True` fills every output buffer
  with NaN before the kernel runs (jax._src.pallas.hlo_interpreter), so a
  read of unwritten memory shows up as NaN.
  """
  env = os.environ.get(INTERPRET_ENV, "")
  if env not in ("", "0", "1"):
    raise ValueError(f"{INTERPRET_ENV} must be 0 or 1, got {env!r}.")
  if env:
    return env == "1"
  return jax.default_backend() == "cpu"


def unsupported_reason(K, V, chunk_size):
  """Why the Pallas path cannot run these shapes, or None if it can."""
  if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
    return (f"the Pallas KDA kernel keeps the [K,V] state on chip and "
            f"supports K, V <= {MAX_HEAD_DIM}; got K={K}, V={V}.")
  if chunk_size != CHUNK:
    return (f"the Pallas KDA kernel uses chunk_size={CHUNK}; got "
            f"chunk_size={chunk_size}.")
  return None


# ----------------------------------------------------------------------------
# In-kernel helpers: 2-D ops only, no slicing of values.


def _mm(a, b):
  """a @ b in float32."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                         precision=(_dot_precision[0],) * 2,
                         preferred_element_type=_F32)


def _mm_nt(a, b):
  """a @ b.T in float32."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                         precision=(_dot_precision[0],) * 2,
                         preferred_element_type=_F32)


def _mm_tn(a, b):
  """a.T @ b in float32."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                         precision=(_dot_precision[0],) * 2,
                         preferred_element_type=_F32)


def _rows(n):
  return lax.broadcasted_iota(jnp.int32, (n, 1), 0)


def _cols(n):
  return lax.broadcasted_iota(jnp.int32, (1, n), 1)


def _row(x, i):
  """Row i of x [n,m] as [1,m] (a masked sum: exact)."""
  return jnp.sum(jnp.where(_rows(x.shape[0]) == i, x, 0.0), axis=0,
                 keepdims=True)


def _col(x, j):
  """Column j of x [n,m] as [n,1]."""
  return jnp.sum(jnp.where(_cols(x.shape[1]) == j, x, 0.0), axis=1,
                 keepdims=True)


def _col_to_row(x):
  """[n,1] -> [1,n] without a transpose."""
  n = x.shape[0]
  return jnp.sum(jnp.where(_rows(n) == _cols(n), x, 0.0), axis=0,
                 keepdims=True)


def _row_to_col(x):
  """[1,n] -> [n,1] without a transpose."""
  n = x.shape[1]
  return jnp.sum(jnp.where(_rows(n) == _cols(n), x, 0.0), axis=1,
                 keepdims=True)


def _masked_exp(mask, x):
  """exp(x) where mask, else 0; the exponent is masked, never the result."""
  return jnp.exp(jnp.where(mask, x, _NEG_INF))


def _ref_blocks(ref, scale=None):
  """The NB sub-blocks [SUB, X] of a [CHUNK, X] ref."""
  out = []
  for i in range(NB):
    x = ref[pl.ds(i * SUB, SUB), :]
    out.append(x if scale is None else x * scale)
  return out


def _store_blocks(ref, blocks):
  for i, x in enumerate(blocks):
    ref[pl.ds(i * SUB, SUB), :] = x


# ----------------------------------------------------------------------------
# Per-chunk math shared by the forward and backward kernels.


class _Chunk(NamedTuple):
  """Intra-chunk quantities (lists over sub-blocks; dicts over (i, j))."""
  q: list        # [SUB,K] scaled queries
  k: list        # [SUB,K]
  v: list        # [SUB,V]
  beta: list     # [SUB,1]
  same: dict     # (i,j), j <= i: [SUB,SUB] bool, rows of i / cols of j
  wf: list       # [SUB,SUB] f32: same segment and s <= r (diagonal blocks)
  L: list        # [SUB,K] block-local cumulative gate
  e_row: list    # exp(L)
  e_col: list    # exp(tot - L) where the row's segment reaches block end
  e_between: dict  # (i,j), j < i: [1,K] decay of full blocks between
  run: list      # [SUB,1] run index
  reach: list    # [SUB,1] bool: the row's segment reaches its block's end
  F: list        # [SUB,K] exp(G) on the chunk's first segment, else 0
  E: list        # [SUB,K] exp(G_last - G) on the chunk's last segment
  Dv: jax.Array  # [1,K] exp(G_last) if no reset in the chunk, else 0
  aqk: dict      # (i,j), j <= i: [SUB,SUB]
  akk: dict      # (i,j), j <= i: [SUB,SUB], strictly lower, same segment
  P: dict        # (i,j), j <= i: blocks of (I + M)^-1
  X: list        # beta k F
  bv: list       # beta v
  w: list        # [SUB,K]
  u: list        # [SUB,V]


def _diag_columns(ch, body, init):
  """Runs body(c, dec, acc) for each column c of the diagonal sub-blocks.

  `dec[i]` is the exact pairwise decay exp(L_r - L_c) [SUB,K] of block i for
  rows r >= c in c's segment (0 elsewhere), built from a masked exponent.
  """
  def step(c, acc):
    decs = []
    for i in range(NB):
      l_c = _row(ch.L[i], c)
      r_c = _row(ch.run[i], c)
      mask = (_rows(SUB) >= c) & (ch.run[i] == r_c)
      decs.append(_masked_exp(mask, ch.L[i] - l_c))
    return body(c, decs, acc)
  return lax.fori_loop(0, SUB, step, init)


def _chunk_setup(q, k, v, g, beta, run, rst):
  """Everything in a chunk that does not depend on the carried state."""
  tri = _rows(SUB) >= _cols(SUB)
  strict = _rows(SUB) > _cols(SUB)
  run_row = [_col_to_row(r) for r in run]
  same = {(i, j): run[i] == run_row[j] for i in range(NB)
          for j in range(i + 1)}
  wf = [jnp.where(same[i, i] & tri, 1.0, 0.0).astype(_F32)
        for i in range(NB)]
  L = [_mm(wf[i], g[i]) for i in range(NB)]
  tot = [_row(x, SUB - 1) for x in L]
  reach = [r == _row(r, SUB - 1) for r in run]
  e_row = [jnp.exp(x) for x in L]
  e_col = [_masked_exp(reach[i], tot[i] - L[i]) for i in range(NB)]
  e_between = {}
  for i in range(NB):
    for j in range(i):
      acc = jnp.zeros_like(tot[0])
      for m in range(j + 1, i):
        acc = acc + tot[m]
      e_between[i, j] = jnp.exp(acc)

  run_prev = _row(run[0], 0) - _row(rst[0], 0)     # [1,1]
  run_last = _row(run[-1], SUB - 1)
  total = tot[0]
  for m in range(1, NB):
    total = total + tot[m]
  F, E = [], []
  for i in range(NB):
    before = jnp.zeros_like(tot[0])
    after = jnp.zeros_like(tot[0])
    for m in range(NB):
      if m < i:
        before = before + tot[m]
      elif m > i:
        after = after + tot[m]
    F.append(_masked_exp(run[i] == run_prev, L[i] + before))
    E.append(_masked_exp(run[i] == run_last, tot[i] - L[i] + after))
  Dv = _masked_exp(run_last == run_prev, total)

  # Decayed products: off-diagonal blocks factorised, diagonal ones exact.
  aqk, akk = {}, {}
  for i in range(NB):
    for j in range(i):
      k_col = k[j] * e_col[j]
      aqk[i, j] = jnp.where(
          same[i, j], _mm_nt(q[i] * e_row[i] * e_between[i, j], k_col), 0.0)
      akk[i, j] = jnp.where(
          same[i, j], _mm_nt(k[i] * e_row[i] * e_between[i, j], k_col), 0.0)

  def diag_body(c, decs, acc):
    sel = _cols(SUB) == c
    out = []
    for i in range(NB):
      kd = decs[i] * _row(k[i], c)
      a_q, a_k = acc[i]
      a_q = a_q + jnp.where(sel, jnp.sum(q[i] * kd, axis=1, keepdims=True),
                            0.0)
      a_k = a_k + jnp.where(sel, jnp.sum(k[i] * kd, axis=1, keepdims=True),
                            0.0)
      out.append((a_q, a_k))
    return out

  zero = jnp.zeros((SUB, SUB), _F32)
  ch_partial = _Chunk(q=q, k=k, v=v, beta=beta, same=same, wf=wf, L=L,
                      e_row=e_row, e_col=e_col, e_between=e_between, run=run,
                      reach=reach, F=F, E=E, Dv=Dv, aqk=None, akk=None,
                      P=None, X=None, bv=None, w=None, u=None)
  diag = _diag_columns(ch_partial, diag_body, [(zero, zero)] * NB)
  for i in range(NB):
    aqk[i, i] = diag[i][0]
    akk[i, i] = jnp.where(strict, diag[i][1], 0.0)

  # P = (I + M)^-1, M = diag(beta) Akk, by blocked forward substitution.
  M = {ij: beta[ij[0]] * a for ij, a in akk.items()}
  eye = jnp.where(_rows(SUB) == _cols(SUB), 1.0, 0.0).astype(_F32)

  def solve_step(c, xs):
    return [x - _col(M[i, i], c) * _row(x, c) for i, x in enumerate(xs)]

  diag_p = lax.fori_loop(0, SUB, solve_step, [eye] * NB)
  P = {(i, i): diag_p[i] for i in range(NB)}
  for d in range(1, NB):
    for j in range(NB - d):
      i = j + d
      acc = _mm(M[i, j], P[j, j])
      for m in range(j + 1, i):
        acc = acc + _mm(M[i, m], P[m, j])
      P[i, j] = -_mm(P[i, i], acc)

  X = [beta[i] * k[i] * F[i] for i in range(NB)]
  bv = [beta[i] * v[i] for i in range(NB)]
  w, u = [], []
  for i in range(NB):
    w_i = _mm(P[i, 0], X[0])
    u_i = _mm(P[i, 0], bv[0])
    for j in range(1, i + 1):
      w_i = w_i + _mm(P[i, j], X[j])
      u_i = u_i + _mm(P[i, j], bv[j])
    w.append(w_i)
    u.append(u_i)
  return ch_partial._replace(aqk=aqk, akk=akk, P=P, X=X, bv=bv, w=w, u=u)


def _chunk_from_refs(refs, scale):
  """`_chunk_setup` of the one chunk that the (chunk-sized) refs hold."""
  q_ref, k_ref, v_ref, g_ref, beta_ref, run_ref, rst_ref = refs
  return _chunk_setup(
      _ref_blocks(q_ref, scale), _ref_blocks(k_ref),
      _ref_blocks(v_ref), _ref_blocks(g_ref), _ref_blocks(beta_ref),
      _ref_blocks(run_ref), _ref_blocks(rst_ref))


def _v_new(ch, S):
  return [ch.u[i] - _mm(ch.w[i], S) for i in range(NB)]


# ----------------------------------------------------------------------------
# Kernels. Chunk-parallel kernels run on grid (b, h, n) over chunks n and do
# all intra-chunk work; the two recurrence kernels run on grid (b, h, j) over
# V blocks j and only carry the state through the chunks (a few matmuls per
# chunk), the split FLA's chunk_kda uses.


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, run_ref, rst_ref,
                  w_ref, u_ref, qf_ref, ke_ref, dv_ref, aqk_ref, *, scale):
  """Forward, chunk n: everything that does not depend on the state."""
  ch = _chunk_from_refs(
      (q_ref, k_ref, v_ref, g_ref, beta_ref, run_ref, rst_ref), scale)
  _store_blocks(w_ref, ch.w)
  _store_blocks(u_ref, ch.u)
  _store_blocks(qf_ref, [ch.q[i] * ch.F[i] for i in range(NB)])
  _store_blocks(ke_ref, [ch.k[i] * ch.E[i] for i in range(NB)])
  dv_ref[...] = ch.Dv
  zero = jnp.zeros((SUB, SUB), _F32)
  for i in range(NB):
    for j in range(NB):
      aqk_ref[i * NB + j] = ch.aqk[i, j] if j <= i else zero


# The two recurrences are written once as a per-chunk step on a view of
# chunk c's data and run two ways: `_loop_kernel` (GPU, and interpret mode by
# default) holds whole rows and loops over the chunks inside one program per
# V block; `_grid_kernel` (TPU) gets one chunk per step of an "arbitrary"
# grid axis and carries the state in a VMEM scratch buffer, so its on-chip
# memory does not grow with T (Triton has no sequential grid axis).


def _recur_step(x, S):
  """Forward: S entering chunk c -> S leaving it; writes v_new and S."""
  x.set("s_in", S)
  vn = x.get("u") - _mm(x.get("w"), S)
  x.set("vn", vn)
  return _row_to_col(x.get("dv")) * S + _mm_tn(x.get("ke"), vn)


def _recur_bwd_step(x, dS):
  """Backward: dS leaving chunk c -> dS entering it; writes dS leaving.
  dv_new = Aqk^T do + (k E) dS', dS = Dv dS' + (q F)^T do - w^T dv_new."""
  x.set("dsa", dS)
  dvn = x.get("ado") + _mm(x.get("ke"), dS)
  return (_row_to_col(x.get("dv")) * dS + x.get("qdo")
          - _mm_tn(x.get("w"), dvn))


class _RowsView:
  """Chunk c of whole-row refs: rows [c*C, (c+1)*C) or entry c."""

  def __init__(self, refs, kinds, c):
    self.refs, self.kinds = refs, kinds
    self.rows = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
    self.c = c

  def _index(self, name):
    return ((self.rows, slice(None)) if self.kinds[name].startswith("tok")
            else self.c)

  def get(self, name):
    return self.refs[name][self._index(name)]

  def set(self, name, value):
    self.refs[name][self._index(name)] = value


class _BlockView:
  """Refs that already hold just chunk c's block."""

  def __init__(self, refs):
    self.refs = refs

  def get(self, name):
    return self.refs[name][...]

  def set(self, name, value):
    self.refs[name][...] = value


def _loop_kernel(*refs, names, kinds, step, init, final, n_chunks, reverse):
  """One V block: `step` over the chunks, the state as the loop value."""
  refs = dict(zip(names, refs, strict=True))

  def body(t, S):
    c = n_chunks - 1 - t if reverse else t
    return step(_RowsView(refs, kinds, c), S)

  refs[final][...] = lax.fori_loop(0, n_chunks, body,
                                   refs[init][...].astype(_F32))


def _grid_kernel(*refs, names, step, init, final, n_chunks):
  """One chunk per step of grid axis 2, the state in `scratch`."""
  *refs, scratch = refs
  refs = dict(zip(names, refs, strict=True))
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    scratch[...] = refs[init][...].astype(_F32)

  S = step(_BlockView(refs), scratch[...])
  scratch[...] = S

  @pl.when(n == n_chunks - 1)
  def _():
    refs[final][...] = S


def _out_kernel(qf_ref, sin_ref, aqk_ref, vn_ref, o_ref):
  """Forward, chunk n: o = (q F) S + Aqk v_new."""
  S = sin_ref[...]
  vn = _ref_blocks(vn_ref)
  qf = _ref_blocks(qf_ref)
  o = []
  for i in range(NB):
    o_i = _mm(qf[i], S)
    for j in range(i + 1):
      o_i = o_i + _mm(aqk_ref[i * NB + j], vn[j])
    o.append(o_i)
  _store_blocks(o_ref, o)


def _out_bwd_kernel(qf_ref, aqk_ref, do_ref, ado_ref, qdo_ref):
  """Backward, chunk n: the state-free parts Aqk^T do and (q F)^T do."""
  do = _ref_blocks(do_ref)
  qf = _ref_blocks(qf_ref)
  ado = []
  for j in range(NB):
    x = _mm_tn(aqk_ref[j * NB + j], do[j])
    for i in range(j + 1, NB):
      x = x + _mm_tn(aqk_ref[i * NB + j], do[i])
    ado.append(x)
  _store_blocks(ado_ref, ado)
  qdo = _mm_tn(qf[0], do[0])
  for i in range(1, NB):
    qdo = qdo + _mm_tn(qf[i], do[i])
  qdo_ref[...] = qdo


def _chunk_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, run_ref, rst_ref,
                      sin_ref, dsa_ref, do_ref, dq_ref, dk_ref, dv_ref,
                      dg_ref, dbeta_ref, *, scale):
  """Backward, chunk n: every per-token gradient, given the chunk's S and
  the dS after it (`_bwd_chunk`)."""
  ch = _chunk_from_refs(
      (q_ref, k_ref, v_ref, g_ref, beta_ref, run_ref, rst_ref), scale)
  dq, dk, dv, dg, dbeta = _bwd_chunk(ch, sin_ref[...], dsa_ref[...],
                                     _ref_blocks(do_ref))
  _store_blocks(dq_ref, [x * scale for x in dq])
  _store_blocks(dk_ref, dk)
  _store_blocks(dv_ref, dv)
  _store_blocks(dg_ref, dg)
  _store_blocks(dbeta_ref, dbeta)


def _bwd_chunk(ch, S, dS, do):
  """Per-row gradients of one chunk, given the state S entering it and the
  cotangent dS of the state leaving it (dS before the chunk is
  `_recur_bwd_step`'s job). Returns (dq, dk, dv, dg, dbeta) sub-blocks.

  Notation: Gs = gate cumulated from max(chunk start, segment start), so
  every decay is exp of a difference of Gs (same segment), F = exp(Gs) on the
  first segment, E = exp(Gs_last - Gs) on the last, Dv = exp(Gs_last) without
  a reset. With v_new = u - w S, o = (q F) S + Aqk v_new,
  S' = Dv S + (k E)^T v_new, w = P X, u = P (beta v), P = (I + M)^-1:

    dv_new = Aqk^T do + (k E) dS'          dS = (q F)^T do + Dv dS' - w^T dv_new
    dAqk = mask(do v_new^T)                dw = -dv_new S^T,  du = dv_new
    dX = P^T dw,  d(beta v) = P^T du       dP = du (beta v)^T + dw X^T
    dM = -P^T dP P^T (masked to M's support)
    dbeta = rowsum(dM Akk) + rowsum(dX k F) + rowsum(d(beta v) v)
    dAkk = beta dM
  and for A[r,s] = sum_d x_r k_s exp(Gs_r - Gs_s) with cotangent C:
    dx_r = R_r = sum_s C[r,s] k_s e(r,s),  dk_s += Q_s = sum_r C[r,s] x_r e,
    dGs_r += x_r R_r,  dGs_s -= k_s Q_s.
  dg is the reverse cumulative sum of dGs within each segment, but it is
  gathered per pair instead (see below): a pair (r, s) adds its x to dg_t for
  s < t <= r only, so row and column contributions never cancel (5-50x more
  accurate gate gradients than the plain cumsum in float32).
  """
  vn = _v_new(ch, S)
  # dv_new, dq (F part), dk (E part).
  dvn = []
  for i in range(NB):
    x = _mm(ch.k[i] * ch.E[i], dS)
    for a in range(i, NB):
      x = x + _mm_tn(ch.aqk[a, i], do[a])
    dvn.append(x)
  dqF = [_mm_nt(do[i], S) for i in range(NB)]
  dkE = [_mm_nt(vn[i], dS) for i in range(NB)]
  dDv = _col_to_row(jnp.sum(S * dS, axis=1, keepdims=True))
  tri = _rows(SUB) >= _cols(SUB)
  daqk = {}
  for i in range(NB):
    for j in range(i + 1):
      m = ch.same[i, j] & tri if i == j else ch.same[i, j]
      daqk[i, j] = jnp.where(m, _mm_nt(do[i], vn[j]), 0.0)
  # Through the WY representation.
  dw = [-_mm_nt(dvn[i], S) for i in range(NB)]
  dbv, dX = [], []
  for j in range(NB):
    a_bv = _mm_tn(ch.P[j, j], dvn[j])
    a_x = _mm_tn(ch.P[j, j], dw[j])
    for a in range(j + 1, NB):
      a_bv = a_bv + _mm_tn(ch.P[a, j], dvn[a])
      a_x = a_x + _mm_tn(ch.P[a, j], dw[a])
    dbv.append(a_bv)
    dX.append(a_x)
  dP = {(a, b): _mm_nt(dvn[a], ch.bv[b]) + _mm_nt(dw[a], ch.X[b])
        for a in range(NB) for b in range(a + 1)}
  # Y = dP P^T (blocks a >= j), dM = -P^T Y (blocks i >= j).
  Y = {}
  for a in range(NB):
    for j in range(a + 1):
      y = _mm_nt(dP[a, 0], ch.P[j, 0])
      for b in range(1, j + 1):
        y = y + _mm_nt(dP[a, b], ch.P[j, b])
      Y[a, j] = y
  strict = _rows(SUB) > _cols(SUB)
  dakk = {}
  dbeta = [jnp.sum(dX[i] * ch.k[i] * ch.F[i], axis=1, keepdims=True)
           + jnp.sum(dbv[i] * ch.v[i], axis=1, keepdims=True)
           for i in range(NB)]
  for i in range(NB):
    for j in range(i + 1):
      dm = _mm_tn(ch.P[i, i], Y[i, j])
      for a in range(i + 1, NB):
        dm = dm + _mm_tn(ch.P[a, i], Y[a, j])
      m = ch.same[i, j] & strict if i == j else ch.same[i, j]
      dm = jnp.where(m, -dm, 0.0)
      dbeta[i] = dbeta[i] + jnp.sum(dm * ch.akk[i, j], axis=1, keepdims=True)
      dakk[i, j] = ch.beta[i] * dm

  # Decayed-product gradients: R (row side) and Q (column side) for Aqk
  # (x = q) and Akk (x = k). A pair (r, s), s < r, whose decay
  # exp(G_r - G_s) carries a gradient x changes dg_t by x exactly for
  # s < t <= r. The gate gradient is gathered that way, without the
  # +x (row) / -x (column) cancellation of a plain reverse cumsum:
  #   row_side[i]: reverse cumsum within block i (t <= r),
  #   col_side[j]: exclusive forward cumsum within block j (t > s),
  #   bcast[m]:    whole blocks strictly between (and F / E / Dv terms),
  #   straddle:    diagonal-block pairs, column by column.
  zk = jnp.zeros_like(ch.k[0])
  r_q, q_q, r_k, q_k, row_side, col_side = ([zk] * NB for _ in range(6))
  bcast = [ch.Dv * dDv] * NB
  for i in range(NB):
    for j in range(i):
      k_col = ch.k[j] * ch.e_col[j]
      eb = ch.e_between[i, j]
      rq = ch.e_row[i] * eb * _mm(daqk[i, j], k_col)
      rk = ch.e_row[i] * eb * _mm(dakk[i, j], k_col)
      qq = ch.e_col[j] * eb * _mm_tn(daqk[i, j], ch.q[i] * ch.e_row[i])
      qk = ch.e_col[j] * eb * _mm_tn(dakk[i, j], ch.k[i] * ch.e_row[i])
      r_q[i] = r_q[i] + rq
      r_k[i] = r_k[i] + rk
      q_q[j] = q_q[j] + qq
      q_k[j] = q_k[j] + qk
      row_side[i] = row_side[i] + ch.q[i] * rq + ch.k[i] * rk
      col = ch.k[j] * (qq + qk)
      col_side[j] = col_side[j] + col
      if i - j > 1:
        pair_sum = jnp.sum(col, axis=0, keepdims=True)
        for m in range(j + 1, i):
          bcast[m] = bcast[m] + pair_sum

  def diag_body(c, decs, acc):
    sel = _rows(SUB) == c
    out = []
    for i in range(NB):
      rq, qq, rk, qk, st = acc[i]
      a1 = _col(daqk[i, i], c) * decs[i]
      a2 = _col(dakk[i, i], c) * decs[i]
      k_c = _row(ch.k[i], c)
      rq = rq + a1 * k_c
      rk = rk + a2 * k_c
      qq = qq + jnp.where(sel, jnp.sum(a1 * ch.q[i], axis=0, keepdims=True),
                          0.0)
      qk = qk + jnp.where(sel, jnp.sum(a2 * ch.k[i], axis=0, keepdims=True),
                          0.0)
      x = (a1 * ch.q[i] + a2 * ch.k[i]) * k_c       # pairs (r, c), r >= c
      st = st + jnp.where(_rows(SUB) > c, _mm_tn(ch.wf[i], x), 0.0)
      out.append((rq, qq, rk, qk, st))
    return out

  diag = _diag_columns(ch, diag_body, [(zk,) * 5] * NB)
  dq, dk, dv = [], [], []
  for i in range(NB):
    rq, qq, rk, qk, _ = diag[i]
    qf_part = ch.F[i] * dqF[i]
    dq.append(qf_part + rq + r_q[i])
    dk.append(ch.E[i] * dkE[i] + ch.beta[i] * ch.F[i] * dX[i] + qq + rk + qk
              + q_q[i] + r_k[i] + q_k[i])
    dv.append(ch.beta[i] * dbv[i])
    # F = exp(G) reaches back to the chunk start (t <= r); E =
    # exp(G_last - G) reaches forward to the chunk end (t > r).
    y = ch.q[i] * qf_part + ch.X[i] * dX[i]
    z = ch.k[i] * ch.E[i] * dkE[i]
    row_side[i] = row_side[i] + y
    col_side[i] = col_side[i] + z
    y_sum = jnp.sum(y, axis=0, keepdims=True)
    z_sum = jnp.sum(z, axis=0, keepdims=True)
    for m in range(NB):
      if m < i:
        bcast[m] = bcast[m] + y_sum
      elif m > i:
        bcast[m] = bcast[m] + z_sum
  strict = _rows(SUB) > _cols(SUB)
  dg = []
  for i in range(NB):
    w_ex = jnp.where(ch.same[i, i] & strict, 1.0, 0.0).astype(_F32)
    dg.append(_mm_tn(ch.wf[i], row_side[i]) + _mm(w_ex, col_side[i])
              + diag[i][4] + bcast[i])
  return dq, dk, dv, dg, dbeta


# ----------------------------------------------------------------------------
# pallas_call wrappers.


class Options(NamedTuple):
  """Kernel settings read from the environment when a call is traced.

  They are static arguments of the jitted op, so changing an environment
  variable between calls retraces instead of reusing a stale kernel.
  """
  interpret: bool    # KDA_LM_PALLAS_INTERPRET (see `interpret_mode`)
  v_block: int       # KDA_LM_PALLAS_V_BLOCK: V columns per program (GPU and
  #                    interpret mode; TPU always takes the whole V)
  num_warps: int     # KDA_LM_PALLAS_NUM_WARPS: Triton warps per program
  recurrence: str    # KDA_LM_PALLAS_RECURRENCE: interpret mode runs the
  #                    recurrences as on GPU ("loop", default) or TPU ("grid")
  precision: str     # KDA_LM_PALLAS_PRECISION: in-kernel dots "highest"
  #                    (IEEE float32, default) or "default" (the backend's
  #                    fast float32: TF32 tensor cores on GPU)


def _env_int(name, default, ok, what):
  env = os.environ.get(name, str(default))
  if not env.isdigit() or not ok(int(env)):
    raise ValueError(f"{name} must be {what}, got {env!r}.")
  return int(env)


def _env_choice(name, choices):
  env = os.environ.get(name, choices[0])
  if env not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {env!r}.")
  return env


def read_options():
  """The `Options` the environment asks for (defaults: interpret on CPU
  only, 64 V columns per program, 4 warps).

  Raises:
    ValueError: a malformed environment variable.
  """
  pow2 = lambda n: n >= 16 and not n & (n - 1)
  return Options(
      interpret=interpret_mode(),
      v_block=_env_int(V_BLOCK_ENV, 64, pow2, "a power of two >= 16"),
      num_warps=_env_int(NUM_WARPS_ENV, 4, lambda n: n in (1, 2, 4, 8, 16),
                         "one of 1, 2, 4, 8, 16"),
      recurrence=_env_choice(RECURRENCE_ENV, ("loop", "grid")),
      precision=_env_choice(PRECISION_ENV, tuple(_PRECISIONS)))


def _tok(x):
  """Chunk n's rows of a [B, H, Tp, x] array (grid (b, h, n))."""
  return pl.BlockSpec((None, None, CHUNK, x), lambda b, h, n: (b, h, n, 0))


def _per_chunk(*block):
  """Chunk n's entry of a [B, H, N, *block] array (grid (b, h, n))."""
  return pl.BlockSpec((None, None, None) + block,
                      lambda b, h, n: (b, h, n) + (0,) * len(block))


def _seg_tok():
  """Chunk n's rows of a [B, Tp, 1] array (shared by the heads)."""
  return pl.BlockSpec((None, CHUNK, 1), lambda b, h, n: (b, n, 0))


def _vspec(*block, v_axis):
  """All of a [B, H, *block] array but V block j along `v_axis` (an index
  into `block`), for the recurrence kernels (grid (b, h, j))."""
  def index(b, h, j):
    return (b, h) + tuple(j if a == v_axis else 0 for a in range(len(block)))
  return pl.BlockSpec((None, None) + block, index)


def _vmem_bytes(specs_and_shapes):
  """Rough double-buffered VMEM need of the blocks (lanes padded to 128)."""
  total = 0
  for block in specs_and_shapes:
    dims = [d for d in block if d is not None]
    total += 4 * math.prod(dims[:-1]) * max(dims[-1], 128)
  return 2 * total + (16 << 20)


def _params(platform, options, specs, semantics=("parallel",) * 3):
  if platform == "tpu":
    return pltpu.CompilerParams(
        dimension_semantics=semantics,
        vmem_limit_bytes=min(_vmem_bytes([s.block_shape for s in specs]),
                             100 << 20))
  if platform == "gpu":
    return pltriton.CompilerParams(num_warps=options.num_warps,
                                   num_stages=1)
  return None


def _per_platform(run, options):
  """run("interpret"), or run("tpu") / run("gpu") by the lowering platform
  (`lax.platform_dependent` lowers only the matching branch); the kernels
  are traced with `options.precision` for their dots."""
  _dot_precision[0] = _PRECISIONS[options.precision]
  try:
    if options.interpret:
      return run("interpret")
    return lax.platform_dependent(tpu=lambda: run("tpu"),
                                  default=lambda: run("gpu"))
  finally:
    _dot_precision[0] = lax.Precision.HIGHEST


def _call(kernel, args, in_specs, out_specs, out_shape, grid, options):
  """A chunk-parallel pallas_call: Mosaic on TPU, Triton on GPU."""
  def run(platform):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=platform == "interpret",
        compiler_params=_params(platform, options,
                                list(in_specs) + list(out_specs)))(*args)

  return _per_platform(run, options)


# Array kinds of the recurrences: [B,H,Tp,K] ("tok_k") and [B,H,Tp,V]
# ("tok_v") rows, [B,H,N,1,K] ("chunk_k") and [B,H,N,K,V] ("chunk_kv")
# per-chunk entries, [B,H,K,V] ("head_kv") states.


def _loop_spec(kind, dims, bv):
  """Whole rows, V block j (grid (b, h, j))."""
  Tp, N, K = dims
  return {"tok_k": lambda: _vspec(Tp, K, v_axis=None),
          "tok_v": lambda: _vspec(Tp, bv, v_axis=1),
          "chunk_k": lambda: _vspec(N, 1, K, v_axis=None),
          "chunk_kv": lambda: _vspec(N, K, bv, v_axis=2),
          "head_kv": lambda: _vspec(K, bv, v_axis=1)}[kind]()


def _grid_spec(kind, dims, V, reverse):
  """Chunk c = n (or N-1-n) of grid (b, h, n), whole V."""
  Tp, N, K = dims
  c = (lambda n: N - 1 - n) if reverse else (lambda n: n)
  blocks = {"tok_k": ((CHUNK, K), lambda n: (c(n), 0)),
            "tok_v": ((CHUNK, V), lambda n: (c(n), 0)),
            "chunk_k": ((None, 1, K), lambda n: (c(n), 0, 0)),
            "chunk_kv": ((None, K, V), lambda n: (c(n), 0, 0)),
            "head_kv": ((K, V), lambda n: (0, 0))}
  block, index = blocks[kind]
  return pl.BlockSpec((None, None) + block,
                      lambda b, h, n: (b, h) + index(n))


def _recurrence(step, args, names, kinds, init, final, options, *, reverse):
  """Runs a recurrence step over all chunks: `_grid_kernel` on TPU (and in
  interpret mode with KDA_LM_PALLAS_RECURRENCE=grid), else `_loop_kernel`
  over V blocks of `options.v_block` columns."""
  B, H, Tp, K = args[names.index("w")].shape
  V = args[names.index(init)].shape[-1]
  N = Tp // CHUNK
  dims = (Tp, N, K)
  outs = [n for n in kinds if n not in names]
  shapes = {"tok_v": (B, H, Tp, V), "chunk_kv": (B, H, N, K, V),
            "head_kv": (B, H, K, V)}
  out_shape = [_shape(*shapes[kinds[n]]) for n in outs]
  all_names = tuple(names) + tuple(outs)

  def run(platform):
    if platform == "tpu" or (platform == "interpret"
                             and options.recurrence == "grid"):
      ins = [_grid_spec(kinds[n], dims, V, reverse) for n in names]
      out_specs = [_grid_spec(kinds[n], dims, V, reverse) for n in outs]
      kernel = functools.partial(_grid_kernel, names=all_names, step=step,
                                 init=init, final=final, n_chunks=N)
      return pl.pallas_call(
          kernel, grid=(B, H, N), in_specs=ins, out_specs=out_specs,
          out_shape=out_shape, interpret=platform == "interpret",
          scratch_shapes=[pltpu.VMEM((K, V), _F32)],
          compiler_params=_params(platform, options, ins + out_specs,
                                  ("parallel", "parallel", "arbitrary")),
      )(*args)
    bv = min(options.v_block, V)
    ins = [_loop_spec(kinds[n], dims, bv) for n in names]
    out_specs = [_loop_spec(kinds[n], dims, bv) for n in outs]
    kernel = functools.partial(_loop_kernel, names=all_names, kinds=kinds,
                               step=step, init=init, final=final,
                               n_chunks=N, reverse=reverse)
    return pl.pallas_call(
        kernel, grid=(B, H, V // bv), in_specs=ins, out_specs=out_specs,
        out_shape=out_shape, interpret=platform == "interpret",
        compiler_params=_params(platform, options, ins + out_specs))(*args)

  return _per_platform(run, options)


class _Config(NamedTuple):
  scale: float
  options: Options


def _shape(*dims):
  return jax.ShapeDtypeStruct(dims, _F32)


def _forward(cfg, q, k, v, g, beta, h0, run, rst):
  """The three forward kernels. Returns o, final and the residuals."""
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  N = Tp // CHUNK
  opts = cfg.options
  tok_in = [_tok(K), _tok(K), _tok(V), _tok(K), _tok(1), _seg_tok(),
            _seg_tok()]
  w, u, qf, ke, dv, aqk = _call(
      functools.partial(_intra_kernel, scale=cfg.scale),
      (q, k, v, g, beta, run, rst), tok_in,
      [_tok(K), _tok(V), _tok(K), _tok(K), _per_chunk(1, K),
       _per_chunk(NB * NB, SUB, SUB)],
      [_shape(B, H, Tp, K), _shape(B, H, Tp, V), _shape(B, H, Tp, K),
       _shape(B, H, Tp, K), _shape(B, H, N, 1, K),
       _shape(B, H, N, NB * NB, SUB, SUB)], (B, H, N), opts)
  vn, s_in, final = _recurrence(
      _recur_step, (w, u, ke, dv, h0), ("w", "u", "ke", "dv", "h0"),
      {"w": "tok_k", "u": "tok_v", "ke": "tok_k", "dv": "chunk_k",
       "h0": "head_kv", "vn": "tok_v", "s_in": "chunk_kv",
       "fin": "head_kv"}, "h0", "fin", opts, reverse=False)
  o, = _call(_out_kernel, (qf, s_in, aqk, vn),
             [_tok(K), _per_chunk(K, V), _per_chunk(NB * NB, SUB, SUB),
              _tok(V)], [_tok(V)], [_shape(B, H, Tp, V)], (B, H, N), opts)
  return o, final, (w, ke, qf, dv, aqk, s_in)


def _backward(cfg, q, k, v, g, beta, run, rst, saved, do, dfin):
  """The three backward kernels: dq, dk, dv, dg, dbeta, dh0."""
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  N = Tp // CHUNK
  opts = cfg.options
  w, ke, qf, dv, aqk, s_in = saved
  ado, qdo = _call(
      _out_bwd_kernel, (qf, aqk, do),
      [_tok(K), _per_chunk(NB * NB, SUB, SUB), _tok(V)],
      [_tok(V), _per_chunk(K, V)],
      [_shape(B, H, Tp, V), _shape(B, H, N, K, V)], (B, H, N), opts)
  dsa, dh0 = _recurrence(
      _recur_bwd_step, (ado, qdo, w, ke, dv, dfin),
      ("ado", "qdo", "w", "ke", "dv", "dfin"),
      {"ado": "tok_v", "qdo": "chunk_kv", "w": "tok_k", "ke": "tok_k",
       "dv": "chunk_k", "dfin": "head_kv", "dsa": "chunk_kv",
       "dh0": "head_kv"}, "dfin", "dh0", opts, reverse=True)
  tok_in = [_tok(K), _tok(K), _tok(V), _tok(K), _tok(1), _seg_tok(),
            _seg_tok()]
  dq, dk, dvv, dg, dbeta = _call(
      functools.partial(_chunk_bwd_kernel, scale=cfg.scale),
      (q, k, v, g, beta, run, rst, s_in, dsa, do),
      tok_in + [_per_chunk(K, V), _per_chunk(K, V), _tok(V)],
      [_tok(K), _tok(K), _tok(V), _tok(K), _tok(1)],
      [_shape(B, H, Tp, K), _shape(B, H, Tp, K), _shape(B, H, Tp, V),
       _shape(B, H, Tp, K), _shape(B, H, Tp, 1)], (B, H, N), opts)
  return dq, dk, dvv, dg, dbeta, dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _kda_kernels(q, k, v, g, beta, h0, run, rst, cfg):
  o, final, _ = _forward(cfg, q, k, v, g, beta, h0, run, rst)
  return o, final


def _kda_kernels_fwd(q, k, v, g, beta, h0, run, rst, cfg):
  o, final, saved = _forward(cfg, q, k, v, g, beta, h0, run, rst)
  return (o, final), (q, k, v, g, beta, run, rst, saved)


def _kda_kernels_bwd(cfg, res, cts):
  q, k, v, g, beta, run, rst, saved = res
  do, dfin = cts
  grads = _backward(cfg, q, k, v, g, beta, run, rst, saved, do, dfin)
  return grads + (jnp.zeros_like(run), jnp.zeros_like(rst))


_kda_kernels.defvjp(_kda_kernels_fwd, _kda_kernels_bwd)


def _pow2(n):
  return max(16, 1 << (n - 1).bit_length())


def kda_pallas(q, k, v, g, beta, segs, h0, scale, *, options=None):
  """Chunked KDA over canonical inputs with the Pallas kernels.

  Args:
    q, k, g: [B,T,H,K] float32, zero at padding (see `common`).
    v: [B,T,H,V] float32.
    beta: [B,T,H] float32.
    segs: `common.Segments`.
    h0: [B,H,K,V] float32.
    scale: float multiplying q.
    options: kernel `Options`; None reads them from the environment.

  Returns:
    o [B,T,H,V] float32 (zero at padding) and the final state [B,H,K,V].
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  reason = unsupported_reason(K, V, CHUNK)
  if reason:
    raise NotImplementedError(reason)
  if options is None:
    options = read_options()
  Tp = -(-T // CHUNK) * CHUNK
  Kp, Vp = _pow2(K), _pow2(V)

  def head_major(x, d, dp):  # [B,T,H,d] -> [B,H,Tp,dp]
    x = jnp.transpose(x, (0, 2, 1, 3))
    return jnp.pad(x, ((0, 0), (0, 0), (0, Tp - T), (0, dp - d)))

  run = jnp.cumsum(segs.reset.astype(jnp.int32), axis=1)
  run = jnp.pad(run, ((0, 0), (0, Tp - T)), mode="edge")
  rst = jnp.pad(segs.reset, ((0, 0), (0, Tp - T)))
  h0 = jnp.pad(h0.astype(_F32), ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
  o, final = _kda_kernels(
      head_major(q, K, Kp), head_major(k, K, Kp), head_major(v, V, Vp),
      head_major(g, K, Kp), head_major(beta[..., None], 1, 1), h0,
      run.astype(_F32)[..., None], rst.astype(_F32)[..., None],
      _Config(scale=float(scale), options=options))
  o = jnp.transpose(o[:, :, :T, :V], (0, 2, 1, 3))
  o = jnp.where(segs.pad[:, :, None, None], 0.0, o)
  return o, final[:, :, :K, :V]
