"""Tests of kda_lm/layers/kda.py: the KDA layer == a naive numpy layer."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_lm.layers import kda

H, K, D = 2, 8, 16
SEG = np.array([[1] * 7 + [2] * 2 + [0] * 2 + [3] * 9, [1] * 20], np.int32)


# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


def _transformed(**kwargs):
  kw = dict(gate="ling", impl="xla", chunk_size=16)
  kw.update(kwargs)
  return hk.without_apply_rng(hk.transform(
      lambda x, s=None: kda.KimiDeltaAttention(H, K, name="kda", **kw)(x, s)))


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _naive(params, x, seg, gate, V):
  """The KDA layer in float64 numpy with a token-by-token recurrence."""
  p = {k.split("/", 1)[1] if "/" in k else "": {n: np.asarray(v, np.float64)
                                                for n, v in d.items()}
       for k, d in params.items()}
  x = x.astype(np.float64)
  B, T, _ = x.shape
  start = np.ones((B, T), bool)
  start[:, 1:] = seg[:, 1:] != seg[:, :-1]

  def conv_silu(y, w):  # y [B,T,C], w [4,C]; taps stop at segment starts
    out = np.zeros_like(y)
    for b in range(B):
      for t in range(T):
        for j in range(4):
          if t - j < 0:
            break
          out[b, t] += w[3 - j] * y[b, t - j]
          if start[b, t - j]:
            break
    return out * _sigmoid(out)

  q = conv_silu(x @ p["q_proj"]["w"], p["q_conv1d"]["weight"])
  k = conv_silu(x @ p["k_proj"]["w"], p["k_conv1d"]["weight"])
  v = conv_silu(x @ p["v_proj"]["w"], p["v_conv1d"]["weight"])
  q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H, V)
  l2 = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)
  q, k = l2(q), l2(k)
  A = np.exp(p[""]["A_log"])[:, None]
  dt = p[""]["dt_bias"].reshape(H, K)
  if gate == "ling":
    g = -5.0 * _sigmoid(A * ((x @ p["f_proj"]["w"]).reshape(B, T, H, K) + dt))
    og = x @ p["g_proj"]["w"]
  else:
    raw = (x @ p["f_a_proj"]["w"] @ p["f_b_proj"]["w"]).reshape(B, T, H, K)
    g = -A * np.log1p(np.exp(raw + dt))
    og = x @ p["g_a_proj"]["w"] @ p["g_b_proj"]["w"] + p["g_b_proj"]["b"]
  beta = _sigmoid(x @ p["b_proj"]["w"])
  o = np.zeros((B, T, H, V))
  for b in range(B):
    for h in range(H):
      S = np.zeros((K, V))
      for t in range(T):
        if seg[b, t] == 0:
          continue
        if start[b, t]:
          S = np.zeros((K, V))
        S = S * np.exp(g[b, t, h])[:, None]
        S = S + np.outer(k[b, t, h],
                         beta[b, t, h] * (v[b, t, h] - S.T @ k[b, t, h]))
        o[b, t, h] = S.T @ q[b, t, h] * K ** -0.5
  o = o / np.sqrt((o * o).mean(-1, keepdims=True) + 1e-6)
  o = o * p["o_norm"]["weight"] * _sigmoid(og.reshape(B, T, H, V))
  return o.reshape(B, T, H * V) @ p["o_proj"]["w"]


@pytest.mark.parametrize("gate,impl,V", [
    ("ling", "xla", K), ("ling", "reference", K), ("kimi", "xla", 6),
    ("kimi", "reference", 6)])
def test_equals_naive_layer(gate, impl, V):
  x = np.random.default_rng(0).standard_normal((2, 20, D)).astype(np.float32)
  f = _transformed(gate=gate, impl=impl, head_v_dim=V)
  params = f.init(jax.random.key(0), x, SEG)
  got = np.asarray(jax.jit(f.apply)(params, x, SEG))
  ref = _naive(params, x, SEG, gate, V)
  err = np.abs(got - ref).max() / np.abs(ref).max()
  assert err <= 1e-5, err


def test_param_shapes_and_inits():
  x = np.zeros((1, 4, D), np.float32)
  ling = _transformed(gate="ling").init(jax.random.key(0), x)
  kimi = _transformed(gate="kimi").init(jax.random.key(0), x)
  shapes = lambda p: {f"{m}/{n}": v.shape
                      for m, n, v in hk.data_structures.traverse(p)}
  assert shapes(ling)["kda/f_proj/w"] == (D, H * K)
  assert shapes(ling)["kda/g_proj/w"] == (D, H * K)
  assert shapes(kimi)["kda/f_a_proj/w"] == (D, K)
  assert shapes(kimi)["kda/f_b_proj/w"] == (K, H * K)
  assert shapes(kimi)["kda/g_b_proj/b"] == (H * K,)
  for params, gate in ((ling, "ling"), (kimi, "kimi")):
    n = sum(v.size for v in jax.tree.leaves(params))
    assert n == kda.param_count(D, H, K, gate=gate)
    assert params["kda"]["A_log"].dtype == jnp.float32
    assert params["kda"]["dt_bias"].shape == (H * K,)
  np.testing.assert_array_equal(ling["kda"]["A_log"], 0.0)
  a = np.exp(np.asarray(kimi["kda"]["A_log"]))
  assert np.all((a >= 1.0) & (a <= 16.0))
  dt_bias = hk.transform(
      lambda: hk.get_parameter("b", (4096,), jnp.float32,
                               init=kda.dt_bias_init)).init(jax.random.key(3))
  dt = np.asarray(jax.nn.softplus(dt_bias["~"]["b"]))
  assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
  assert np.median(dt) < 0.02  # log-uniform, not uniform.


def test_gradients_reach_gate_params():
  x = np.random.default_rng(1).standard_normal((1, 20, D)).astype(np.float32)
  for gate in kda.GATES:
    f = _transformed(gate=gate)
    params = f.init(jax.random.key(0), x, SEG[:1])
    loss = lambda p, f=f: jnp.sum(f.apply(p, x, SEG[:1]) ** 2)
    grads = jax.jit(jax.grad(loss))(params)
    for leaf in jax.tree.leaves(grads):
      assert np.all(np.isfinite(leaf))
    for name in ("A_log", "dt_bias"):
      assert np.all(np.abs(grads["kda"][name]) > 0), (gate, name)


def test_bad_arguments():
  x = np.zeros((1, 4, D), np.float32)
  with pytest.raises(ValueError, match="gate"):
    _transformed(gate="mamba").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="head_dim"):
    hk.transform(lambda x: kda.KimiDeltaAttention(H, 0)(x)).init(
        jax.random.key(0), x)
  with pytest.raises(ValueError, match="segment_ids"):
    _transformed().init(jax.random.key(0), x, np.ones((1, 3), np.int32))
