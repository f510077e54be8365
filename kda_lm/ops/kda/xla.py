"""Chunked KDA in plain XLA: the WY/UT form with in-chunk segment resets.

Per chunk of C rows with state S entering it and `G = cumsum(g)` inside the
chunk (facts in ../shared/notes/kda-math.md):

  Aqk[r,s] = sum_d q_r k_s exp(G_r - G_s)            s <= r, same segment
  M[r,s]   = beta_r sum_d k_r k_s exp(G_r - G_s)     s <  r, same segment
  w = (I+M)^-1 (beta k exp(G)) [rows of the first segment only]
  u = (I+M)^-1 (beta v)
  v_new = u - w S
  o = scale ((q exp(G)) [first segment] S + Aqk v_new)
  S' = exp(G_last) S [if no reset in the chunk]
       + (k exp(G_last - G))^T [last segment] v_new

Segments never need realignment: every cross-segment term is masked. The
pairwise decays are factorised around anchors at the first row of each
c-row sub-block (both factors <= 1); the diagonal sub-blocks use the exact
pairwise decay with the exponent (not the result) masked, so a -1000 gate
stays finite and accurate.

The chunk loop is a `lax.scan` whose body is `jax.checkpoint`ed: autodiff
keeps only the per-chunk states ([N,B,H,K,V]) and recomputes one chunk at a
time in the backward pass, so training memory is
O(T*H*(K+V) + (T/C)*H*K*V) and never one state per token.
"""

import functools

import jax
import jax.numpy as jnp

SUB_BLOCK = 16


def _chunk_step(S, xs, *, scale, sub):
  """One chunk. S [B,H,K,V]; xs: q,k,G [B,H,C,K], v [B,H,C,V], beta [B,H,C],
  run [B,C] int32 (segment run index), run_prev [B] int32."""
  q, k, v, G, beta, run, run_prev = xs
  B, H, C, K = q.shape
  nb = C // sub
  f32 = jnp.float32
  neg_inf = jnp.array(-jnp.inf, f32)

  # --- Pairwise decayed products Aqk, Akk [B,H,C,C] -------------------------
  q_b = q.reshape(B, H, nb, sub, K)
  k_b = k.reshape(B, H, nb, sub, K)
  G_b = G.reshape(B, H, nb, sub, K)
  anchor = G_b[:, :, :, :1, :]                       # [B,H,nb,1,K]
  e_row = jnp.exp(G_b - anchor)                      # <= 1
  # Column factors exp(anchor_i - G_s) for s before block i (<= 1); later
  # columns are masked in the exponent.
  col_before = (jnp.arange(C)[None, :] <
                (jnp.arange(nb) * sub)[:, None])     # [nb, C]
  expo = anchor - G[:, :, None, :, :]                # [B,H,nb,C,K]
  k_col = k[:, :, None] * jnp.exp(
      jnp.where(col_before[None, None, :, :, None], expo, neg_inf))
  aqk_off = jnp.einsum("bhirk,bhisk->bhirs", q_b * e_row, k_col)
  akk_off = jnp.einsum("bhirk,bhisk->bhirs", k_b * e_row, k_col)
  # Diagonal sub-blocks: exact pairwise decay, exponent masked above r.
  tri_sub = jnp.tril(jnp.ones((sub, sub), bool))
  diff = G_b[:, :, :, :, None, :] - G_b[:, :, :, None, :, :]
  decay = jnp.exp(jnp.where(tri_sub[:, :, None], diff, neg_inf))
  aqk_d = jnp.einsum("bhirk,bhisk,bhirsk->bhirs", q_b, k_b, decay)
  akk_d = jnp.einsum("bhirk,bhisk,bhirsk->bhirs", k_b, k_b, decay)
  eye_nb = jnp.eye(nb, dtype=f32)

  def assemble(off, diag):  # off [B,H,nb,sub,C], diag [B,H,nb,sub,sub]
    diag = jnp.einsum("bhirs,ij->bhirjs", diag, eye_nb)
    return (off + diag.reshape(B, H, nb, sub, C)).reshape(B, H, C, C)

  aqk = assemble(aqk_off, aqk_d)
  akk = assemble(akk_off, akk_d)

  # --- Segment masks ---------------------------------------------------------
  same = run[:, :, None] == run[:, None, :]          # [B,C,C]
  tri = jnp.tril(jnp.ones((C, C), bool))
  strict = jnp.tril(jnp.ones((C, C), bool), -1)
  aqk = aqk * (same & tri)[:, None].astype(f32)
  m = akk * (same & strict)[:, None].astype(f32) * beta[..., None]
  first = (run == run_prev[:, None])[:, None, :, None].astype(f32)  # [B,1,C,1]
  last = (run == run[:, -1:])[:, None, :, None].astype(f32)
  carry = (run[:, -1] == run_prev)[:, None, None, None].astype(f32)

  # --- WY / UT transform: (I + M) [w | u] = [beta k exp(G) | beta v] ---------
  eG = jnp.exp(G)                                    # <= 1
  rhs = jnp.concatenate(
      [beta[..., None] * k * eG * first, beta[..., None] * v], axis=-1)
  wu = jax.lax.linalg.triangular_solve(
      m, rhs, left_side=True, lower=True, unit_diagonal=True)
  w, u = wu[..., :K], wu[..., K:]

  # --- State interaction -----------------------------------------------------
  v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, S)
  o = scale * (jnp.einsum("bhck,bhkv->bhcv", q * eG * first, S)
               + jnp.einsum("bhrs,bhsv->bhrv", aqk, v_new))
  G_last = G[:, :, -1:, :]                           # [B,H,1,K]
  k_dec = k * jnp.exp(G_last - G) * last             # exponent <= 0
  S_next = (carry * jnp.exp(G_last[:, :, 0, :])[..., None] * S
            + jnp.einsum("bhck,bhcv->bhkv", k_dec, v_new))
  return S_next, o


def kda_chunked(q, k, v, g, beta, segs, h0, scale, *, chunk_size=64):
  """Chunked KDA over canonical inputs (see `common` and `reference`).

  Args:
    q, k, g: [B,T,H,K] float32, zero at padding.
    v: [B,T,H,V] float32.
    beta: [B,T,H] float32.
    segs: `common.Segments`.
    h0: [B,H,K,V] float32.
    scale: float multiplying q.
    chunk_size: C, a multiple of 16 (or 16, 8, 4, 2, 1 themselves).

  Returns:
    o [B,T,H,V] float32 (zero at padding) and the final state [B,H,K,V].
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  sub = min(SUB_BLOCK, C)
  N = -(-T // C)
  Tp = N * C
  run = jnp.cumsum(segs.reset.astype(jnp.int32), axis=1)        # [B,T]
  if Tp != T:  # trailing padding is transparent: zero inputs, same run
    extra = Tp - T
    pad_t = lambda x: jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = map(pad_t, (q, k, v, g, beta))
    run = jnp.pad(run, ((0, 0), (0, extra)), mode="edge")

  def to_chunks(x):  # [B,Tp,H,X] -> [N,B,H,C,X]
    x = x.reshape(B, N, C, H, -1)
    return jnp.transpose(x, (1, 0, 3, 2, 4))

  G = jnp.cumsum(to_chunks(g), axis=3)
  beta_c = to_chunks(beta[..., None])[..., 0]                  # [N,B,H,C]
  run_c = jnp.transpose(run.reshape(B, N, C), (1, 0, 2))       # [N,B,C]
  run_prev = jnp.concatenate(
      [jnp.zeros((1, B), jnp.int32), run_c[:-1, :, -1]], axis=0)  # [N,B]
  xs = (to_chunks(q), to_chunks(k), to_chunks(v), G, beta_c, run_c, run_prev)
  step = jax.checkpoint(functools.partial(_chunk_step, scale=scale, sub=sub))
  final, o = jax.lax.scan(step, h0, xs)
  o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, Tp, H, V)[:, :T]
  o = jnp.where(segs.pad[:, :, None, None], 0.0, o)
  return o, final
