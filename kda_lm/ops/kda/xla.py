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
Sub-blocks are 16 rows with safe gates and 8 with exact gates (whose
pairwise decays cost C*c*K exponentials per chunk); the triangular inverse
works on 16-row blocks either way.

Chunks are processed in groups of `GROUP_CHUNKS`: an outer `lax.scan` over
groups does the intra-chunk work of a group vectorised over its chunks, and
an inner scan carries the state through them. The op is a `jax.custom_vjp`
(`chunk_math` has the per-chunk math, forward and hand-derived backward):
the forward saves the state entering every chunk, [N,B,H,K,V] (N = T/C),
each chunk's v_new and its Aqk, Akk and (I + M)^-1 ([C,C] each); the
backward walks the groups in reverse, recomputes a group's remaining
intra-chunk terms (decay factors, w), runs the reverse state recurrence

  dv_new = Aqk^T do + (k E) dS',   dS = Dv dS' + (q F)^T do - w^T dv_new

over its chunks (keeping each dv_new), then forms every per-row gradient of
the group's chunks at once. Training memory is O(T*H*(K+2V+3C) +
(T/C)*H*K*V), never a state per
token. Forward-mode autodiff (`jax.jvp`) is not supported by a custom VJP:
it raises `TypeError`; use the reference implementation for tangents.
"""

import functools

import jax
import jax.numpy as jnp

from kda_lm import segments
from kda_lm.ops.kda import chunk_math, common

SAFE_SUB_BLOCK = 16   # c with safe gates (a sub-block decays by <= e^80)
EXACT_SUB_BLOCK = 8   # c with exact gates: pairwise decays cost C*c*K
SOLVE_BLOCK = common.SUB_BLOCK  # block of the blocked triangular inverse
GROUP_CHUNKS = 4      # chunks per group (memory/speed trade-off)


def _chunk_major(x):
  return jnp.moveaxis(x, 2, 0)                               # G to front


def _group_forward(S, xs, *, sub, solve, safe, save):
  """One group of chunks: intra work vectorised, then the state recurrence.

  Returns the state leaving the group, the outputs [B,H,G,C,V] and, with
  `save`, the residuals of the backward pass: the states entering each chunk
  [B,H,G,K,V], each chunk's v_new [B,H,G,C,V], and its Aqk, Akk and
  (I + M)^-1.
  """
  q, k, v, g, beta, run, run_prev = xs
  it = chunk_math.intra(q, k, v, g, beta, run, run_prev, sub=sub,
                        solve=solve, safe=safe)
  kd = k * it.E

  def state_step(S, x):  # S [B,H,K,V]
    w_c, u_c, kd_c, decay_c = x
    v_new = u_c - w_c @ S
    S_next = decay_c[..., None] * S + jnp.swapaxes(kd_c, -1, -2) @ v_new
    return S_next, (v_new, S)

  S, (v_new, S_in) = jax.lax.scan(
      state_step, S, tuple(map(_chunk_major, (it.w, it.u, kd, it.Dv))))
  v_new = jnp.moveaxis(v_new, 0, 2)                          # [B,H,G,C,V]
  S_in = jnp.moveaxis(S_in, 0, 2)                            # [B,H,G,K,V]
  o = (q * it.F) @ S_in + it.aqk @ v_new
  return S, (o, (S_in, v_new, it.aqk, it.akk, it.p) if save else None)


def _group_backward(dS, xs, *, sub, solve, safe):
  """One group in reverse: dS leaving the group -> dS entering it, grads."""
  q, k, v, g, beta, run, run_prev, (S_in, v_new, *saved), do = xs
  it = chunk_math.intra(q, k, v, g, beta, run, run_prev, sub=sub,
                        solve=solve, safe=safe, saved=saved)
  ado, qdo, kd = chunk_math.state_bwd_inputs(it, k, q, do)

  def state_step(dS, x):  # dS [B,H,K,V]: cotangent of the state after chunk
    ado_c, qdo_c, w_c, kd_c, decay_c = x
    dvn = ado_c + kd_c @ dS
    dS_prev = decay_c[..., None] * dS + qdo_c - jnp.swapaxes(w_c, -1, -2) @ dvn
    return dS_prev, (dS, dvn)

  dS, (dS_out, dvn) = jax.lax.scan(
      state_step, dS, tuple(map(_chunk_major, (ado, qdo, it.w, kd, it.Dv))),
      reverse=True)
  dS_out = jnp.moveaxis(dS_out, 0, 2)                        # [B,H,G,K,V]
  dvn = jnp.moveaxis(dvn, 0, 2)                              # [B,H,G,C,V]
  grads = chunk_math.chunk_grads(q, k, v, beta, run, run_prev, it, S_in,
                                 v_new, dS_out, dvn, do, safe=safe)
  return dS, grads


def _scan_forward(q, k, v, g, beta, h0, run, run_prev, cfg, save):
  sub, solve, safe = cfg
  step = functools.partial(_group_forward, sub=sub, solve=solve, safe=safe,
                           save=save)
  final, (o, saved) = jax.lax.scan(step, h0,
                                   (q, k, v, g, beta, run, run_prev))
  return o, final, saved


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _chunked(q, k, v, g, beta, h0, run, run_prev, cfg):
  """Grouped chunked KDA: inputs [n_groups,B,H,gc,C,X]; (o, final state)."""
  o, final, _ = _scan_forward(q, k, v, g, beta, h0, run, run_prev, cfg,
                              save=False)
  return o, final


def _chunked_fwd(q, k, v, g, beta, h0, run, run_prev, cfg):
  o, final, saved = _scan_forward(q, k, v, g, beta, h0, run, run_prev, cfg,
                                  save=True)
  return (o, final), (q, k, v, g, beta, run, run_prev, saved)


def _chunked_bwd(cfg, res, cts):
  sub, solve, safe = cfg
  q, k, v, g, beta, run, run_prev, saved = res
  do, dfinal = cts
  step = functools.partial(_group_backward, sub=sub, solve=solve, safe=safe)
  dh0, (dq, dk, dv, dg, dbeta) = jax.lax.scan(
      step, dfinal, (q, k, v, g, beta, run, run_prev, saved, do),
      reverse=True)
  return dq, dk, dv, dg, dbeta, dh0, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def kda_chunked(q, k, v, g, beta, masks, h0, scale, *, chunk_size=64,
                safe_gate=False, group_chunks=None):
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
    group_chunks: chunks per group (memory/speed trade-off); None takes
      `GROUP_CHUNKS`.

  Returns:
    o [B,T,H,V] float32 (zero at padding) and the final state [B,H,K,V].
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  sub = min(SAFE_SUB_BLOCK if safe_gate else EXACT_SUB_BLOCK, C)
  sub = sub if C % sub == 0 else C
  solve = min(SOLVE_BLOCK, C)
  n_chunks = -(-T // C)
  n_groups = -(-n_chunks // (group_chunks or GROUP_CHUNKS))
  gc = -(-n_chunks // n_groups)                              # chunks per group
  Tp = n_groups * gc * C
  run = segments.state_runs(masks.reset)                        # [B,T]
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
  o, final = _chunked(grouped(q), grouped(k), grouped(v), grouped(g),
                      grouped(beta[..., None])[..., 0], h0, run_c, run_prev,
                      (sub, solve, bool(safe_gate)))  # o [n,B,H,gc,C,V]
  o = jnp.transpose(o, (1, 0, 3, 4, 2, 5)).reshape(B, Tp, H, V)[:, :T]
  o = jnp.where(masks.pad[:, :, None, None], 0.0, o)
  return o, final
