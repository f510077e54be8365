"""The TPU kernels of `chunk_kda(impl="pallas")`, compiled on a real TPU.

Skipped unless JAX's default backend is a TPU (CPU runs them in interpret
mode in tests/ops_kda_pallas_test.py). The token-by-token reference runs on
the host's CPU (on the chip, its 1000 sequential decays land 6.5e-6 from
the CPU result, measured).

Error metric: `numerics.rel_err` (L2 ratio, float64). Tolerances: float32
inputs with every kernel dot at HIGHEST, 1e-5 (outputs, final state) and
1e-4 (gradients); bfloat16 inputs with the default TPU options against the
float32 reference, 1e-2.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_lm.ops import chunk_kda
from kda_lm.ops.kda import pallas
from testbed import kda_cases, numerics

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "tpu", reason="needs a TPU")

FWD_TOL, GRAD_TOL, BF16_TOL = 1e-5, 1e-4, 1e-2
FIELDS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
TOKEN_FIELDS = ("q", "k", "v", "g", "beta")


def packed_ids(T):
  """Row 0: padding at the start, in the middle and at the end, documents
  of 1, 63, 64, 65 and 300 tokens; row 1: one document."""
  runs = [(0, 5), (1, 1), (2, 63), (3, 64), (0, 7), (4, 65), (5, 300),
          (0, 20)]
  row = np.concatenate([np.full(n, i, np.int32) for i, n in runs])
  row = np.concatenate([row, np.full(T - row.size, 6, np.int32)])
  return np.stack([row, np.full(T, 9, np.int32)])


@functools.lru_cache(maxsize=None)
def _grad_fn(impl, options, dtype):
  def loss(p, seg, do, dht):
    p = {n: x.astype(dtype) if n in TOKEN_FIELDS else x for n, x in p.items()}
    o, s = chunk_kda(**p, segment_ids=seg, output_final_state=True,
                     use_gate_in_kernel=True, lower_bound=-5.0,
                     safe_gate=True, use_qk_l2norm_in_kernel=True,
                     impl=impl, pallas_options=options)
    o = o.astype(jnp.float32)
    return jnp.sum(o * do) + jnp.sum(s * dht), (o, s)
  return jax.jit(jax.grad(loss, has_aux=True))


def run(impl, params, seg, do, dht, options=None, dtype=jnp.float32):
  """(o, final state, grads) as numpy; the reference on the host CPU."""
  device = jax.devices("cpu" if impl == "reference" else None)[0]
  with jax.default_matmul_precision("highest"), jax.default_device(device):
    grads, (o, s) = _grad_fn(impl, options, dtype)(params, seg, do, dht)
  return jax.tree.map(np.asarray, (o, s, grads))


def make(B, T, H, D, seed=0):
  rng = np.random.default_rng(seed)
  params, _ = kda_cases.kda_inputs(rng, B, T, H, D, D, gate="safe",
                                   l2norm=True)
  do, dht = kda_cases.kda_cotangents(rng, (B, T, H, D), B, D)
  return params, do, dht


def compare(got, want, fwd_tol, grad_tol):
  (o, s, g), (o_ref, s_ref, g_ref) = got, want
  errs = {"o": numerics.rel_err(o, o_ref), "state": numerics.rel_err(s, s_ref)}
  errs.update({"d" + n: numerics.rel_err(g[n], g_ref[n]) for n in FIELDS})
  print(" ".join(f"{n}={e:.1e}" for n, e in errs.items()))
  for n, e in errs.items():
    assert e <= (fwd_tol if n in ("o", "state") else grad_tol), (n, e)


HIGHEST = dataclasses.replace(pallas.for_platform("tpu"), precision="highest")


@functools.lru_cache(maxsize=None)
def packed_case(D):
  T = 1000
  params, do, dht = make(2, T, 4, D)
  seg = packed_ids(T)
  return params, seg, do, dht, run("reference", params, seg, do, dht)


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("heads", [4, 2])
def test_float32_highest_matches_reference(D, heads):
  params, seg, do, dht, want = packed_case(D)
  opts = dataclasses.replace(HIGHEST, heads_per_program=heads,
                             bwd_heads_per_program=heads)
  got = run("pallas", params, seg, do, dht, opts)
  compare(got, want, FWD_TOL, GRAD_TOL)
  o, _, grads = got
  pad = seg == 0
  assert np.all(o[pad] == 0.0)
  for n in FIELDS:
    assert np.isfinite(grads[n]).all(), n
  for n in TOKEN_FIELDS:
    assert np.all(grads[n][pad] == 0.0), n


def test_bfloat16_inputs_default_options_near_float32_reference():
  params, seg, do, dht, want = packed_case(128)
  got = run("pallas", params, seg, do, dht, None, jnp.bfloat16)
  compare(got, want, BF16_TOL, BF16_TOL)


def test_changing_one_document_leaves_the_others_bit_identical():
  """Row 0's document 4 (65 tokens across a chunk boundary) gets new
  inputs: every other token's output and gradients are unchanged, bit for
  bit, with the default (bfloat16-dot) options."""
  params, seg, do, dht, _ = packed_case(128)
  changed = dict(params)
  doc = seg == 4
  rng = np.random.default_rng(7)
  for n in ("q", "k", "v", "g"):
    x = params[n].copy()
    x[doc] = rng.standard_normal(x[doc].shape).astype(np.float32)
    changed[n] = x
  a = run("pallas", params, seg, do, dht)
  b = run("pallas", changed, seg, do, dht)
  keep = ~doc
  assert not np.array_equal(a[0][doc], b[0][doc])
  np.testing.assert_array_equal(a[0][keep], b[0][keep])
  for n in TOKEN_FIELDS:
    np.testing.assert_array_equal(a[2][n][keep], b[2][n][keep])


def test_gates_at_the_floor_float32_highest():
  """Every gate within 1% of -5 at K = V = 128 (the balanced factorisation,
  `common.SAFE_BALANCE`), against the float64 recurrence on the host.
  Measured on a v5e: o 2.7e-6, dg 3.3e-5, dA_log 2.9e-4, dt_bias 2.3e-4
  (interpret mode on CPU: 1.4e-4 and 1.7e-4; why, there): 6e-4 for those
  two sums."""
  rng = np.random.default_rng(11)
  params, static = kda_cases.kda_inputs(rng, 1, 128, 2, 128, 128, gate="floor",
                                        l2norm=True)
  do, dht = kda_cases.kda_cotangents(rng, params["v"].shape, 1, 128)
  with jax.default_device(jax.devices("cpu")[0]):
    want = kda_cases.kda_float64(params, do, dht, **static)
  seg = np.ones((1, 128), np.int32)
  got = run("pallas", params, seg, do, dht, HIGHEST)
  (o, s, g), (o_ref, s_ref, g_ref) = got, want
  errs = {"o": numerics.rel_err(o, o_ref), "state": numerics.rel_err(s, s_ref)}
  errs.update({"d" + n: numerics.rel_err(g[n], g_ref[n]) for n in FIELDS})
  print(" ".join(f"{n}={e:.1e}" for n, e in errs.items()))
  for n, e in errs.items():
    tol = (FWD_TOL if n in ("o", "state") else
           6e-4 if n in ("dA_log", "ddt_bias") else GRAD_TOL)
    assert e <= tol, (n, e)
