"""The TPU kernels of KDA (Mosaic): one forward and one backward pallas_call.

Designed for a TPU core rather than shared with Triton. Each program takes
`heads_per_program` heads of one row and walks the row's chunks in order
(the chunk axis of the grid is "arbitrary"; batch and head groups are
"parallel"), with the float32 [K,V] states of its heads in VMEM scratch.
A step runs the whole chunk for each of its heads (`tpu_chunk`): the gate
cumsum, the decayed products, the triangular inverse, w and u, the output
and the state update. The heads are unrolled, so the scheduler overlaps one
head's matmuls with another's.

Layout: q, k, v, g stay token-major, [B, T, H*K] (a free reshape of
[B,T,H,K]); a head is a 128-aligned lane slice of a block, so nothing is
transposed. beta and the segment rows ride in [.., 8 or heads, C] blocks.

The forward saves, per chunk and head, the state entering the chunk and the
inverse P (float32); the backward walks the chunks in reverse with the
state cotangent in scratch, recomputes the rest of the chunk and writes
every gradient of the chunk. Needs gates bounded below by -5 (the bounded
gate form, `lower_bound`): the diagonal sub-blocks factorise their decays
(`tpu_chunk`). On TPU, K and V are padded to multiples of 128.
"""

import functools
from typing import NamedTuple

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from kda_lm import segments
from kda_lm.ops.kda.pallas import tpu_chunk as tc

C = tc.CHUNK
F32 = jnp.float32
LANES = 128


class Config(NamedTuple):
  """Static settings of one call (hashable)."""
  scale: float
  heads: int            # heads per program, forward
  bwd_heads: int        # heads per program, backward
  inverse_heads: int    # heads per block-diagonal inverse
  precision: tc.Precisions
  vmem_bytes: int
  interpret: bool
  qkv_bf16: bool        # q, k, v enter the kernels in bfloat16


def _divisor(n, want):
  """The largest divisor of n that is <= want."""
  return max(d for d in range(1, min(n, want) + 1) if n % d == 0)


def _params(cfg):
  if cfg.interpret:
    return None
  return pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "arbitrary"),
      vmem_limit_bytes=cfg.vmem_bytes)


def _specs(heads, group, K, V, N, reverse):
  """BlockSpecs by array kind for grid (b, head group j, step n)."""
  c = (lambda n: N - 1 - n) if reverse else (lambda n: n)
  return {
      "tok_k": pl.BlockSpec((None, C, heads * K),
                            lambda b, j, n: (b, c(n), j)),
      "tok_v": pl.BlockSpec((None, C, heads * V),
                            lambda b, j, n: (b, c(n), j)),
      "beta": pl.BlockSpec((None, None, None, heads, C),
                           lambda b, j, n: (b, j, c(n), 0, 0)),
      "seg": pl.BlockSpec((None, None, 8, C),
                          lambda b, j, n: (b, c(n), 0, 0)),
      "head_kv": pl.BlockSpec((None, heads * K, V),
                              lambda b, j, n: (b, j, 0)),
      "chunk_kv": pl.BlockSpec((None, None, heads * K, V),
                               lambda b, j, n: (b, c(n), j, 0)),
      "chunk_p": pl.BlockSpec((None, None, heads * C, group * C),
                              lambda b, j, n: (b, c(n), j, 0)),
  }


def _beta_blocks(beta, heads):
  """[B,Tp,H] -> [B, H/heads, N, heads, C]."""
  B, Tp, H = beta.shape
  x = beta.reshape(B, Tp // C, C, H // heads, heads)
  return jnp.transpose(x, (0, 3, 1, 4, 2))


def _beta_tokens(x):
  """Inverse of `_beta_blocks`."""
  B, J, N, heads, _ = x.shape
  return jnp.transpose(x, (0, 2, 4, 1, 3)).reshape(B, N * C, J * heads)


def _heads(q_ref, k_ref, v_ref, g_ref, beta_ref, heads):
  """The `tpu_chunk.Head` of each head of the block."""
  K = q_ref.shape[1] // heads
  V = v_ref.shape[1] // heads
  betas = beta_ref[...]
  f32 = lambda ref, i, n: ref[:, pl.ds(i * n, n)].astype(F32)
  return [tc.Head(f32(q_ref, h, K), f32(k_ref, h, K), f32(v_ref, h, V),
                  g_ref[:, pl.ds(h * K, K)], tc.row_to_col(betas[h:h + 1, :]))
          for h in range(heads)]


def _split_rows(x, n):
  size = x.shape[0] // n
  return [x[i * size:(i + 1) * size] for i in range(n)]


def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, h0_ref,
                o_ref, fin_ref, *rest, heads, group, save, prec):
  state = rest[-1]
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    state[...] = h0_ref[...]

  # Every head's state is read at once and written at once, so no head
  # waits on another's store.
  states = state[...]
  outs, nexts, ps = tc.chunk_forward(
      _heads(q_ref, k_ref, v_ref, g_ref, beta_ref, heads),
      _split_rows(states, heads), tc.chunk_masks(seg_ref[...]), prec, group)
  V = v_ref.shape[1] // heads
  for h, o in enumerate(outs):
    o_ref[:, pl.ds(h * V, V)] = o
  if save:
    rest[0][...] = states.astype(rest[0].dtype)
    rest[1][...] = jnp.concatenate(ps, axis=0).astype(rest[1].dtype)
  state[...] = jnp.concatenate(nexts, axis=0)

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    fin_ref[...] = state[...]


def _forward(cfg, q, k, v, g, beta, seg, h0, save):
  """o [B,Tp,H*V], final [B,H*K,V] and, with `save`, the per-chunk states
  [B,N,H*K,V] and inverses [B,N,H*C,C]."""
  B, Tp, HK = q.shape
  HV = v.shape[2]
  H = beta.shape[2]
  K, V, N = HK // H, HV // H, Tp // C
  heads = _divisor(H, cfg.heads)
  group = _divisor(heads, cfg.inverse_heads)
  sp = _specs(heads, group, K, V, N, reverse=False)
  shape = lambda *d: jax.ShapeDtypeStruct(d, F32)
  out_specs = [sp["tok_v"], sp["head_kv"]]
  out_shape = [shape(B, Tp, HV), shape(B, HK, V)]
  if save:
    # Saved at the precision of the dots that read them (lossless for P;
    # the states also enter the gate gradient's S * dS' sum).
    res = lambda p: jnp.bfloat16 if p == "bf16" else F32
    out_specs += [sp["chunk_kv"], sp["chunk_p"]]
    out_shape += [
        jax.ShapeDtypeStruct((B, N, HK, V), res(cfg.precision.state)),
        jax.ShapeDtypeStruct((B, N, H * C, group * C),
                             res(cfg.precision.chunk))]
  kernel = functools.partial(
      _fwd_kernel, heads=heads, group=group, save=save, prec=cfg.precision)
  return pl.pallas_call(
      kernel, grid=(B, H // heads, N),
      in_specs=[sp["tok_k"], sp["tok_k"], sp["tok_v"], sp["tok_k"],
                sp["beta"], sp["seg"], sp["head_kv"]],
      out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((heads * K, V), F32)],
      compiler_params=_params(cfg), interpret=cfg.interpret,
      name="kda_tpu_forward",
  )(q, k, v, g, _beta_blocks(beta, heads), seg, h0)


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, s_ref, p_ref,
                do_ref, dfin_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref,
                dh0_ref, dstate, *, heads, group, prec):
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    dstate[...] = dfin_ref[...]

  K = q_ref.shape[1] // heads
  V = v_ref.shape[1] // heads
  dos = do_ref[...]
  grads = tc.chunk_backward(
      _heads(q_ref, k_ref, v_ref, g_ref, beta_ref, heads),
      _split_rows(s_ref[...].astype(F32), heads),
      _split_rows(p_ref[...].astype(F32), heads // group),
      _split_rows(dstate[...], heads),
      [dos[:, h * V:(h + 1) * V] for h in range(heads)],
      tc.chunk_masks(seg_ref[...]), prec, group)
  for h, gr in enumerate(grads):
    ks, vs = pl.ds(h * K, K), pl.ds(h * V, V)
    dq_ref[:, ks] = gr.dq
    dk_ref[:, ks] = gr.dk
    dv_ref[:, vs] = gr.dv
    dg_ref[:, ks] = gr.dg
  dbeta_ref[...] = jnp.concatenate([tc.col_to_row(gr.dbeta) for gr in grads],
                                   axis=0)
  dstate[...] = jnp.concatenate([gr.dS for gr in grads], axis=0)

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    dh0_ref[...] = dstate[...]


def _backward(cfg, q, k, v, g, beta, seg, s_in, p, do, dfin):
  B, Tp, HK = q.shape
  HV = v.shape[2]
  H = beta.shape[2]
  K, V, N = HK // H, HV // H, Tp // C
  heads = _divisor(H, cfg.bwd_heads)
  group = p.shape[3] // C
  if heads % group:
    heads = group * _divisor(H // group, max(1, heads // group))
  sp = _specs(heads, group, K, V, N, reverse=True)
  shape = lambda *d: jax.ShapeDtypeStruct(d, F32)
  kernel = functools.partial(
      _bwd_kernel, heads=heads, group=group, prec=cfg.precision)
  dq, dk, dv, dg, dbeta, dh0 = pl.pallas_call(
      kernel, grid=(B, H // heads, N),
      in_specs=[sp["tok_k"], sp["tok_k"], sp["tok_v"], sp["tok_k"],
                sp["beta"], sp["seg"], sp["chunk_kv"], sp["chunk_p"],
                sp["tok_v"], sp["head_kv"]],
      out_specs=[sp["tok_k"], sp["tok_k"], sp["tok_v"], sp["tok_k"],
                 sp["beta"], sp["head_kv"]],
      out_shape=[shape(B, Tp, HK), shape(B, Tp, HK), shape(B, Tp, HV),
                 shape(B, Tp, HK), shape(B, H // heads, N, heads, C),
                 shape(B, HK, V)],
      scratch_shapes=[pltpu.VMEM((heads * K, V), F32)],
      compiler_params=_params(cfg), interpret=cfg.interpret,
      name="kda_tpu_backward",
  )(q, k, v, g, _beta_blocks(beta, heads), seg, s_in, p, do, dfin)
  return dq, dk, dv, dg, _beta_tokens(dbeta), dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _kernels(q, k, v, g, beta, h0, seg, cfg):
  o, final = _forward(cfg, q, k, v, g, beta, seg, h0, save=False)
  return o, final


def _kernels_fwd(q, k, v, g, beta, h0, seg, cfg):
  o, final, s_in, p = _forward(cfg, q, k, v, g, beta, seg, h0, save=True)
  return (o, final), (q, k, v, g, beta, seg, s_in, p)


def _kernels_bwd(cfg, res, cts):
  q, k, v, g, beta, seg, s_in, p = res
  do, dfin = cts
  dq, dk, dv, dg, dbeta, dh0 = _backward(cfg, q, k, v, g, beta, seg, s_in, p,
                                         do, dfin)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg,
          dbeta, dh0, jnp.zeros_like(seg))


_kernels.defvjp(_kernels_fwd, _kernels_bwd)


def segment_rows(reset, Tp):
  """[B,T] reset flags -> [B, N, 8, C] float32 segment rows (`tpu_chunk.
  chunk_masks`): run index, first-segment and last-segment flags."""
  B, T = reset.shape
  run = segments.state_runs(reset)
  run = jnp.pad(run, ((0, 0), (0, Tp - T)), mode="edge")
  run = run.reshape(B, Tp // C, C)
  prev = jnp.concatenate([jnp.zeros((B, 1), run.dtype), run[:, :-1, -1]],
                         axis=1)
  first = run == prev[..., None]
  last = run == run[..., -1:]
  zeros = jnp.zeros_like(run, F32)
  return jnp.stack([run.astype(F32), first.astype(F32), last.astype(F32)]
                   + [zeros] * 5, axis=2)


def _round_up(x, m):
  return -(-x // m) * m


def kda_tpu(q, k, v, g, beta, masks, h0, cfg):
  """Chunked KDA over canonical inputs (see `common`) with the TPU kernels.

  Args:
    q, k, g: [B,T,H,K] float32, zero at padding; g bounded below by -5.
    v: [B,T,H,V] float32.
    beta: [B,T,H] float32.
    masks: `common.Segments`.
    h0: [B,H,K,V] float32.
    cfg: `Config` (its `scale` multiplies q); with `qkv_bf16` the
      (normalised, scaled) q, k and v enter the kernels in bfloat16, and
      their gradients leave in it.

  Returns:
    o [B,T,H,V] float32 (zero at padding) and the final state [B,H,K,V].
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  Tp = _round_up(T, C)
  Kp, Vp = (K, V) if cfg.interpret else (_round_up(K, LANES),
                                         _round_up(V, LANES))

  def tokens(x, d, dp, dtype=F32):  # [B,T,H,d] -> [B,Tp,H*dp]
    x = jnp.pad(x.astype(dtype), ((0, 0), (0, Tp - T), (0, 0), (0, dp - d)))
    return x.reshape(B, Tp, H * dp)

  h0 = jnp.pad(h0, ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
  qkv = jnp.bfloat16 if cfg.qkv_bf16 else F32
  o, final = _kernels(
      tokens(q * cfg.scale, K, Kp, qkv), tokens(k, K, Kp, qkv),
      tokens(v, V, Vp, qkv),
      tokens(g, K, Kp), jnp.pad(beta, ((0, 0), (0, Tp - T), (0, 0))),
      h0.reshape(B, H * Kp, Vp), segment_rows(masks.reset, Tp), cfg)
  o = o.reshape(B, Tp, H, Vp)[:, :T, :, :V]
  o = jnp.where(masks.pad[:, :, None, None], 0.0, o)
  return o, final.reshape(B, H, Kp, Vp)[:, :, :K, :V]
