"""Per-chunk math shared by the forward and backward kernels.

Everything in one chunk of C=64 tokens that does not depend on the carried
state (sub-blocks of c=16 rows; derivation in docs/kda.md).
"""

from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from kda_lm.ops.kda.pallas import helpers as hp


class Chunk(NamedTuple):
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


def diag_columns(ch, body, init, blocks=tuple(range(hp.NB))):
  """Runs body(c, dec, acc) for each column c of the diagonal sub-blocks.

  `dec[n]` is the exact pairwise decay exp(L_r - L_c) [SUB,K] of block
  `blocks[n]` for rows r >= c in c's segment (0 elsewhere), built from a
  masked exponent.
  """
  def step(c, acc):
    decs = []
    for i in blocks:
      l_c = hp.row(ch.L[i], c)
      r_c = hp.row(ch.run[i], c)
      mask = (hp.rows(hp.SUB) >= c) & (ch.run[i] == r_c)
      decs.append(hp.masked_exp(mask, ch.L[i] - l_c))
    return body(c, decs, acc)
  return lax.fori_loop(0, hp.SUB, step, init)


def chunk_gates(q, k, v, g, beta, run, reset):
  """The chunk's masks and decays, X = beta k F and beta v: everything but
  the decayed products (`chunk_decays`) and the solve (`solve`). Every
  [SUB,K] result depends on its own columns of q, k and g only."""
  tri = hp.rows(hp.SUB) >= hp.cols(hp.SUB)
  same = same_blocks(run)
  wf = [jnp.where(same[i, i] & tri, 1.0, 0.0).astype(hp.F32)
        for i in range(hp.NB)]
  # The cumulated gates feed every exponent: always IEEE float32.
  L = [hp.mm_exact(wf[i], g[i]) for i in range(hp.NB)]
  tot = [hp.row(x, hp.SUB - 1) for x in L]
  reach = [r == hp.row(r, hp.SUB - 1) for r in run]
  e_row = [jnp.exp(x) for x in L]
  e_col = [hp.masked_exp(reach[i], tot[i] - L[i]) for i in range(hp.NB)]
  e_between = {}
  for i in range(hp.NB):
    for j in range(i):
      acc = jnp.zeros_like(tot[0])
      for m in range(j + 1, i):
        acc = acc + tot[m]
      e_between[i, j] = jnp.exp(acc)

  run_prev = hp.row(run[0], 0) - hp.row(reset[0], 0)     # [1,1]
  run_last = hp.row(run[-1], hp.SUB - 1)
  total = tot[0]
  for m in range(1, hp.NB):
    total = total + tot[m]
  F, E = [], []
  for i in range(hp.NB):
    before = jnp.zeros_like(tot[0])
    after = jnp.zeros_like(tot[0])
    for m in range(hp.NB):
      if m < i:
        before = before + tot[m]
      elif m > i:
        after = after + tot[m]
    F.append(hp.masked_exp(run[i] == run_prev, L[i] + before))
    E.append(hp.masked_exp(run[i] == run_last, tot[i] - L[i] + after))
  Dv = hp.masked_exp(run_last == run_prev, total)
  return Chunk(q=q, k=k, v=v, beta=beta, same=same, wf=wf, L=L,
               e_row=e_row, e_col=e_col, e_between=e_between, run=run,
               reach=reach, F=F, E=E, Dv=Dv, aqk=None, akk=None, P=None,
               X=[beta[i] * k[i] * F[i] for i in range(hp.NB)],
               bv=None if v is None else [beta[i] * v[i]
                                          for i in range(hp.NB)],
               w=None, u=None)


def chunk_decays(q, k, v, g, beta, run, reset):
  """`chunk_gates` and the decayed products Aqk and Akk."""
  ch = chunk_gates(q, k, v, g, beta, run, reset)
  q, k, same, e_row, e_col, e_between = (
      ch.q, ch.k, ch.same, ch.e_row, ch.e_col, ch.e_between)
  strict = hp.rows(hp.SUB) > hp.cols(hp.SUB)
  # Decayed products: off-diagonal blocks factorised, diagonal ones exact.
  aqk, akk = {}, {}
  for i in range(hp.NB):
    for j in range(i):
      k_col = k[j] * e_col[j]
      aqk[i, j] = jnp.where(
          same[i, j], hp.mm_nt(q[i] * e_row[i] * e_between[i, j], k_col), 0.0)
      akk[i, j] = jnp.where(
          same[i, j], hp.mm_nt(k[i] * e_row[i] * e_between[i, j], k_col), 0.0)

  def diag_body(c, decs, acc):
    sel = hp.cols(hp.SUB) == c
    out = []
    for i in range(hp.NB):
      kd = decs[i] * hp.row(k[i], c)
      a_q, a_k = acc[i]
      a_q = a_q + jnp.where(sel, jnp.sum(q[i] * kd, axis=1, keepdims=True),
                            0.0)
      a_k = a_k + jnp.where(sel, jnp.sum(k[i] * kd, axis=1, keepdims=True),
                            0.0)
      out.append((a_q, a_k))
    return out

  zero = jnp.zeros((hp.SUB, hp.SUB), hp.F32)
  diag = diag_columns(ch, diag_body, [(zero, zero)] * hp.NB)
  for i in range(hp.NB):
    aqk[i, i] = diag[i][0]
    akk[i, i] = jnp.where(strict, diag[i][1], 0.0)

  return ch._replace(aqk=aqk, akk=akk)


def solve(ch):
  """`ch` with P = (I + M)^-1, M = diag(beta) Akk (blocked forward
  substitution), and the WY factors w = P X, u = P (beta v)."""
  beta, akk, X, bv = ch.beta, ch.akk, ch.X, ch.bv
  M = {ij: beta[ij[0]] * a for ij, a in akk.items()}
  eye = jnp.where(hp.rows(hp.SUB) == hp.cols(hp.SUB), 1.0, 0.0).astype(hp.F32)

  def solve_step(c, xs):
    return [x - hp.col(M[i, i], c) * hp.row(x, c) for i, x in enumerate(xs)]

  diag_p = lax.fori_loop(0, hp.SUB, solve_step, [eye] * hp.NB)
  P = {(i, i): diag_p[i] for i in range(hp.NB)}
  for d in range(1, hp.NB):
    for j in range(hp.NB - d):
      i = j + d
      acc = hp.mm(M[i, j], P[j, j])
      for m in range(j + 1, i):
        acc = acc + hp.mm(M[i, m], P[m, j])
      P[i, j] = -hp.mm(P[i, i], acc)

  w, u = [], []
  for i in range(hp.NB):
    w_i = hp.mm(P[i, 0], X[0])
    u_i = hp.mm(P[i, 0], bv[0])
    for j in range(1, i + 1):
      w_i = w_i + hp.mm(P[i, j], X[j])
      u_i = u_i + hp.mm(P[i, j], bv[j])
    w.append(w_i)
    u.append(u_i)
  return ch._replace(P=P, w=w, u=u)


def chunk_from_refs(refs, scale, products=True):
  """`chunk_decays` (or `chunk_gates` without `products`) of the one chunk
  that the (chunk-sized) refs hold."""
  q_ref, k_ref, v_ref, g_ref, beta_ref, run_ref, reset_ref = refs
  return (chunk_decays if products else chunk_gates)(
      hp.ref_blocks(q_ref, scale), hp.ref_blocks(k_ref),
      hp.ref_blocks(v_ref) if products else None, hp.ref_blocks(g_ref),
      hp.ref_blocks(beta_ref),
      hp.ref_blocks(run_ref), hp.ref_blocks(reset_ref))


def same_blocks(run):
  """(i, j), j <= i: [SUB,SUB] bool, rows of block i and columns of block j
  in the same segment, from the run-index blocks."""
  run_row = [hp.col_to_row(r) for r in run]
  return {(i, j): run[i] == run_row[j] for i in range(hp.NB)
          for j in range(i + 1)}
