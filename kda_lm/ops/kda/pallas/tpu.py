"""The TPU kernels of KDA (Mosaic): one forward and one backward pallas_call.

Designed for a TPU core rather than shared with Triton. Each program takes
`heads_per_program` heads of one row and walks the row's chunks in order
(the chunk axis of the grid is "arbitrary"; batch and head groups are
"parallel"), with the float32 [K,V] states of its heads in VMEM scratch.
A step runs the whole chunk for each of its heads (`tpu_chunk`): the
preparation of the raw inputs (q/k norm, query scale, bounded gate, zeroed
padding), the gate cumsum, the decayed products, the triangular inverse,
w and u, the output and the state update. The heads are unrolled, so the
scheduler overlaps one head's matmuls with another's.

Layout: q, k, v, g are read token-major, [B, T, H*K], in the caller's
dtype; a head is a 128-aligned lane slice of a block, so nothing is
transposed. (The KDA layer's projections produce that layout; its
[B,T,H,K] view and the reshape back cancel.) beta, the segment rows and
the gate parameters ride in small [.., 8 or heads, ..] blocks.

The forward saves, per chunk and head, the state entering the chunk and the
inverse P (at their dots' precision); the backward walks the chunks in
reverse with the state cotangent in scratch, recomputes the rest of the
chunk and writes every gradient of the chunk, the gate parameters' as
per-chunk sums. Needs gates bounded below by -5 (the bounded gate form,
`lower_bound`): the diagonal sub-blocks factorise their decays
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
  prep: tc.Prep         # scale, gate floor, q/k norm (done in the kernels)
  heads: int            # heads per program, forward
  bwd_heads: int        # heads per program, backward
  inverse_heads: int    # heads per block-diagonal inverse
  precision: tc.Precisions
  vmem_bytes: int
  interpret: bool


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
      "gate": pl.BlockSpec((8, heads * K), lambda b, j, n: (0, j)),
      "chunk_gate": pl.BlockSpec((None, None, 8, heads * K),
                                 lambda b, j, n: (b, c(n), 0, j)),
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


def _heads(q_ref, k_ref, v_ref, g_ref, beta_ref, gate_ref, heads):
  """Per head of the block: its raw float32 `tpu_chunk.Head` and `Gate`."""
  K = q_ref.shape[1] // heads
  V = v_ref.shape[1] // heads
  betas = beta_ref[...]
  gates = gate_ref[...]
  f32 = lambda ref, i, n: ref[:, pl.ds(i * n, n)].astype(F32)
  return [(tc.Head(f32(q_ref, h, K), f32(k_ref, h, K), f32(v_ref, h, V),
                   f32(g_ref, h, K), tc.row_to_col(betas[h:h + 1, :])),
           tc.Gate(a=gates[0:1, h * K:(h + 1) * K],
                   bias=gates[1:2, h * K:(h + 1) * K]))
          for h in range(heads)]


def _split_rows(x, n):
  size = x.shape[0] // n
  return [x[i * size:(i + 1) * size] for i in range(n)]


def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, gate_ref,
                h0_ref, o_ref, fin_ref, *rest, heads, group, save, cfg):
  state = rest[-1]
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    state[...] = h0_ref[...]

  masks = tc.chunk_masks(seg_ref[...])
  prepared = [tc.prepare(raw, gate, masks.keep, cfg.prep)[0] for raw, gate in
              _heads(q_ref, k_ref, v_ref, g_ref, beta_ref, gate_ref, heads)]
  # Every head's state is read at once and written at once, so no head
  # waits on another's store.
  states = state[...]
  outs, nexts, ps = tc.chunk_forward(
      prepared, _split_rows(states, heads), masks, cfg.precision, group)
  V = v_ref.shape[1] // heads
  for h, o in enumerate(outs):
    o_ref[:, pl.ds(h * V, V)] = o.astype(o_ref.dtype)
  if save:
    rest[0][...] = states.astype(rest[0].dtype)
    rest[1][...] = jnp.concatenate(ps, axis=0).astype(rest[1].dtype)
  state[...] = jnp.concatenate(nexts, axis=0)

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    fin_ref[...] = state[...]


def _forward(cfg, q, k, v, g, beta, seg, gate, h0, save):
  """o [B,Tp,H*V] (q's dtype), final [B,H*K,V] and, with `save`, the
  per-chunk states [B,N,H*K,V] and inverses [B,N,H*C,C]."""
  B, Tp, HK = q.shape
  HV = v.shape[2]
  H = beta.shape[2]
  K, V, N = HK // H, HV // H, Tp // C
  heads = _divisor(H, cfg.heads)
  group = _divisor(heads, cfg.inverse_heads)
  sp = _specs(heads, group, K, V, N, reverse=False)
  out_specs = [sp["tok_v"], sp["head_kv"]]
  out_shape = [jax.ShapeDtypeStruct((B, Tp, HV), q.dtype),
               jax.ShapeDtypeStruct((B, HK, V), F32)]
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
      _fwd_kernel, heads=heads, group=group, save=save, cfg=cfg)
  return pl.pallas_call(
      kernel, grid=(B, H // heads, N),
      in_specs=[sp["tok_k"], sp["tok_k"], sp["tok_v"], sp["tok_k"],
                sp["beta"], sp["seg"], sp["gate"], sp["head_kv"]],
      out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((heads * K, V), F32)],
      compiler_params=_params(cfg), interpret=cfg.interpret,
      name="kda_tpu_forward",
  )(q, k, v, g, _beta_blocks(beta, heads), seg, gate, h0)


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, gate_ref,
                s_ref, p_ref, do_ref, dfin_ref, dq_ref, dk_ref, dv_ref, dg_ref,
                dbeta_ref, dgate_ref, dh0_ref, dstate, *, heads, group, cfg):
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    dstate[...] = dfin_ref[...]

  K = q_ref.shape[1] // heads
  V = v_ref.shape[1] // heads
  masks = tc.chunk_masks(seg_ref[...])
  raws = _heads(q_ref, k_ref, v_ref, g_ref, beta_ref, gate_ref, heads)
  prepared = [tc.prepare(raw, gate, masks.keep, cfg.prep)
              for raw, gate in raws]
  dos = do_ref[...].astype(F32)
  grads = tc.chunk_backward(
      [head for head, _ in prepared],
      _split_rows(s_ref[...].astype(F32), heads),
      _split_rows(p_ref[...].astype(F32), heads // group),
      _split_rows(dstate[...], heads),
      [dos[:, h * V:(h + 1) * V] for h in range(heads)],
      masks, cfg.precision, group)
  grads = [tc.prepare_backward(raw, saved, gr, gate, masks.keep, cfg.prep)
           for (raw, gate), (_, saved), gr in zip(raws, prepared, grads,
                                                  strict=True)]
  for h, gr in enumerate(grads):
    ks, vs = pl.ds(h * K, K), pl.ds(h * V, V)
    dq_ref[:, ks] = gr.dq.astype(dq_ref.dtype)
    dk_ref[:, ks] = gr.dk.astype(dk_ref.dtype)
    dv_ref[:, vs] = gr.dv.astype(dv_ref.dtype)
    dg_ref[:, ks] = gr.dg.astype(dg_ref.dtype)
  dbeta_ref[...] = jnp.concatenate([tc.col_to_row(gr.dbeta) for gr in grads],
                                   axis=0)
  zeros = jnp.zeros((6, K), F32)
  dgate_ref[...] = jnp.concatenate(
      [jnp.concatenate([gr.da, gr.dbias, zeros], axis=0) for gr in grads],
      axis=1)
  dstate[...] = jnp.concatenate([gr.dS for gr in grads], axis=0)

  @pl.when(n == pl.num_programs(2) - 1)
  def _():
    dh0_ref[...] = dstate[...]


def _backward(cfg, q, k, v, g, beta, seg, gate, s_in, p, do, dfin):
  """Gradients of every input; the gate rows' per chunk [B,N,8,H*K]."""
  B, Tp, HK = q.shape
  HV = v.shape[2]
  H = beta.shape[2]
  K, V, N = HK // H, HV // H, Tp // C
  heads = _divisor(H, cfg.bwd_heads)
  group = p.shape[3] // C
  if heads % group:
    heads = group * _divisor(H // group, max(1, heads // group))
  sp = _specs(heads, group, K, V, N, reverse=True)
  like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  shape = lambda *d: jax.ShapeDtypeStruct(d, F32)
  kernel = functools.partial(_bwd_kernel, heads=heads, group=group, cfg=cfg)
  dq, dk, dv, dg, dbeta, dgate, dh0 = pl.pallas_call(
      kernel, grid=(B, H // heads, N),
      in_specs=[sp["tok_k"], sp["tok_k"], sp["tok_v"], sp["tok_k"],
                sp["beta"], sp["seg"], sp["gate"], sp["chunk_kv"],
                sp["chunk_p"], sp["tok_v"], sp["head_kv"]],
      out_specs=[sp["tok_k"], sp["tok_k"], sp["tok_v"], sp["tok_k"],
                 sp["beta"], sp["chunk_gate"], sp["head_kv"]],
      out_shape=[like(q), like(k), like(v), like(g),
                 shape(B, H // heads, N, heads, C), shape(B, N, 8, HK),
                 shape(B, HK, V)],
      scratch_shapes=[pltpu.VMEM((heads * K, V), F32)],
      compiler_params=_params(cfg), interpret=cfg.interpret,
      name="kda_tpu_backward",
  )(q, k, v, g, _beta_blocks(beta, heads), seg, gate, s_in, p, do, dfin)
  return dq, dk, dv, dg, _beta_tokens(dbeta), jnp.sum(dgate, (0, 1)), dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _kernels(q, k, v, g, beta, gate, h0, seg, cfg):
  o, final = _forward(cfg, q, k, v, g, beta, seg, gate, h0, save=False)
  return o, final


def _kernels_fwd(q, k, v, g, beta, gate, h0, seg, cfg):
  o, final, s_in, p = _forward(cfg, q, k, v, g, beta, seg, gate, h0,
                               save=True)
  return (o, final), (q, k, v, g, beta, gate, seg, s_in, p)


def _kernels_bwd(cfg, res, cts):
  q, k, v, g, beta, gate, seg, s_in, p = res
  do, dfin = cts
  grads = _backward(cfg, q, k, v, g, beta, seg, gate, s_in, p, do, dfin)
  return grads + (jnp.zeros_like(seg),)


_kernels.defvjp(_kernels_fwd, _kernels_bwd)


def segment_rows(masks, Tp):
  """`common.Segments` -> [B, N, 8, C] float32 segment rows (`tpu_chunk.
  chunk_masks`): run index, first-segment, last-segment and non-padding
  flags."""
  B, T = masks.reset.shape
  run = segments.state_runs(masks.reset)
  run = jnp.pad(run, ((0, 0), (0, Tp - T)), mode="edge")
  run = run.reshape(B, Tp // C, C)
  prev = jnp.concatenate([jnp.zeros((B, 1), run.dtype), run[:, :-1, -1]],
                         axis=1)
  first = run == prev[..., None]
  last = run == run[..., -1:]
  keep = jnp.pad(~masks.pad, ((0, 0), (0, Tp - T))).reshape(B, Tp // C, C)
  zeros = jnp.zeros_like(run, F32)
  return jnp.stack([run.astype(F32), first.astype(F32), last.astype(F32),
                    keep.astype(F32)] + [zeros] * 4, axis=2)


def gate_rows(A_log, dt_bias, H, K, Kp):
  """[8, H*Kp] float32: row 0 exp(A_log) of each lane's head, row 1
  dt_bias (zero without one and on padded lanes), rows 2-7 zero."""
  a = jnp.broadcast_to(jnp.exp(A_log.astype(F32))[:, None], (H, K))
  bias = (jnp.zeros((H, K), F32) if dt_bias is None
          else dt_bias.astype(F32).reshape(H, K))
  rows = jnp.stack([a, bias], axis=0)
  rows = jnp.pad(rows, ((0, 6), (0, 0), (0, Kp - K)))
  return rows.reshape(8, H * Kp)


def _round_up(x, m):
  return -(-x // m) * m


def kda_tpu(q, k, v, g, beta, masks, h0, A_log, dt_bias, cfg):
  """Chunked KDA with the TPU kernels, from the raw inputs of `chunk_kda`.

  The kernels do what `common.canonicalize` does for the other
  implementations (q/k norm, the bounded gate, zeroing padding), so the
  inputs are read once, in their own dtype, and nothing is relaid out.

  Args:
    q, k, g: [B,T,H,K] (g the raw gate projection), any float dtype.
    v: [B,T,H,V].
    beta: [B,T,H].
    masks: `common.Segments`.
    h0: [B,H,K,V] float32.
    A_log: [H]; dt_bias: [H*K] or None (the bounded gate's parameters).
    cfg: `Config`.

  Returns:
    o [B,T,H,V] in q's dtype (exactly zero at padding) and the final state
    [B,H,K,V] float32.
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  Tp = _round_up(T, C)
  Kp, Vp = (K, V) if cfg.interpret else (_round_up(K, LANES),
                                         _round_up(V, LANES))

  def tokens(x, d, dp):  # [B,T,H,d] -> [B,Tp,H*dp]
    x = jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, dp - d)))
    return x.reshape(B, Tp, H * dp)

  h0 = jnp.pad(h0, ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
  o, final = _kernels(
      tokens(q, K, Kp), tokens(k, K, Kp), tokens(v, V, Vp), tokens(g, K, Kp),
      jnp.pad(beta.astype(F32), ((0, 0), (0, Tp - T), (0, 0))),
      gate_rows(A_log, dt_bias, H, K, Kp), h0.reshape(B, H * Kp, Vp),
      segment_rows(masks, Tp), cfg)
  o = o.reshape(B, Tp, H, Vp)[:, :T, :, :V]
  return o, final.reshape(B, H, Kp, Vp)[:, :, :K, :V]
