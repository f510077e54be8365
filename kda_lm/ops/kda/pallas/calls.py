"""pallas_call wrappers, the recurrence launcher and the `jax.custom_vjp`
that joins the forward and backward kernels; `kda_pallas` is the entry."""

import functools
import math
from typing import NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

from kda_lm import segments
from kda_lm.ops.kda.pallas import backward, forward, tpu, tpu_chunk
from kda_lm.ops.kda.pallas import helpers as hp
from kda_lm.ops.kda.pallas import options as options_lib


def unsupported_reason(K, V, chunk_size):
  """Why the Pallas path cannot run these shapes, or None if it can."""
  if K > hp.MAX_HEAD_DIM or V > hp.MAX_HEAD_DIM:
    return (f"the Pallas KDA kernel keeps the [K,V] state on chip and "
            f"supports K, V <= {hp.MAX_HEAD_DIM}; got K={K}, V={V}.")
  if chunk_size != hp.CHUNK:
    return (f"the Pallas KDA kernel uses chunk_size={hp.CHUNK}; got "
            f"chunk_size={chunk_size}.")
  return None


def _tok(x):
  """Chunk n's rows of a [B, H, Tp, x] array (grid (b, h, n))."""
  return pl.BlockSpec((None, None, hp.CHUNK, x), lambda b, h, n: (b, h, n, 0))


def _per_chunk(*block):
  """Chunk n's entry of a [B, H, N, *block] array (grid (b, h, n))."""
  return pl.BlockSpec((None, None, None) + block,
                      lambda b, h, n: (b, h, n) + (0,) * len(block))


_AQK = (hp.NB * hp.NB, hp.SUB, hp.SUB)   # Aqk's sub-blocks of one chunk


def _aqk_spec():
  return _per_chunk(*_AQK)


def _square():
  """Chunk n's [C, C] matrix (Akk, P and dAkk) of a [B, H, N, C, C] array."""
  return _per_chunk(hp.CHUNK, hp.CHUNK)


def _seg_tok():
  """Chunk n's rows of a [B, Tp, 1] array (shared by the heads)."""
  return pl.BlockSpec((None, hp.CHUNK, 1), lambda b, h, n: (b, n, 0))


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
                                   num_stages=options.num_stages)
  return None


def _per_platform(lower, options):
  """lower("interpret"), or lower("tpu") / lower("gpu") by the lowering platform
  (`lax.platform_dependent` lowers only the matching branch); the kernels
  are traced with `options.precision` for their dots."""
  with hp.dot_precision(options.precision):
    if options.interpret:
      return lower("interpret")
    return lax.platform_dependent(tpu=lambda: lower("tpu"),
                                  default=lambda: lower("gpu"))


def _call(kernel, args, in_specs, out_specs, out_shape, grid, options):
  """A chunk-parallel pallas_call: Mosaic on TPU, Triton on GPU."""
  def lower(platform):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=platform == "interpret",
        name=getattr(kernel, "func", kernel).__name__,
        compiler_params=_params(platform, options,
                                list(in_specs) + list(out_specs)))(*args)

  return _per_platform(lower, options)


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
  blocks = {"tok_k": ((hp.CHUNK, K), lambda n: (c(n), 0)),
            "tok_v": ((hp.CHUNK, V), lambda n: (c(n), 0)),
            "chunk_k": ((None, 1, K), lambda n: (c(n), 0, 0)),
            "chunk_kv": ((None, K, V), lambda n: (c(n), 0, 0)),
            "head_kv": ((K, V), lambda n: (0, 0))}
  block, index = blocks[kind]
  return pl.BlockSpec((None, None) + block,
                      lambda b, h, n: (b, h) + index(n))


def _recurrence(step, args, names, kinds, init, final, options, *, reverse):
  """Runs a recurrence step over all chunks: `hp.grid_kernel` on TPU (and in
  interpret mode with recurrence="grid"), else `hp.loop_kernel`
  over V blocks of `options.v_block` columns."""
  B, H, Tp, K = args[names.index("w")].shape
  V = args[names.index(init)].shape[-1]
  N = Tp // hp.CHUNK
  dims = (Tp, N, K)
  outs = [n for n in kinds if n not in names]
  shapes = {"tok_v": (B, H, Tp, V), "chunk_kv": (B, H, N, K, V),
            "head_kv": (B, H, K, V)}
  out_shape = [_shape(*shapes[kinds[n]]) for n in outs]
  all_names = tuple(names) + tuple(outs)

  def lower(platform):
    if platform == "tpu" or (platform == "interpret"
                             and options.recurrence == "grid"):
      ins = [_grid_spec(kinds[n], dims, V, reverse) for n in names]
      out_specs = [_grid_spec(kinds[n], dims, V, reverse) for n in outs]
      kernel = functools.partial(hp.grid_kernel, names=all_names, step=step,
                                 init=init, final=final, n_chunks=N)
      return pl.pallas_call(
          kernel, grid=(B, H, N), in_specs=ins, out_specs=out_specs,
          out_shape=out_shape, interpret=platform == "interpret",
          name=f"{step.__name__}_grid",
          scratch_shapes=[pltpu.VMEM((K, V), hp.F32)],
          compiler_params=_params(platform, options, ins + out_specs,
                                  ("parallel", "parallel", "arbitrary")),
      )(*args)
    bv = min(options.v_block, V)
    ins = [_loop_spec(kinds[n], dims, bv) for n in names]
    out_specs = [_loop_spec(kinds[n], dims, bv) for n in outs]
    kernel = functools.partial(hp.loop_kernel, names=all_names, kinds=kinds,
                               step=step, init=init, final=final,
                               n_chunks=N, reverse=reverse)
    return pl.pallas_call(
        kernel, grid=(B, H, V // bv), in_specs=ins, out_specs=out_specs,
        out_shape=out_shape, interpret=platform == "interpret",
        name=f"{step.__name__}_loop",
        compiler_params=_params(platform, options, ins + out_specs))(*args)

  return _per_platform(lower, options)


class _Config(NamedTuple):
  scale: float
  options: options_lib.KernelOptions


def _shape(*dims):
  return jax.ShapeDtypeStruct(dims, hp.F32)


def _forward(cfg, q, k, v, g, beta, h0, run, reset):
  """The three forward kernels. Returns o, final and the residuals."""
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  N = Tp // hp.CHUNK
  opts = cfg.options
  tok_in = [_tok(K), _tok(K), _tok(V), _tok(K), _tok(1), _seg_tok(),
            _seg_tok()]
  tk, tv, pair = _shape(B, H, Tp, K), _shape(B, H, Tp, V), _shape(
      B, H, N, *_AQK)
  square = _shape(B, H, N, hp.CHUNK, hp.CHUNK)
  w, u, qf, ke, kf, dv, aqk, akk, P = _call(
      functools.partial(forward.intra_kernel, scale=cfg.scale),
      (q, k, v, g, beta, run, reset), tok_in,
      [_tok(K), _tok(V), _tok(K), _tok(K), _tok(K), _per_chunk(1, K),
       _aqk_spec(), _square(), _square()],
      [tk, tv, tk, tk, tk, _shape(B, H, N, 1, K), pair, square, square],
      (B, H, N), opts)
  vn, s_in, final = _recurrence(
      forward.recur_step, (w, u, ke, dv, h0), ("w", "u", "ke", "dv", "h0"),
      {"w": "tok_k", "u": "tok_v", "ke": "tok_k", "dv": "chunk_k",
       "h0": "head_kv", "vn": "tok_v", "s_in": "chunk_kv",
       "fin": "head_kv"}, "h0", "fin", opts, reverse=False)
  o, = _call(forward.out_kernel, (qf, s_in, aqk, vn),
             [_tok(K), _per_chunk(K, V), _aqk_spec(), _tok(V)], [_tok(V)],
             [_shape(B, H, Tp, V)], (B, H, N), opts)
  return o, final, (w, ke, qf, kf, dv, aqk, akk, P, s_in, vn)


def _backward(cfg, q, k, v, g, beta, run, reset, saved, do, dfin):
  """The five backward kernels: dq, dk, dv, dg, dbeta, dh0."""
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  N = Tp // hp.CHUNK
  opts = cfg.options
  w, ke, qf, kf, dv, aqk, akk, P, s_in, vn = saved
  tk, tv = _shape(B, H, Tp, K), _shape(B, H, Tp, V)
  square = _shape(B, H, N, hp.CHUNK, hp.CHUNK)
  ado, qdo = _call(
      backward.out_bwd_kernel, (qf, aqk, do),
      [_tok(K), _aqk_spec(), _tok(V)], [_tok(V), _per_chunk(K, V)],
      [tv, _shape(B, H, N, K, V)], (B, H, N), opts)
  dsa, dvn, dh0 = _recurrence(
      backward.recur_bwd_step, (ado, qdo, w, ke, dv, dfin),
      ("ado", "qdo", "w", "ke", "dv", "dfin"),
      {"ado": "tok_v", "qdo": "chunk_kv", "w": "tok_k", "ke": "tok_k",
       "dv": "chunk_k", "dfin": "head_kv", "dsa": "chunk_kv",
       "dvn": "tok_v", "dh0": "head_kv"}, "dfin", "dh0", opts, reverse=True)
  dqf, dke, dw, ddv, daqk = _call(
      backward.state_bwd_kernel, (do, vn, dvn, s_in, dsa, run),
      [_tok(V), _tok(V), _tok(V), _per_chunk(K, V), _per_chunk(K, V),
       _seg_tok()],
      [_tok(K), _tok(K), _tok(K), _per_chunk(1, K), _square()],
      [tk, tk, tk, _shape(B, H, N, 1, K), square], (B, H, N), opts)
  dvv, dx, dakk, dbeta = _call(
      backward.wy_bwd_kernel, (kf, v, beta, run, P, akk, dvn, dw),
      [_tok(K), _tok(V), _tok(1), _seg_tok(), _square(), _square(),
       _tok(V), _tok(K)],
      [_tok(V), _tok(K), _square(), _tok(1)],
      [tv, tk, square, _shape(B, H, Tp, 1)], (B, H, N), opts)
  dq, dk, dg = _chunk_bwd_call(
      cfg, (q, k, v, g, beta, run, reset, daqk, dqf, dke, dx, dakk, ddv))
  return dq, dk, dvv, dg, dbeta, dh0


def _chunk_bwd_call(cfg, args):
  """`backward.chunk_bwd_kernel` on grid (b, h, n, K block): its results
  are column-wise in K, so each program takes `options.k_block` columns of
  q, k, g and their gradients (TPU: all of K)."""
  q, v = args[0], args[2]
  B, H, Tp, K = q.shape
  V = v.shape[-1]
  N = Tp // hp.CHUNK
  C = hp.CHUNK
  opts = cfg.options

  def lower(platform):
    bk = K if platform == "tpu" else min(opts.k_block, K)
    tok = lambda x: pl.BlockSpec((None, None, C, x),
                                 lambda b, h, n, j: (b, h, n, 0))
    tok_k = pl.BlockSpec((None, None, C, bk), lambda b, h, n, j: (b, h, n, j))
    seg = pl.BlockSpec((None, C, 1), lambda b, h, n, j: (b, n, 0))
    square = pl.BlockSpec((None, None, None, C, C),
                          lambda b, h, n, j: (b, h, n, 0, 0))
    ddv = pl.BlockSpec((None, None, None, 1, bk),
                       lambda b, h, n, j: (b, h, n, 0, j))
    in_specs = [tok_k, tok_k, tok(V), tok_k, tok(1), seg, seg, square,
                tok_k, tok_k, tok_k, square, ddv]
    out_specs = [tok_k] * 3
    return pl.pallas_call(
        functools.partial(backward.chunk_bwd_kernel, scale=cfg.scale),
        grid=(B, H, N, K // bk), in_specs=in_specs, out_specs=out_specs,
        out_shape=[_shape(B, H, Tp, K)] * 3,
        interpret=platform == "interpret", name="chunk_bwd_kernel",
        compiler_params=_params(platform, opts, in_specs + out_specs,
                                ("parallel",) * 4))(*args)

  return _per_platform(lower, opts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _kda_kernels(q, k, v, g, beta, h0, run, reset, cfg):
  o, final, _ = _forward(cfg, q, k, v, g, beta, h0, run, reset)
  return o, final


def _kda_kernels_fwd(q, k, v, g, beta, h0, run, reset, cfg):
  o, final, saved = _forward(cfg, q, k, v, g, beta, h0, run, reset)
  return (o, final), (q, k, v, g, beta, run, reset, saved)


def _kda_kernels_bwd(cfg, res, cts):
  q, k, v, g, beta, run, reset, saved = res
  do, dfin = cts
  grads = _backward(cfg, q, k, v, g, beta, run, reset, saved, do, dfin)
  return grads + (jnp.zeros_like(run), jnp.zeros_like(reset))


_kda_kernels.defvjp(_kda_kernels_fwd, _kda_kernels_bwd)


def _pow2(n):
  return max(16, 1 << (n - 1).bit_length())


def kda_pallas(q, k, v, g, beta, masks, h0, scale, *, options=None):
  """Chunked KDA over canonical inputs with the generic Pallas kernels.

  (The "tpu" family takes the raw inputs instead: `kda_tpu`.)

  Args:
    q, k, g: [B,T,H,K] float32, zero at padding (see `common`).
    v: [B,T,H,V] float32.
    beta: [B,T,H] float32.
    masks: `common.Segments`.
    h0: [B,H,K,V] float32.
    scale: float multiplying q.
    options: `KernelOptions`; None means `options.default_options()`.

  Returns:
    o [B,T,H,V] float32 (zero at padding) and the final state [B,H,K,V].
  """
  options = _checked(q.shape[-1], v.shape[-1], options)
  return _generic(q, k, v, g, beta, masks, h0, scale, options.generic())


def _checked(K, V, options):
  """The options to run with (None: the platform's); raises
  NotImplementedError for shapes the kernels do not support."""
  reason = unsupported_reason(K, V, hp.CHUNK)
  if reason:
    raise NotImplementedError(reason)
  return options_lib.default_options() if options is None else options


def uses_tpu_family(options, lower_bound):
  """Whether `chunk_kda(impl="pallas")` runs the "tpu" family: its options
  ask for it and the gate is the bounded one (`lower_bound` set)."""
  if options is None:
    options = options_lib.default_options()
  return options.family == "tpu" and lower_bound is not None


def kda_tpu(q, k, v, g, beta, masks, h0, A_log, dt_bias, *, scale,
            lower_bound, l2norm, options=None):
  """Chunked KDA with the "tpu" family from the raw inputs of `chunk_kda`
  (in-kernel bounded gate; the q/k norm when `l2norm`); see `tpu.kda_tpu`.

  Returns:
    o [B,T,H,V] in q's dtype (zero at padding), final state [B,H,K,V].
  """
  options = _checked(q.shape[-1], v.shape[-1], options)
  cfg = tpu.Config(
      prep=tpu_chunk.Prep(scale=float(scale), lower_bound=float(lower_bound),
                           l2norm=bool(l2norm)),
      heads=options.heads_per_program,
      bwd_heads=options.bwd_heads_per_program,
      inverse_heads=options.inverse_heads,
      precision=options.tpu_precisions(),
      vmem_bytes=options.vmem_limit_mib << 20, interpret=options.interpret)
  return tpu.kda_tpu(q, k, v, g, beta, masks, h0, A_log, dt_bias, cfg)


def _generic(q, k, v, g, beta, masks, h0, scale, options):
  """The generic kernels (Triton on GPU, Mosaic on TPU, or interpreted)."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  Tp = -(-T // hp.CHUNK) * hp.CHUNK
  Kp, Vp = _pow2(K), _pow2(V)

  def head_major(x, d, dp):  # [B,T,H,d] -> [B,H,Tp,dp]
    x = jnp.transpose(x, (0, 2, 1, 3))
    return jnp.pad(x, ((0, 0), (0, 0), (0, Tp - T), (0, dp - d)))

  run = segments.state_runs(masks.reset)
  run = jnp.pad(run, ((0, 0), (0, Tp - T)), mode="edge")
  reset = jnp.pad(masks.reset, ((0, 0), (0, Tp - T)))
  h0 = jnp.pad(h0.astype(hp.F32), ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
  o, final = _kda_kernels(
      head_major(q, K, Kp), head_major(k, K, Kp), head_major(v, V, Vp),
      head_major(g, K, Kp), head_major(beta[..., None], 1, 1), h0,
      run.astype(hp.F32)[..., None], reset.astype(hp.F32)[..., None],
      _Config(scale=float(scale), options=options))
  o = jnp.transpose(o[:, :, :T, :V], (0, 2, 1, 3))
  o = jnp.where(masks.pad[:, :, None, None], 0.0, o)
  return o, final[:, :, :K, :V]
