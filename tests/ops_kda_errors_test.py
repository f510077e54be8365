"""Tests of the KDA op's input checks, options and autodiff modes."""

import jax
import kda_support
import numpy as np
import pytest

from kda_lm.ops import chunk_kda
from kda_lm.ops.kda import api

# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

IMPLS_UNDER_TEST = kda_support.KDA_IMPLS_UNDER_TEST
TOKEN_FIELDS = kda_support.KDA_TOKEN_FIELDS
PACKED_STATIC = kda_support.KDA_PACKED_STATIC
_Report = kda_support.ErrorReport
assert_same = kda_support.assert_same
fwd_and_grads = kda_support.kda_fwd_and_grads
packed_layout = kda_support.kda_packed_layout
packed_inputs = kda_support.kda_packed_inputs


# ----------------------------------------------------------------------------
# Options and autodiff modes.


def test_default_chunk_size_per_backend():
  """chunk_size=None runs the implementation's default chunk size."""
  assert api.default_chunk_size("pallas") == 64
  want = 32 if jax.default_backend() == "cpu" else 64
  assert api.default_chunk_size("xla") == want
  params, do, dht = packed_inputs(0)
  seg = packed_layout(0)
  o, s, _ = fwd_and_grads("xla", params, do, dht, segment_ids=seg,
                          **PACKED_STATIC)
  o2, s2, _ = fwd_and_grads("xla", params, do, dht, segment_ids=seg,
                            chunk_size=want, **PACKED_STATIC)
  assert_same(o2, o, "o")
  assert_same(s2, s, "final_state")


def test_forward_mode_reference_and_clear_error():
  """jax.jvp works with the reference (its tangents are checked against a
  finite difference) and raises a clear TypeError with the chunked path,
  whose backward is a hand-derived custom VJP (reverse mode only)."""
  seg = packed_layout(1)
  params, _, _ = packed_inputs(1)
  rng = np.random.default_rng(7)
  tangents = {n: rng.standard_normal(x.shape).astype(np.float32)
              for n, x in params.items()}

  def run(which, p, t):
    f = lambda p: chunk_kda(**p, segment_ids=seg, output_final_state=True,
                            impl=which, **PACKED_STATIC)
    return jax.jit(lambda p, t: jax.jvp(f, (p,), (t,)))(p, t)

  (o, s), (do, ds) = run("reference", params, tangents)
  eps = 1e-3
  shift = lambda sign: {n: (x.astype(np.float64) + sign * eps * tangents[n]
                            ).astype(np.float32) for n, x in params.items()}
  (o_p, s_p), _ = run("reference", shift(1), tangents)
  (o_m, s_m), _ = run("reference", shift(-1), tangents)
  rep = _Report("jvp [reference vs central difference]")
  rep.check("tangent of o", do, (o_p - o_m) / (2 * eps), 1e-2)
  rep.check("tangent of final_state", ds, (s_p - s_m) / (2 * eps), 1e-2)
  rep.done()
  for impl in IMPLS_UNDER_TEST:
    with pytest.raises(TypeError, match=r"reverse-mode autodiff only.*"
                       r"impl='reference'"):
      run(impl, params, tangents)


# ----------------------------------------------------------------------------
# Bad input: ValueError with a useful message, before anything is traced.

_EVENTS = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _EVENTS.append(event))


def _bad(changes):
  """Valid small arguments (B=2, T=8, H=2, K=4, V=6) with `changes`."""
  rng = np.random.default_rng(0)
  f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
  kw = dict(q=f32(2, 8, 2, 4), k=f32(2, 8, 2, 4), v=f32(2, 8, 2, 6),
            g=-np.abs(f32(2, 8, 2, 4)), beta=np.full((2, 8, 2), 0.5,
                                                    np.float32))
  one = lambda: {n: kw[n][:1] for n in TOKEN_FIELDS}  # B=1 for cu_seqlens
  kw.update(changes(kw, one, f32) if callable(changes) else changes)
  return kw


GATE = dict(use_gate_in_kernel=True, A_log=np.zeros(2, np.float32))
BAD_INPUTS = {
    "q_not_4d": (lambda kw, one, f: dict(q=kw["q"][0]), r"q must be"),
    "k_shape": (lambda kw, one, f: dict(k=kw["k"][:, :7]), r"k shape"),
    "g_shape": (lambda kw, one, f: dict(g=kw["g"][..., :3]), r"g shape"),
    "v_shape": (lambda kw, one, f: dict(v=kw["v"][:, :7]), r"v must be"),
    "beta_shape": (lambda kw, one, f: dict(beta=kw["beta"][..., None]),
                   r"beta must be"),
    "integer_q": (lambda kw, one, f: dict(q=kw["q"].astype(np.int32)),
                  r"q must be a floating"),
    "initial_state_shape": (lambda kw, one, f: dict(
        initial_state=f(2, 2, 6, 4)), r"initial_state must be"),
    "float_segment_ids": (lambda kw, one, f: dict(
        segment_ids=np.ones((2, 8), np.float32)), r"segment_ids.*integer"),
    "bool_segment_ids": (lambda kw, one, f: dict(
        segment_ids=np.ones((2, 8), bool)), r"segment_ids.*integer"),
    "segment_ids_shape": (lambda kw, one, f: dict(
        segment_ids=np.ones((2, 9), np.int32)), r"segment_ids must be"),
    "segment_ids_1d": (lambda kw, one, f: dict(
        segment_ids=np.ones((8,), np.int32)), r"segment_ids must be"),
    "negative_segment_ids": (lambda kw, one, f: dict(
        segment_ids=np.array([[1] * 7 + [-1]] * 2, np.int32)),
                             r"segment_ids must be >= 0"),
    "segment_ids_with_cu_seqlens": (lambda kw, one, f: dict(
        one(), segment_ids=np.ones((1, 8), np.int32),
        cu_seqlens=np.array([0, 8], np.int32)), r"not both"),
    "gate_without_A_log": (dict(use_gate_in_kernel=True),
                           r"use_gate_in_kernel=True requires A_log"),
    "A_log_shape": (dict(GATE, A_log=np.zeros(3, np.float32)),
                    r"A_log must be \[H\]"),
    "dt_bias_shape": (dict(GATE, dt_bias=np.zeros(4, np.float32)),
                      r"dt_bias must be \[H\*K\]"),
    "A_log_without_gate": (dict(A_log=np.zeros(2, np.float32)),
                           r"A_log is only used with use_gate_in_kernel"),
    "lower_bound_zero": (dict(GATE, lower_bound=0.0), r"lower_bound"),
    "lower_bound_below_-5": (dict(GATE, lower_bound=-5.5), r"lower_bound"),
    "lower_bound_positive": (dict(GATE, lower_bound=1.0), r"lower_bound"),
    "unknown_impl": (dict(impl="no_such_impl"), r"Unknown KDA impl"),
    "cu_seqlens_not_from_0": (lambda kw, one, f: dict(
        one(), cu_seqlens=np.array([1, 4, 8], np.int32)), r"cu_seqlens"),
    "cu_seqlens_not_to_T": (lambda kw, one, f: dict(
        one(), cu_seqlens=np.array([0, 4, 7], np.int32)), r"cu_seqlens"),
    "cu_seqlens_decreasing": (lambda kw, one, f: dict(
        one(), cu_seqlens=np.array([0, 5, 3, 8], np.int32)), r"cu_seqlens"),
    "cu_seqlens_float": (lambda kw, one, f: dict(
        one(), cu_seqlens=np.array([0.0, 4.0, 8.0], np.float32)),
                         r"cu_seqlens"),
    "cu_seqlens_2d": (lambda kw, one, f: dict(
        one(), cu_seqlens=np.array([[0, 4, 8]], np.int32)), r"cu_seqlens"),
    "cu_seqlens_with_B2": (lambda kw, one, f: dict(
        cu_seqlens=np.array([0, 4, 8], np.int32)), r"B == 1"),
    "cu_seqlens_initial_state_N": (lambda kw, one, f: dict(
        one(), cu_seqlens=np.array([0, 4, 8], np.int32),
        initial_state=f(1, 2, 4, 6)), r"initial_state must be"),
    "chunk_size_zero": (dict(chunk_size=0), r"chunk_size"),
    "chunk_size_negative": (dict(chunk_size=-64), r"chunk_size"),
    "chunk_size_float": (dict(chunk_size=64.0), r"chunk_size"),
    "chunk_size_not_multiple": (dict(chunk_size=100), r"chunk_size"),
    "safe_gate_without_lower_bound": (dict(GATE, safe_gate=True),
                                      r"safe_gate"),
    "safe_gate_without_gate_in_kernel": (dict(safe_gate=True), r"safe_gate"),
    "negative_scale": (dict(scale=-1.0), r"scale"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_before_tracing(name):
  changes, match = BAD_INPUTS[name]
  kw = _bad(changes)
  del _EVENTS[:]
  with pytest.raises(ValueError, match=match):
    chunk_kda(**kw)
  assert not _EVENTS, f"traced/compiled before raising: {set(_EVENTS)}"
  # The same call made while tracing a caller's jit raises the same error.
  with pytest.raises(ValueError, match=match):
    jax.jit(lambda: chunk_kda(**kw))()


def test_trace_listener_sees_compiles():
  """Guards the check above: the listener does see a fresh trace."""
  del _EVENTS[:]
  jax.jit(lambda x: x * 3 + 1)(np.zeros((3, 5, 7), np.float32))
  assert _EVENTS


# ----------------------------------------------------------------------------
# Degenerate inputs get clear errors.


def test_empty_time_axis_and_positive_gate_raise():
  rng = np.random.default_rng(0)

  def inputs(t, gate_sign):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    return dict(q=f(1, t, 1, 8), k=f(1, t, 1, 8), v=f(1, t, 1, 8),
                g=gate_sign * np.abs(f(1, t, 1, 8)),
                beta=np.full((1, t, 1), 0.5, np.float32))

  with pytest.raises(ValueError, match="T must be >= 1"):
    chunk_kda(**inputs(0, -1.0))
  bad = inputs(5, -1.0)
  bad["g"][0, 3, 0, 2] = 0.25
  with pytest.raises(ValueError, match=r"g\[0, 3, 0, 2\] = 0.25 > 0"):
    chunk_kda(**bad)
