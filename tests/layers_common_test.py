"""Tests of the small layers: norm.py, mlp.py, linear.py."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_lm.layers import linear, mlp, norm


def _run(fn, *args):
  f = hk.without_apply_rng(hk.transform(fn))
  params = f.init(jax.random.key(0), *args)
  return params, np.asarray(f.apply(params, *args))


def test_rmsnorm_values_and_dtype():
  x = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
  params, y = _run(lambda x: norm.RMSNorm(eps=0.0)(x), x)
  np.testing.assert_allclose(y[0], [3 / np.sqrt(12.5), 4 / np.sqrt(12.5)],
                             rtol=1e-6)
  assert params["rms_norm"]["weight"].dtype == jnp.float32
  _, y16 = _run(lambda x: norm.RMSNorm()(x), x.astype(jnp.bfloat16))
  assert y16.dtype == jnp.bfloat16


def test_gated_rmsnorm_values():
  o = np.array([[[[1.0, -1.0]]]], np.float32)           # [1,1,1,2]
  gate = np.array([[[[0.0, 100.0]]]], np.float32)
  _, y = _run(lambda o, g: norm.GatedRMSNorm(eps=0.0)(o, g), o, gate)
  np.testing.assert_allclose(y.ravel(), [0.5, -1.0], rtol=1e-6)


def test_swiglu_and_dense_dtypes():
  x = np.random.default_rng(0).standard_normal((1, 3, 8)).astype(np.float32)
  params, y = _run(lambda x: mlp.SwiGLU(12)(x), x)
  p = {k.split("/")[-1]: v["w"] for k, v in params.items()}
  ref = (jax.nn.silu(x @ p["gate_proj"]) * (x @ p["up_proj"])) @ p["down_proj"]
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
  # bfloat16 compute keeps float32 parameters; out_dtype gives float32.
  params, y = _run(lambda x: linear.Dense(4, out_dtype=jnp.float32)(x),
                   x.astype(jnp.bfloat16))
  assert params["dense"]["w"].dtype == jnp.float32 and y.dtype == np.float32


@pytest.mark.parametrize("bad", [0, True, 2.0])
def test_swiglu_rejects_bad_width(bad):
  with pytest.raises(ValueError, match="hidden_size"):
    _run(lambda x: mlp.SwiGLU(bad)(x), np.ones((1, 2, 4), np.float32))
