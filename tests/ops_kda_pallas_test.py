"""Tests of the Pallas KDA kernels (`chunk_kda(..., impl="pallas")`).

On CPU the kernels run in interpret mode. Plain `interpret=True` fills every
kernel output buffer with NaN before the kernel runs (checked by
`test_interpret_mode_fills_unwritten_outputs_with_nan`), so a read of an
unwritten buffer shows up as NaN in outputs or gradients: padding gradients
are required to be exactly 0 and finite with that fill on.

Error metric: `testbed.numerics.rel_err(a, b) = ||a - b||_2 / ||b||_2`
in float64 (as in tests/ops_kda_reference_test.py). Float32 tolerances: 1e-5
forward, 1e-4 gradients.

The cross-lowering tests pass non-interpret options and lower the forward
and the gradient for TPU (Mosaic: `tpu_custom_call`) and CUDA (Triton:
`__gpu$xla.gpu.triton`) at K=V=128, T=8192, H=16, bfloat16 inputs, from
abstract shapes (nothing is allocated).

Compile budget: interpret-mode kernels are compile-bound, so the module runs
with `jax_disable_most_optimizations` (restored afterwards) and reuses one
jitted forward+gradient function per static configuration.
"""

import dataclasses
import functools
import logging
import re

import helpers
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from kda_lm.ops import chunk_kda
from kda_lm.ops.kda import api, pallas
from kda_lm.ops.kda.pallas import options
from testbed import kda_cases, numerics

H, K, V = 2, 32, 16
FIELDS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
TOKEN_FIELDS = ("q", "k", "v", "g", "beta")
FWD_TOL, GRAD_TOL = 1e-5, 1e-4
BF16_FWD_TOL, BF16_GRAD_TOL = 5e-3, 8e-3   # precision="bf16" (GPU default)
CPU = pallas.for_platform("cpu")   # interpret mode, IEEE float32 dots


# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


rel_err = numerics.rel_err


def _check(what, got, want, tol):
  err = rel_err(got, want)
  assert err <= tol, f"{what}: rel_err {err:.2e} > {tol:.0e}"
  return err


@functools.lru_cache(maxsize=None)
def _grad_fn(impl, static):
  """jit(grad) of sum(o * do) + sum(state * dht), aux (o, state)."""
  kw = dict(static)

  def loss(params, segment_ids, do, dht):
    o, s = chunk_kda(**params, segment_ids=segment_ids,
                     output_final_state=True, impl=impl, **kw)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * dht), (o, s)

  return jax.jit(jax.grad(loss, has_aux=True))


def fwd_and_grads(impl, params, segment_ids, do, dht, **static):
  """(o, state, grads) as numpy."""
  grads, (o, s) = _grad_fn(impl, tuple(sorted(static.items())))(
      params, segment_ids, do, dht)
  return jax.tree.map(np.asarray, (o, s, grads))


def runs_to_ids(runs):
  """[(id, length), ...] -> int32 segment-id row."""
  return np.concatenate([np.full(n, i, np.int32) for i, n in runs])


# Row 0: leading padding, 1-token documents at t=3, t=63 (a chunk's last row)
# and t=64 (a chunk's first row), a document crossing t=128, mid-row padding,
# an id reused after padding (two segments), trailing padding. Row 1: one
# document over the whole row. T=200 is not a multiple of 64.
PACKED_IDS = np.stack([
    runs_to_ids([(0, 3), (1, 1), (2, 59), (3, 1), (4, 1), (5, 6), (0, 4),
                 (6, 1), (7, 60), (0, 3), (7, 7), (8, 1), (0, 1), (9, 50),
                 (0, 2)]),
    np.full(200, 11, np.int32),
])
PACKED_T = PACKED_IDS.shape[1]


def make_inputs(seed, b, t, *, k=K, v=V, h=H, gate="softplus"):
  """float32 params (FLA's test distributions) and cotangents."""
  rng = np.random.default_rng(seed)
  randn = lambda *s: rng.standard_normal(s).astype(np.float32)
  params = dict(q=randn(b, t, h, k), k=randn(b, t, h, k), v=randn(b, t, h, v),
                g=randn(b, t, h, k),
                beta=1 / (1 + np.exp(-randn(b, t, h))),
                initial_state=randn(b, h, k, v))
  if gate == "softplus":
    params["A_log"] = np.log(rng.uniform(1, 16, h))
    params["dt_bias"] = randn(h * k)
    static = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
  elif gate == "safe":
    params["A_log"] = rng.uniform(-1, 1, h)
    params["dt_bias"] = randn(h * k)
    static = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                  lower_bound=-5.0, safe_gate=True)
  else:  # pre-activated log-sigmoid gates, k normalised outside
    params["g"] = -np.logaddexp(0.0, -params["g"])
    params["k"] /= np.sqrt(np.sum(params["k"] ** 2, -1, keepdims=True) + 1e-6)
    static = {}
  params = {n: np.asarray(x, np.float32) for n, x in params.items()}
  return params, static, randn(b, t, h, v), randn(b, h, k, v)


@functools.lru_cache(maxsize=None)
def packed_results():
  params, static, do, dht = make_inputs(0, 2, PACKED_T)
  seg = PACKED_IDS
  return (params, seg,
          fwd_and_grads("pallas", params, seg, do, dht, **static),
          fwd_and_grads("reference", params, seg, do, dht, **static))


def _compare(params, got, want, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL):
  (o, s, grads), (o_ref, s_ref, g_ref) = got, want
  errs = {"o": _check("o", o, o_ref, fwd_tol),
          "state": _check("final_state", s, s_ref, fwd_tol)}
  for n in FIELDS:
    if n in params:
      errs["d" + n] = _check("d" + n, grads[n], g_ref[n], grad_tol)
  print(" ".join(f"{n}={e:.1e}" for n, e in errs.items()))


def test_packed_segments_match_reference():
  params, _, got, want = packed_results()
  _compare(params, got, want)


def test_padding_outputs_and_gradients_exactly_zero_and_finite():
  params, seg, got, _ = packed_results()
  check_padding(params, seg, got)


def check_padding(params, seg, got):
  """Outputs, states and gradients finite; padding outputs and padding
  tokens' gradients exactly 0."""
  o, s, grads = got
  pad = seg == 0
  assert pad.any()
  assert np.isfinite(o).all() and np.isfinite(s).all()
  assert np.all(o[pad] == 0.0)
  for n in FIELDS:
    if n in params:
      assert np.isfinite(grads[n]).all(), n
  for n in TOKEN_FIELDS:
    assert np.all(grads[n][pad] == 0.0), n


@pytest.mark.parametrize("gate", ["pre", "safe"])
def test_head_dim_64_matches_reference(gate):
  """K=V=64, B=1, H=1, two chunks, no segment_ids (and the safe gate)."""
  params, static, do, dht = make_inputs(1, 1, 128, k=64, v=64, h=1,
                                        gate=gate)
  _compare(params, fwd_and_grads("pallas", params, None, do, dht, **static),
           fwd_and_grads("reference", params, None, do, dht, **static))


def test_v_and_k_blocks_match_reference(monkeypatch):
  """KernelOptions.v_block splits the state's V columns over the recurrence
  kernels' programs (grid axis j on GPU, and in interpret mode), k_block the
  K columns of the backward's per-chunk gradient kernel. V=48 pads to 64:
  4 blocks of 16 against the CPU default's one; K=32: one block of 32
  against the CPU default's two of 16. Those columns are independent, so
  every output and gradient is bit-identical."""
  params, static, do, dht = make_inputs(3, 2, PACKED_T, v=48)
  seg = PACKED_IDS
  assert (CPU.v_block, CPU.k_block) == (64, 16)
  whole = fwd_and_grads("pallas", params, seg, do, dht, **static)
  split = fwd_and_grads(
      "pallas", params, seg, do, dht, **static,
      pallas_options=dataclasses.replace(CPU, v_block=16, k_block=32))
  _compare(params, split, fwd_and_grads("reference", params, seg, do, dht,
                                        **static))
  for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(whole),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="power of two"):
    dataclasses.replace(CPU, v_block=48)
  with pytest.raises(ValueError, match="kda_kernel.*power of two"):
    options.KernelSettings(v_block=48)


def test_tpu_style_recurrence_matches_reference():
  """recurrence="grid" runs the recurrences as on TPU in
  interpret mode: one chunk per step of an "arbitrary" grid axis, the state
  in a scratch buffer (written at the first step, read back at the last).
  Packed segments; padding gradients exactly 0 and finite with the NaN fill
  on; results as the GPU-style loop's (which
  tests/ops_kda_reference_test.py and the rest of this file check)."""
  params, seg, loop, want = packed_results()
  _, static, do, dht = make_inputs(0, 2, PACKED_T)
  grid_options = options.KernelSettings(recurrence="grid").options()
  assert grid_options == dataclasses.replace(CPU, recurrence="grid")
  grid = fwd_and_grads("pallas", params, seg, do, dht,
                       pallas_options=grid_options, **static)
  _compare(params, grid, want)
  _compare(params, grid, loop, fwd_tol=1e-6, grad_tol=1e-6)
  pad = seg == 0
  for n in TOKEN_FIELDS:
    assert np.isfinite(grid[2][n]).all() and np.all(grid[2][n][pad] == 0), n
  with pytest.raises(ValueError, match="recurrence"):
    options.KernelSettings(recurrence="scan")


def test_vmap_over_rows_equals_batch():
  """The per-row vmap of a B=1 call == one call with B rows, bit for
  bit. Pre-activated gates: XLA's CPU code for the in-kernel gate / l2norm
  (outside the Pallas kernel, shared with impl="xla") may round differently
  for [1,T,...] and [2,T,...] shapes (~1 ulp)."""
  params, static, _, _ = make_inputs(0, 2, PACKED_T, gate="pre")
  params = {n: x for n, x in params.items() if n != "initial_state"}
  call = functools.partial(chunk_kda, output_final_state=True, impl="pallas",
                           **static)
  o_b, s_b = jax.jit(lambda p, seg: call(**p, segment_ids=seg))(
      params, PACKED_IDS)
  row_keys = TOKEN_FIELDS

  def one_row(row, seg):
    p = {n: (row[n][None] if n in row_keys else params[n]) for n in params}
    o, s = call(**p, segment_ids=seg[None])
    return o[0], s[0]

  o_v, s_v = jax.jit(jax.vmap(one_row))(
      {n: params[n] for n in row_keys}, PACKED_IDS)
  np.testing.assert_array_equal(np.asarray(o_v), np.asarray(o_b))
  np.testing.assert_array_equal(np.asarray(s_v), np.asarray(s_b))


# ----------------------------------------------------------------------------
# FLA golden fixture (see tests/testdata/README.md).



# The FLA golden fixture runs for impl="pallas" in ops_kda_golden_test.py.


# ----------------------------------------------------------------------------
# Dispatch, unsupported shapes, interpret switch.


def _small(k, v, t=16):
  rng = np.random.default_rng(0)
  randn = lambda *s: rng.standard_normal(s).astype(np.float32)
  return dict(q=randn(1, t, 1, k), k=randn(1, t, 1, k), v=randn(1, t, 1, v),
              g=-np.abs(randn(1, t, 1, k)), beta=np.full((1, t, 1), 0.5,
                                                         np.float32))


def test_unsupported_shape_raises_before_tracing(monkeypatch):
  def boom(*a, **kw):
    raise AssertionError("traced")
  monkeypatch.setattr(pallas, "kda_pallas", boom)
  with pytest.raises(NotImplementedError, match="K, V <= 256"):
    chunk_kda(**_small(512, 16), impl="pallas")
  with pytest.raises(NotImplementedError, match="chunk_size"):
    chunk_kda(**_small(32, 16), impl="pallas", chunk_size=32)


def test_auto_picks_pallas_on_accelerators_and_falls_back(monkeypatch,
                                                          caplog):
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert api.resolve_impl("auto") == "xla"
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert api.resolve_impl("auto") == "pallas"
  assert api._check_pallas("auto", "pallas", 32, 16, 64) == "pallas"
  with caplog.at_level(logging.WARNING):
    assert api._check_pallas("auto", "pallas", 512, 16, 64) == "xla"
  assert "Falling back to impl='xla'" in caplog.text
  with pytest.raises(NotImplementedError):
    api._check_pallas("pallas", "pallas", 512, 16, 64)


def test_options_per_platform_and_settings(monkeypatch):
  """Defaults follow JAX's default backend; `KernelSettings` (the model
  config's `kda_kernel`) replace single fields over them; bad values
  raise. The environment is not read."""
  monkeypatch.setenv("KDA_LM_PALLAS_NUM_WARPS", "2")   # no effect
  assert pallas.default_options() == pallas.for_platform(
      options.backend_platform())
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert pallas.default_options() == pallas.for_platform("tpu")
  assert not pallas.default_options().interpret
  monkeypatch.setattr(jax, "default_backend", lambda: "cuda")
  gpu = pallas.default_options()
  assert gpu == pallas.for_platform("gpu") and not gpu.interpret
  assert hash(gpu) == hash(pallas.for_platform("gpu"))
  settings = options.KernelSettings(num_warps=2, precision="bf16")
  assert settings.options() == dataclasses.replace(
      gpu, num_warps=2, precision="bf16")
  assert options.KernelSettings().options() is None
  assert "interpret" not in {f.name for f in dataclasses.fields(
      options.KernelSettings)}
  with pytest.raises(ValueError, match="precision"):
    options.KernelSettings(precision="fp8")
  with pytest.raises(ValueError, match="num_warps"):
    pallas.KernelOptions(num_warps=3)
  with pytest.raises(ValueError, match="platform"):
    pallas.for_platform("cuda")
  with pytest.raises(ValueError, match="KernelOptions"):
    chunk_kda(**_small(32, 16), impl="pallas", pallas_options={"x": 1})


def test_interpret_mode_fills_unwritten_outputs_with_nan():
  """The detector the padding test relies on is on with interpret=True."""
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[pl.ds(0, 8), :] = x_ref[pl.ds(0, 8), :]

  out = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
      interpret=True)(jnp.ones((16, 128), jnp.float32))
  assert np.all(np.asarray(out[:8]) == 1.0)
  assert np.all(np.isnan(np.asarray(out[8:])))


# ----------------------------------------------------------------------------
# Cross-lowering: compiled kernels for TPU and GPU from this host.

LOWER_B, LOWER_T, LOWER_H, LOWER_D = 1, 8192, 16, 128
TARGETS = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}


def _abstract_args():
  S = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  b, t, h, d = LOWER_B, LOWER_T, LOWER_H, LOWER_D
  params = dict(q=S((b, t, h, d), bf), k=S((b, t, h, d), bf),
                v=S((b, t, h, d), bf), g=S((b, t, h, d), bf),
                beta=S((b, t, h), bf), initial_state=S((b, h, d, d),
                                                        jnp.float32),
                A_log=S((h,), jnp.float32), dt_bias=S((h * d,), jnp.float32))
  return params, S((b, t), jnp.int32)


def _model_call(params, seg, opts):
  return chunk_kda(**params, segment_ids=seg, output_final_state=True,
                   use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                   impl="pallas", pallas_options=opts)


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_cross_lowering(platform, mode):
  params, seg = _abstract_args()
  opts = pallas.for_platform("tpu" if platform == "tpu" else "gpu")
  if mode == "forward":
    fn = functools.partial(_model_call, opts=opts)
  else:
    def fn(p, s):
      o, state = _model_call(p, s, opts)
      return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)
    fn = jax.grad(fn)
  text = jax.jit(fn).trace(params, seg).lower(
      lowering_platforms=(platform,)).as_text()
  # Forward: intra-chunk, recurrence, output kernels. Gradient: intra and
  # recurrence (the output kernel's o is not needed by jax.grad, so it is
  # dropped) plus the five backward kernels.
  want = 3 if mode == "forward" else 7
  assert text.count(TARGETS[platform]) == want, text.count(TARGETS[platform])
  other = TARGETS["cuda" if platform == "tpu" else "tpu"]
  assert other not in text
  if platform == "cuda":
    # Chunk-parallel kernels: grid (B, H, T / 64); the recurrence kernels:
    # (B, H, V / 64), the default V blocks; the backward's per-chunk
    # gradient kernel: (B * H, T / 64, K / k_block) (Triton's grid has
    # three axes: Pallas folds the leading ones).
    grids = re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, "
                       r"grid_z = (\d+)", text)
    recur = 1 if mode == "forward" else 2
    kblocks = [] if mode == "forward" else [
        ("16", "128", str(LOWER_D // opts.k_block))]
    assert sorted(grids) == sorted(
        [("1", "16", "128")] * (want - recur - len(kblocks))
        + [("1", "16", "2")] * recur + kblocks), grids


def test_precision_reaches_the_kernels():
  """KernelOptions.precision changes the lowered Triton kernels: IEEE
  float32, TF32 and bfloat16-operand dots differ."""
  params, seg = _abstract_args()
  texts = set()
  for precision in options.PRECISIONS:
    opts = dataclasses.replace(pallas.for_platform("gpu"),
                               precision=precision)
    text = jax.jit(functools.partial(_model_call, opts=opts)).trace(
        params, seg).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TARGETS["cuda"]) == 3
    texts.add(text)
  assert len(texts) == len(options.PRECISIONS)


def test_bf16_dots_within_fla_like_tolerances():
  """precision="bf16" (bfloat16 dot operands, float32 accumulation: FLA's
  Triton dots for bfloat16 inputs), rounded as on a GPU in interpret mode,
  on the packed rows, against the float32 reference. Measured rel_err:
  o 2.7e-3, final state 2.3e-3, dq 2.5e-3, dk 2.6e-3, dv 2.8e-3, dg 4.1e-3,
  dbeta 3.0e-3, dh0 2.1e-3, dA_log 1.2e-3, ddt_bias 3.8e-3 (bfloat16 has an
  8-bit mantissa: 2^-9 = 2e-3 per rounding); FLA's bf16 tests allow ~5e-3.
  The gate cumsum stays IEEE float32 (an error there is amplified by exp)."""
  params, seg, _, want = packed_results()
  _, static, do, dht = make_inputs(0, 2, PACKED_T)
  got = fwd_and_grads("pallas", params, seg, do, dht, **static,
                      pallas_options=dataclasses.replace(
                          CPU, precision="bf16"))
  _compare(params, got, want, fwd_tol=BF16_FWD_TOL, grad_tol=BF16_GRAD_TOL)


# ----------------------------------------------------------------------------
# The TPU family (`pallas/tpu.py`), in interpret mode. On a TPU the same
# kernels run compiled in tests/ops_kda_tpu_test.py.

TPU_CPU = dataclasses.replace(CPU, family="tpu", heads_per_program=2,
                              bwd_heads_per_program=2, inverse_heads=2)


@functools.lru_cache(maxsize=None)
def bounded_results():
  params, static, do, dht = make_inputs(0, 2, PACKED_T, gate="safe")
  return (params, static, do, dht,
          fwd_and_grads("reference", params, PACKED_IDS, do, dht, **static))


@pytest.mark.parametrize("heads,inverse_heads", [(2, 2), (1, 1), (2, 1)])
def test_tpu_family_matches_reference(heads, inverse_heads):
  """Packed rows (1-token documents at chunk edges, padding at the start,
  middle and end, T not a multiple of 64), bounded gates, IEEE float32
  dots: outputs, states and every gradient against the reference; padding
  exactly 0 and finite (with interpret mode's NaN fill on). Heads per
  program and the heads sharing one block-diagonal inverse change nothing
  beyond float32 rounding."""
  params, static, do, dht, want = bounded_results()
  opts = dataclasses.replace(TPU_CPU, heads_per_program=heads,
                             bwd_heads_per_program=heads,
                             inverse_heads=inverse_heads)
  got = fwd_and_grads("pallas", params, PACKED_IDS, do, dht, **static,
                      pallas_options=opts)
  _compare(params, got, want)
  check_padding(params, PACKED_IDS, got)


def test_tpu_family_without_norm_or_bias_matches_reference():
  """The in-kernel preparation's other settings: no q/k norm (k normalised
  by the caller, q raw) and no dt_bias, against the reference."""
  params, static, do, dht = make_inputs(1, 2, PACKED_T, gate="safe")
  params = dict(params)
  del params["dt_bias"]
  k = params["k"]
  params["k"] = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
  static = dict(static, use_qk_l2norm_in_kernel=False)
  want = fwd_and_grads("reference", params, PACKED_IDS, do, dht, **static)
  got = fwd_and_grads("pallas", params, PACKED_IDS, do, dht, **static,
                      pallas_options=TPU_CPU)
  _compare(params, got, want)
  check_padding(params, PACKED_IDS, got)


def test_tpu_family_gates_at_the_floor_with_wide_heads():
  """Every gate within 1% of -5, K = V = 128 (the factorised decays at
  e^-80, balanced by `common.SAFE_BALANCE`): float32 dots against the
  float64 recurrence. Measured: o 2.0e-7, dq 2.1e-7, dg 2.5e-5, dA_log
  1.4e-4, dt_bias 1.7e-4 ("xla": dg 4.8e-6, dA_log 1.6e-5). The kernel
  forms exp(G_last - G) from two chunk cumsums near -320, whose float32
  spacing (3e-5) the gate gradients inherit, and dA_log and dt_bias sum
  them over every token with cancellation: 3e-4 for those two."""
  rng = np.random.default_rng(11)
  params, static = kda_cases.kda_inputs(rng, 1, 128, 2, 128, 128, gate="floor",
                                        l2norm=True)
  do, dht = kda_cases.kda_cotangents(rng, params["v"].shape, 1, 128)
  o_ref, s_ref, g_ref = kda_cases.kda_float64(params, do, dht, **static)
  o, s, grads = fwd_and_grads("pallas", params, None, do, dht, **static,
                              pallas_options=TPU_CPU)
  _check("o", o, o_ref, FWD_TOL)
  _check("state", s, s_ref, FWD_TOL)
  for n in FIELDS:
    _check("d" + n, grads[n], g_ref[n],
           3e-4 if n in ("A_log", "dt_bias") else GRAD_TOL)


def test_tpu_family_bfloat16_inputs_keep_their_dtype():
  """bfloat16 q, k, v, g: o and their gradients come out in bfloat16
  (written so by the kernels), near the float32 reference."""
  params, static, do, dht, want = bounded_results()
  bf = {n: (x.astype(jnp.bfloat16) if n in ("q", "k", "v", "g") else x)
        for n, x in params.items()}
  got = fwd_and_grads("pallas", bf, PACKED_IDS, do, dht, **static,
                      pallas_options=TPU_CPU)
  assert got[0].dtype == jnp.bfloat16
  for n in ("q", "k", "v", "g"):
    assert got[2][n].dtype == jnp.bfloat16, n
  _check("o", got[0].astype(np.float32), want[0], 1e-2)
  for n in FIELDS:
    _check("d" + n, got[2][n].astype(np.float32), want[2][n], 1e-2)


def test_tpu_family_prepares_the_raw_inputs_in_its_kernels():
  """The q/k norm and the gate run inside the kernels: outside them, the
  traced forward and gradient hold no rsqrt, logistic or exp over tokens,
  and the kernels read the raw [B,T,H*K] inputs in their own dtype."""
  params, static, _, _ = make_inputs(0, 1, 128, gate="safe")
  p = {n: jnp.asarray(x, jnp.bfloat16 if n in ("q", "k", "v", "g") else
                      jnp.float32) for n, x in params.items()}

  def fwd(p):
    o = chunk_kda(**p, impl="pallas", pallas_options=TPU_CPU, **static)[0]
    return jnp.sum(o.astype(jnp.float32))

  for fn in (fwd, jax.grad(fwd)):
    eqns = list(helpers.jaxpr_eqns(jax.make_jaxpr(fn)(p).jaxpr))
    outside = [e.primitive.name for e in eqns
               if e.primitive.name in ("rsqrt", "logistic", "exp")
               and max(v.aval.size for v in e.invars) > 1024]
    kernel_inputs = [[v.aval.dtype for v in e.invars[:4]] for e in eqns
                     if e.primitive.name == "pallas_call"]
    assert not outside, outside
    assert kernel_inputs and all(d == [jnp.bfloat16] * 4
                                 for d in kernel_inputs), kernel_inputs


def test_tpu_family_bf16_dots_within_tolerances():
  """The TPU default: bfloat16 chunk and state dots, the gate gradient's
  products at "bf16_3x" (with bfloat16 operands there dg alone reaches
  1.3e-2). Measured here: o 3.8e-3, state 3.1e-3, dq 2.7e-3, dk 3.6e-3,
  dv 2.9e-3, dg 2.1e-3, dbeta 3.1e-3, dh0 2.4e-3."""
  params, static, do, dht, want = bounded_results()
  opts = dataclasses.replace(TPU_CPU, precision="bf16")
  assert opts.tpu_precisions() == ("bf16", "bf16", "bf16_3x")
  got = fwd_and_grads("pallas", params, PACKED_IDS, do, dht, **static,
                      pallas_options=opts)
  _compare(params, got, want, fwd_tol=BF16_FWD_TOL, grad_tol=BF16_GRAD_TOL)


def test_tpu_family_changing_one_document_leaves_others_bit_identical():
  """Row 0's document 7 (60 + 7 tokens, split by padding, crossing t=128)
  gets new q, k, v, g: every other token's output and every gradient
  outside it are unchanged, bit for bit."""
  params, static, do, dht, _ = bounded_results()
  doc = PACKED_IDS == 7
  changed = dict(params)
  rng = np.random.default_rng(5)
  for n in ("q", "k", "v", "g"):
    x = params[n].copy()
    x[doc] = rng.standard_normal(x[doc].shape).astype(np.float32)
    changed[n] = x
  a = fwd_and_grads("pallas", params, PACKED_IDS, do, dht, **static,
                    pallas_options=TPU_CPU)
  b = fwd_and_grads("pallas", changed, PACKED_IDS, do, dht, **static,
                    pallas_options=TPU_CPU)
  assert not np.array_equal(a[0][doc], b[0][doc])
  np.testing.assert_array_equal(a[0][~doc], b[0][~doc])
  for n in TOKEN_FIELDS:
    np.testing.assert_array_equal(a[2][n][~doc], b[2][n][~doc])


def _kernel_names(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [eqn.params["name"] for eqn in helpers.jaxpr_eqns(jaxpr)
          if eqn.primitive.name == "pallas_call"]


def test_tpu_family_runs_two_kernels_and_falls_back_for_unbounded_gates():
  """Bounded gates: one forward kernel (without the saved states) and, for
  the gradient, one forward (saving them) and one backward. Unbounded
  gates take the generic kernels, whatever the family."""
  params, static, do, dht = make_inputs(0, 1, 128, gate="safe")
  p = {n: jnp.asarray(x) for n, x in params.items()}

  def fwd(p, static=static):
    return chunk_kda(**p, impl="pallas", pallas_options=TPU_CPU, **static)[0]

  grad = jax.grad(lambda p: jnp.sum(fwd(p)))
  assert _kernel_names(fwd, p) == ["kda_tpu_forward"]
  assert _kernel_names(grad, p) == ["kda_tpu_forward", "kda_tpu_backward"]
  soft, soft_static, _, _ = make_inputs(0, 1, 128, gate="softplus")
  names = _kernel_names(lambda p: fwd(p, soft_static),
                        {n: jnp.asarray(x) for n, x in soft.items()})
  assert names and not any(n.startswith("kda_tpu") for n in names), names


def test_tpu_family_options_and_auto(monkeypatch):
  tpu = pallas.for_platform("tpu")
  assert (tpu.family, tpu.precision, tpu.heads_per_program,
          tpu.bwd_heads_per_program, tpu.inverse_heads) == (
              "tpu", "bf16", 8, 8, 2)
  assert dataclasses.replace(tpu, precision="highest").tpu_precisions() == (
      "highest",) * 3
  assert dataclasses.replace(tpu, precision="bf16_3x").generic().precision \
      == "highest"
  with pytest.raises(ValueError, match="precision"):
    dataclasses.replace(CPU, precision="bf16_3x")        # generic family
  with pytest.raises(ValueError, match="family"):
    dataclasses.replace(CPU, family="mosaic")
  with pytest.raises(ValueError, match="inverse_heads"):
    dataclasses.replace(tpu, inverse_heads=0)
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert api.resolve_impl("auto", bounded=True) == "pallas"
  assert api.resolve_impl("auto", bounded=False) == "xla"
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert api.resolve_impl("auto", bounded=False) == "pallas"


@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_tpu_family_cross_lowering(mode):
  """The TPU family lowers for TPU with bounded gates at T=8192, H=16,
  K=V=128, bfloat16: one Mosaic kernel forward, two for the gradient."""
  params, seg = _abstract_args()
  opts = pallas.for_platform("tpu")

  def call(p, s):
    return chunk_kda(**p, segment_ids=s, output_final_state=True,
                     use_gate_in_kernel=True, lower_bound=-5.0,
                     safe_gate=True, use_qk_l2norm_in_kernel=True,
                     impl="pallas", pallas_options=opts)

  fn = call
  if mode == "backward":
    fn = jax.grad(lambda p, s: jnp.sum(call(p, s)[0].astype(jnp.float32)))
  text = jax.jit(fn).trace(params, seg).lower(
      lowering_platforms=("tpu",)).as_text()
  assert text.count(TARGETS["tpu"]) == (1 if mode == "forward" else 2)
