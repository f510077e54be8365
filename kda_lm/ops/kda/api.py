"""`chunk_kda`: the public KDA op, its input checks and implementation dispatch.

This module is the one place that chooses between KDA implementations.
Everything here before `_kda_core` runs in Python on shapes and dtypes, so bad
input raises a `ValueError` before anything is traced.
"""

import functools
import logging

import jax
from jax.interpreters import ad
import jax.numpy as jnp
import numpy as np

from kda_lm import segments
from kda_lm.ops.kda import common, pallas, reference, xla

IMPLS = ("auto", "reference", "xla", "pallas")
PALLAS_BACKENDS = ("tpu", "gpu")


def resolve_impl(impl, bounded=True):
  """Maps `impl` to a concrete implementation name.

  `"auto"` picks the fastest path measured for JAX's default backend
  (docs/kernels.md): on GPU the Pallas kernels; on TPU the Pallas TPU
  kernels for bounded gates (`lower_bound` set: 1.5-2.6x faster than
  "xla" forward+backward on a v5e) and "xla" for unbounded ones (the
  generic kernels that serve them there are 3-5x slower than "xla"); on
  CPU the chunked XLA path.

  Args:
    impl: one of `IMPLS`.
    bounded: the gates are bounded below (`lower_bound` is set).

  Raises:
    ValueError: unknown `impl`.
  """
  if impl not in IMPLS:
    raise ValueError(f"Unknown KDA impl {impl!r}; expected one of {IMPLS}.")
  if impl == "auto":
    backend = jax.default_backend()
    if backend == "tpu" and not bounded:
      return "xla"
    return "pallas" if backend in PALLAS_BACKENDS else "xla"
  return impl


def default_chunk_size(impl):
  """The chunk size `chunk_size=None` resolves to for a concrete `impl`.

  The Pallas kernels take 64. The XLA path takes 32 on CPU (measured fastest
  for forward+backward there: fewer FLOPs per token and smaller pairwise
  tensors outweigh twice the sequential state steps) and 64 elsewhere.
  """
  if impl == "xla" and jax.default_backend() == "cpu":
    return 32
  return 64


def _check_pallas(requested, impl, K, V, chunk_size):
  """Falls back from "pallas" to "xla" (auto) or raises for unsupported shapes.

  Raises:
    NotImplementedError: `impl="pallas"` was asked for explicitly and the
      kernels do not support these shapes.
  """
  if impl != "pallas":
    return impl
  reason = pallas.unsupported_reason(K, V, chunk_size)
  if reason is None:
    return impl
  if requested == "pallas":
    raise NotImplementedError(f"impl='pallas': {reason}")
  logging.warning("KDA impl='auto': %s Falling back to impl='xla'.", reason)
  return "xla"


def _concrete(x):
  """Returns `x` as numpy if it is concrete, else None (a tracer)."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError,
          jax.errors.ConcretizationTypeError):
    return None


def _check_float(name, x):
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be a floating array, got dtype {x.dtype}.")


def _validate(q, k, v, g, beta, *, scale, initial_state, segment_ids,
              cu_seqlens, A_log, dt_bias, use_gate_in_kernel, lower_bound,
              chunk_size, safe_gate):
  """Checks every argument of `chunk_kda`.

  Returns:
    ((B, T, H, K, V, N), segment_ids as int32 or None).
  """
  if safe_gate and (not use_gate_in_kernel or lower_bound is None):
    raise ValueError("safe_gate=True needs the bounded gate: "
                     "use_gate_in_kernel=True and lower_bound in [-5, 0).")
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    if not hasattr(x, "shape"):
      raise ValueError(f"{name} must be an array, got {type(x).__name__}.")
    _check_float(name, x)
  if q.ndim != 4:
    raise ValueError(f"q must be [B,T,H,K], got shape {q.shape}.")
  B, T, H, K = q.shape
  if k.shape != q.shape:
    raise ValueError(f"k shape {k.shape} != q shape {q.shape}.")
  if g.shape != q.shape:
    raise ValueError(f"g shape {g.shape} != q shape {q.shape} ([B,T,H,K]).")
  if v.ndim != 4 or v.shape[:3] != (B, T, H):
    raise ValueError(f"v must be [B,T,H,V] = [{B},{T},{H},V], got {v.shape}.")
  V = v.shape[3]
  if beta.shape != (B, T, H):
    raise ValueError(f"beta must be [B,T,H] = {(B, T, H)}, got {beta.shape}.")
  if T < 1:
    raise ValueError(f"T must be >= 1 (q is [B,T,H,K] = {q.shape}): there "
                     "is no token to attend over.")
  if min(B, H, K, V) < 1:
    raise ValueError(f"Empty dimension in q {q.shape} / v {v.shape}.")
  if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
    raise ValueError(f"scale must be a positive Python float, got {scale!r}.")
  if chunk_size is not None and (
      not isinstance(chunk_size, int) or chunk_size < 1 or (
          chunk_size > common.SUB_BLOCK and chunk_size % common.SUB_BLOCK)):
    raise ValueError(f"chunk_size must be None or a positive int that is <= "
                     f"{common.SUB_BLOCK} or a multiple of it, got "
                     f"{chunk_size!r}.")

  if segment_ids is not None and cu_seqlens is not None:
    raise ValueError("Pass segment_ids or cu_seqlens, not both.")
  N = B
  segment_ids = segments.check(segment_ids, (B, T))
  if cu_seqlens is not None:
    cu = _concrete(cu_seqlens)
    if cu is None:
      raise ValueError("cu_seqlens must be concrete (numpy or a committed jax "
                       "array), not traced; use segment_ids under jit.")
    if B != 1:
      raise ValueError(f"cu_seqlens requires B == 1, got B = {B}.")
    if (cu.ndim != 1 or cu.size < 2 or not np.issubdtype(cu.dtype, np.integer)
        or cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu) < 0)):
      raise ValueError(f"cu_seqlens must be a non-decreasing int vector [N+1] "
                       f"from 0 to T={T}; got {cu.tolist()}.")
    N = cu.size - 1
  if initial_state is not None:
    if initial_state.shape != (N, H, K, V):
      raise ValueError(f"initial_state must be [N,H,K,V] = {(N, H, K, V)} "
                       f"(N = B, or documents with cu_seqlens); got "
                       f"{initial_state.shape}.")
    _check_float("initial_state", initial_state)

  _check_gate_args(g, A_log, dt_bias, lower_bound, use_gate_in_kernel, H, K)
  return (B, T, H, K, V, N), segment_ids


def _check_gate_args(g, A_log, dt_bias, lower_bound, use_gate_in_kernel, H,
                     K):
  """The in-kernel gate's parameters, or a pre-activated log-decay `g`."""
  if use_gate_in_kernel:
    if A_log is None:
      raise ValueError("use_gate_in_kernel=True requires A_log [H].")
    if A_log.shape != (H,):
      raise ValueError(f"A_log must be [H] = {(H,)}, got {A_log.shape}.")
    if dt_bias is not None and dt_bias.shape != (H * K,):
      raise ValueError(f"dt_bias must be [H*K] = {(H * K,)}, got "
                       f"{dt_bias.shape}.")
    if lower_bound is not None:
      common.check_lower_bound(lower_bound)
    return
  for name, x in (("A_log", A_log), ("dt_bias", dt_bias),
                  ("lower_bound", lower_bound)):
    if x is not None:
      raise ValueError(f"{name} is only used with use_gate_in_kernel=True.")
  _check_log_decay(g)


def _check_log_decay(g):
  """A concrete pre-activated gate must be a log-decay (g <= 0)."""
  gate = _concrete(g)
  if gate is None or not gate.size:
    return
  gate = gate.astype(np.float32)
  worst = np.nanargmax(np.where(np.isnan(gate), -np.inf, gate))
  if gate.flat[worst] > 0:
    raise ValueError(
        f"g must be a log-decay <= 0 (use_gate_in_kernel=False), but "
        f"g{[int(i) for i in np.unravel_index(worst, gate.shape)]} = "
        f"{gate.flat[worst]:.4g} > 0: the state would grow without bound "
        "and the output overflow to inf/NaN. Apply a gate such as "
        "-softplus(x) or log(sigmoid(x)) first, or pass the raw gate with "
        "use_gate_in_kernel=True.")


@functools.partial(
    jax.jit,
    static_argnames=("scale", "lower_bound", "use_gate_in_kernel",
                     "use_qk_l2norm_in_kernel", "safe_gate", "impl",
                     "chunk_size", "pallas_options"))
def _kda_core(q, k, v, g, beta, segment_ids, initial_state, A_log, dt_bias, *,
              scale, lower_bound, use_gate_in_kernel, use_qk_l2norm_in_kernel,
              safe_gate, impl, chunk_size, pallas_options=None):
  """Canonicalises and runs one implementation. Returns f32 (o, state)."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  if segment_ids is None:
    segment_ids = jnp.ones((B, T), jnp.int32)
  masks = common.segments_from_ids(segment_ids)
  if initial_state is None:
    h0 = jnp.zeros((B, H, K, V), jnp.float32)
  else:
    h0 = initial_state.astype(jnp.float32)
  if impl == "pallas" and pallas.uses_tpu_family(pallas_options, lower_bound):
    # The TPU kernels prepare the raw inputs themselves.
    o, state = pallas.kda_tpu(
        q, k, v, g, beta, masks, h0, A_log, dt_bias, scale=scale,
        lower_bound=lower_bound, l2norm=use_qk_l2norm_in_kernel,
        options=pallas_options)
    return o.astype(jnp.float32), state
  q, k, v, g, beta = common.canonicalize(
      q, k, v, g, beta, masks, A_log=A_log, dt_bias=dt_bias,
      lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
  if impl == "reference":
    return reference.kda_recurrent(q, k, v, g, beta, masks, h0, scale)
  if impl == "pallas":
    return pallas.kda_pallas(q, k, v, g, beta, masks, h0, scale,
                             options=pallas_options)
  return xla.kda_chunked(q, k, v, g, beta, masks, h0, scale,
                         chunk_size=chunk_size, safe_gate=safe_gate)


@functools.partial(jax.jit, static_argnames=("core_kwargs",))
def _kda_varlen(q, k, v, g, beta, initial_state, A_log, dt_bias, doc_idx,
                doc_valid, tok_doc, tok_off, *, core_kwargs):
  """cu_seqlens path: gathers documents into rows [N,L], runs, scatters back.

  The index arrays are arguments (never closed-over constants).
  """
  take = lambda x: x[0][doc_idx]  # [1,T,...] -> [N,L,...]
  o, state = _kda_core(
      take(q), take(k), take(v), take(g), take(beta),
      doc_valid.astype(jnp.int32), initial_state, A_log, dt_bias,
      **dict(core_kwargs))
  return o[tok_doc, tok_off][None], state


def _varlen_indices(cu_seqlens, N, T):
  """Gather/scatter indices of the cu_seqlens path (L = longest document).

  Returns:
    doc_idx [N,L] int32 (token of each document slot), doc_valid [N,L] bool,
    tok_doc [T] int32 (each token's document), tok_off [T] int32 (its slot).
  """
  cu = np.asarray(cu_seqlens).astype(np.int64)
  lens = np.diff(cu)
  L = max(int(lens.max()), 1)
  offs = np.arange(L)[None, :]
  doc_valid = offs < lens[:, None]
  doc_idx = np.where(doc_valid, cu[:-1, None] + offs, 0)
  tok_doc = np.repeat(np.arange(N), lens)
  tok_off = np.arange(T) - cu[tok_doc]
  return (doc_idx.astype(np.int32), doc_valid, tok_doc.astype(np.int32),
          tok_off.astype(np.int32))


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None,
              output_final_state=False, segment_ids=None, cu_seqlens=None,
              A_log=None, dt_bias=None, use_gate_in_kernel=False,
              safe_gate=False, lower_bound=None,
              use_qk_l2norm_in_kernel=False, chunk_size=None, impl="auto",
              pallas_options=None):
  """Kimi Delta Attention over packed rows, with exact document resets.

  Per head, for each token t: `S = S * exp(g_t)[:, None]`;
  `S += beta_t k_t (v_t - k_t^T S)^T`; `o_t = scale * q_t^T S`.

  Args:
    q: [B,T,H,K] queries.
    k: [B,T,H,K] keys.
    v: [B,T,H,V] values (V may differ from K).
    g: [B,T,H,K] log decay (<= 0), or the raw gate projection when
      `use_gate_in_kernel`.
    beta: [B,T,H] write strengths in [0, 1].
    scale: query scale; defaults to K**-0.5.
    initial_state: [B,H,K,V] (or [N,H,K,V] with `cu_seqlens`) state entering
      each row's first segment (each document with `cu_seqlens`).
    output_final_state: also return the final state(s).
    segment_ids: [B,T] int, 1-based document ids, 0 = padding; the
      state resets wherever the id changes. Padding gives zero output, changes
      no state and receives zero gradients. None = one segment per row.
    cu_seqlens: FLA's varlen form, concrete int [N+1] from 0 to T, B = 1;
      states are then per document, [N,H,K,V].
    A_log: [H] float32 gate parameter (with `use_gate_in_kernel`).
    dt_bias: [H*K] float32 gate bias (with `use_gate_in_kernel`; optional).
    use_gate_in_kernel: compute `g = -exp(A_log) * softplus(g + dt_bias)`, or
      with `lower_bound`, `g = lower_bound * sigmoid(exp(A_log) (g + dt_bias))`.
    safe_gate: the gates are bounded (needs `lower_bound`), so every decay
      factorises: all matmuls, no pairwise decay tensor. Same results.
    lower_bound: float in [-5, 0) selecting the bounded gate form.
    use_qk_l2norm_in_kernel: L2-normalise q and k (`x / sqrt(sum x^2 + 1e-6)`).
    chunk_size: chunk length C of the chunked paths; None = the fastest for
      the implementation and backend.
    impl: "auto", "reference" (token-by-token oracle), "xla" (chunked) or
      "pallas" (fused kernels; K, V <= 256, chunk_size 64; interpret mode
      per `pallas_options`). "auto": the fastest measured (`resolve_impl`;
      unsupported shapes fall back to "xla" with a warning).
    pallas_options: `pallas.KernelOptions` for impl "pallas" (warps, stages,
      V block, dot precision, interpret mode); None =
      `pallas.default_options()`.

  Returns:
    `(o [B,T,H,V] in q's dtype, final_state)`: the float32 state after each
    row's last non-padding token [B,H,K,V] ([N,H,K,V] with cu_seqlens), or
    None unless `output_final_state`.

  Raises:
    ValueError: any malformed argument, before tracing, and a concrete
      pre-activated gate with an entry > 0 (a traced `g` cannot be checked:
      positive entries make the state, and the output, overflow).
    NotImplementedError: impl="pallas" with shapes it does not support.
    TypeError: forward-mode autodiff (jax.jvp) of impl="xla" or "pallas"
      (custom VJPs); use impl="reference".
  """
  requested = impl
  impl = resolve_impl(impl, bounded=lower_bound is not None)
  (_, _, _, K, V, _), segment_ids = _validate(
      q, k, v, g, beta, scale=scale, initial_state=initial_state,
      segment_ids=segment_ids, cu_seqlens=cu_seqlens, A_log=A_log,
      dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel,
      lower_bound=lower_bound, chunk_size=chunk_size, safe_gate=safe_gate)
  impl, chunk_size, pallas_options = _run_settings(
      requested, impl, K, V, chunk_size, pallas_options)
  core_kwargs = dict(
      scale=float(K ** -0.5 if scale is None else scale),
      lower_bound=None if lower_bound is None else float(lower_bound),
      use_gate_in_kernel=bool(use_gate_in_kernel),
      use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
      safe_gate=bool(safe_gate), impl=impl, chunk_size=chunk_size,
      pallas_options=pallas_options if impl == "pallas" else None)
  if impl != "reference":
    _check_reverse_mode(impl, (q, k, v, g, beta, initial_state, A_log,
                               dt_bias))
  o, state = _run(q, k, v, g, beta, initial_state, segment_ids, cu_seqlens,
                  A_log, dt_bias, core_kwargs)
  return o.astype(q.dtype), (state if output_final_state else None)


def _run_settings(requested, impl, K, V, chunk_size, pallas_options):
  """The implementation, chunk size and kernel options a call runs with.

  `chunk_size=None` takes `default_chunk_size` of the implementation that
  finally runs (after any fallback from "pallas" to "xla"); impl "pallas"
  without options takes `pallas.default_options()`.
  """
  chosen = chunk_size is None
  if chosen:
    chunk_size = default_chunk_size(impl)
  impl = _check_pallas(requested, impl, K, V, chunk_size)
  if chosen:
    chunk_size = default_chunk_size(impl)
  if impl == "pallas" and pallas_options is None:
    pallas_options = pallas.default_options()
  if pallas_options is not None and not isinstance(pallas_options,
                                                   pallas.KernelOptions):
    raise ValueError(f"pallas_options must be a pallas.KernelOptions, got "
                     f"{type(pallas_options).__name__}.")
  return impl, chunk_size, pallas_options


def _forward_mode(x):
  """True if `x` is traced by forward-mode autodiff (jvp, also inside
  another autodiff tracer, as in jax.hessian).

  Only with JAX's direct linearization (the default), where reverse mode
  never makes a `JVPTracer`; otherwise JAX's own error reports forward mode.
  """
  if not jax.config.jax_use_direct_linearize:
    return False
  while isinstance(x, jax.core.Tracer):
    if isinstance(x, ad.JVPTracer):
      return True
    x = getattr(x, "primal", None)
  return False


def _check_reverse_mode(impl, args):
  """The chunked paths have hand-derived custom VJPs: reverse mode only.

  Raises:
    TypeError: an argument is traced by forward-mode autodiff.
  """
  if any(_forward_mode(x) for x in args):
    raise TypeError(
        f"chunk_kda(impl={impl!r}) supports reverse-mode autodiff only "
        "(jax.grad, jax.vjp): its backward is a hand-derived custom VJP. "
        "Forward mode (jax.jvp, jax.jacfwd, jax.hessian) needs "
        "impl='reference'.")


def _run(q, k, v, g, beta, initial_state, segment_ids, cu_seqlens, A_log,
         dt_bias, core_kwargs):
  """Runs `_kda_core` on rows, or on documents gathered from cu_seqlens."""
  if cu_seqlens is None:
    return _kda_core(q, k, v, g, beta, segment_ids, initial_state, A_log,
                     dt_bias, **core_kwargs)
  return _kda_varlen(
      q, k, v, g, beta, initial_state, A_log, dt_bias,
      *_varlen_indices(cu_seqlens, np.asarray(cu_seqlens).size - 1,
                       q.shape[1]),
      core_kwargs=tuple(sorted(core_kwargs.items())))
