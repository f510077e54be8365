"""Tests of the Pallas KDA kernels (`chunk_kda(..., impl="pallas")`).

On CPU the kernels run in interpret mode. Plain `interpret=True` fills every
kernel output buffer with NaN before the kernel runs (checked by
`test_interpret_mode_fills_unwritten_outputs_with_nan`), so a read of an
unwritten buffer shows up as NaN in outputs or gradients: padding gradients
are required to be exactly 0 and finite with that fill on.

Error metric: `kda_lm.testing.rel_err(a, b) = ||a - b||_2 / ||b||_2` in
float64 (as in tests/kda_op_test.py). Float32 tolerances: 1e-5 forward,
1e-4 gradients.

The cross-lowering tests set KDA_LM_PALLAS_INTERPRET=0 and lower the forward
and the gradient for TPU (Mosaic: `tpu_custom_call`) and CUDA (Triton:
`__gpu$xla.gpu.triton`) at K=V=128, T=8192, H=16, bfloat16 inputs, from
abstract shapes (nothing is allocated).

Compile budget: interpret-mode kernels are compile-bound, so the module runs
with `jax_disable_most_optimizations` (restored afterwards) and reuses one
jitted forward+gradient function per static configuration.
"""

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_lm import testing
from kda_lm.ops import chunk_kda
from kda_lm.ops.kda import api, pallas

H, K, V = 2, 32, 16
FIELDS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
TOKEN_FIELDS = ("q", "k", "v", "g", "beta")
FWD_TOL, GRAD_TOL = 1e-5, 1e-4


# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


rel_err = testing.rel_err


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


def fwd_and_grads(impl, params, segment_ids, do, dht, *, fresh=False,
                  **static):
  """(o, state, grads) as numpy; `fresh` traces anew instead of reusing the
  cached function (kernel settings from the environment are read when
  tracing)."""
  make = _grad_fn.__wrapped__ if fresh else _grad_fn
  grads, (o, s) = make(impl, tuple(sorted(static.items())))(
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
  params, seg, (o, s, grads), _ = packed_results()
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


def test_v_blocks_match_reference(monkeypatch):
  """KDA_LM_PALLAS_V_BLOCK splits the state's V columns over the recurrence
  kernels' programs (grid axis j on GPU, and in interpret mode). V=48 pads to
  64: 4 blocks of 16. The columns of S are independent, so every output and
  gradient is bit-identical to one block."""
  params, static, do, dht = make_inputs(3, 2, PACKED_T, v=48)
  seg = PACKED_IDS
  whole = fwd_and_grads("pallas", params, seg, do, dht, **static)
  monkeypatch.setenv(pallas.V_BLOCK_ENV, "16")
  split = fwd_and_grads("pallas", params, seg, do, dht, fresh=True,
                        **static)
  _compare(params, split, fwd_and_grads("reference", params, seg, do, dht,
                                        **static))
  for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(whole),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  monkeypatch.setenv(pallas.V_BLOCK_ENV, "48")
  with pytest.raises(ValueError, match="power of two"):
    pallas.read_options()


def test_tpu_style_recurrence_matches_reference(monkeypatch):
  """KDA_LM_PALLAS_RECURRENCE=grid runs the recurrences as on TPU in
  interpret mode: one chunk per step of an "arbitrary" grid axis, the state
  in a scratch buffer (written at the first step, read back at the last).
  Packed segments; padding gradients exactly 0 and finite with the NaN fill
  on; results as the GPU-style loop's (which tests/kda_op_test.py and the
  rest of this file check)."""
  params, seg, loop, want = packed_results()
  _, static, do, dht = make_inputs(0, 2, PACKED_T)
  monkeypatch.setenv(pallas.RECURRENCE_ENV, "grid")
  grid = fwd_and_grads("pallas", params, seg, do, dht, fresh=True,
                       **static)
  _compare(params, grid, want)
  _compare(params, grid, loop, fwd_tol=1e-6, grad_tol=1e-6)
  pad = seg == 0
  for n in TOKEN_FIELDS:
    assert np.isfinite(grid[2][n]).all() and np.all(grid[2][n][pad] == 0), n
  monkeypatch.setenv(pallas.RECURRENCE_ENV, "scan")
  with pytest.raises(ValueError, match="KDA_LM_PALLAS_RECURRENCE"):
    pallas.read_options()


def test_vmap_over_rows_equals_batch():
  """RFC-0026's per-row vmap of a B=1 call == one call with B rows, bit for
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



# The FLA golden fixture runs for impl="pallas" in kda_op_test.py.


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


def test_interpret_switch(monkeypatch):
  monkeypatch.delenv(pallas.INTERPRET_ENV, raising=False)
  assert pallas.interpret_mode() == (jax.default_backend() == "cpu")
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert not pallas.interpret_mode()
  monkeypatch.setenv(pallas.INTERPRET_ENV, "0")
  assert not pallas.interpret_mode()
  monkeypatch.setenv(pallas.INTERPRET_ENV, "1")
  assert pallas.interpret_mode()
  monkeypatch.setenv(pallas.INTERPRET_ENV, "yes")
  with pytest.raises(ValueError):
    pallas.interpret_mode()


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


def _model_call(params, seg):
  return chunk_kda(**params, segment_ids=seg, output_final_state=True,
                   use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                   impl="pallas")


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_cross_lowering(platform, mode, monkeypatch):
  monkeypatch.setenv(pallas.INTERPRET_ENV, "0")
  params, seg = _abstract_args()
  if mode == "forward":
    fn = _model_call
  else:
    def fn(p, s):
      o, state = _model_call(p, s)
      return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)
    fn = jax.grad(fn)
  text = jax.jit(fn).trace(params, seg).lower(
      lowering_platforms=(platform,)).as_text()
  # Forward: intra-chunk, recurrence, output kernels. Gradient: intra and
  # recurrence (the output kernel's o is not needed by jax.grad, so it is
  # dropped) plus the three backward kernels.
  want = 3 if mode == "forward" else 5
  assert text.count(TARGETS[platform]) == want, text.count(TARGETS[platform])
  other = TARGETS["cuda" if platform == "tpu" else "tpu"]
  assert other not in text
  if platform == "cuda":
    # Chunk-parallel kernels: grid (B, H, T / 64); the recurrence kernels:
    # (B, H, V / 64), the default V blocks.
    grids = re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, "
                       r"grid_z = (\d+)", text)
    recur = 1 if mode == "forward" else 2
    assert sorted(grids) == sorted([("1", "16", "128")] * (want - recur)
                                   + [("1", "16", "2")] * recur), grids


def test_precision_switch_reaches_the_kernels(monkeypatch):
  """KDA_LM_PALLAS_PRECISION=default changes the compiled Triton kernels
  (TF32 dots on GPU); HIGHEST (IEEE float32) is the default."""
  monkeypatch.setenv(pallas.INTERPRET_ENV, "0")
  params, seg = _abstract_args()
  texts = {}
  for precision in ("highest", "default"):
    monkeypatch.setenv(pallas.PRECISION_ENV, precision)
    fn = lambda p, s: _model_call(p, s)  # a fresh trace: env read there
    texts[precision] = jax.jit(fn).trace(params, seg).lower(
        lowering_platforms=("cuda",)).as_text()
    assert texts[precision].count(TARGETS["cuda"]) == 3
  assert texts["highest"] != texts["default"]
  monkeypatch.delenv(pallas.PRECISION_ENV)
  assert pallas.read_options().precision == "highest"
  monkeypatch.setenv(pallas.PRECISION_ENV, "tf32")
  with pytest.raises(ValueError, match="KDA_LM_PALLAS_PRECISION"):
    pallas.read_options()
