"""KDA op cases shared by the tests and the benchmarks: random inputs,
cotangents, document ids, and the op's float64 oracle.

Inputs use FLA's test distributions; shapes follow `kda_lm.ops.chunk_kda`.

`kda_float64` is the op's oracle for accuracy checks: the token-by-token
reference run in float64, so a float32 implementation's error against it is
its own error, not the difference of two float32 roundings.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kda_lm.ops.kda import common, reference
from testbed import numerics


def kda_float64(params: dict[str, np.ndarray], do: np.ndarray,
                dht: np.ndarray, segment_ids: np.ndarray | None = None,
                scale: float | None = None, **static: Any
                ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
  """The reference recurrence and its gradients in float64.

  Args:
    params: `chunk_kda` arrays by name (as `kda_inputs` makes them; no
      cu_seqlens).
    do: [B,T,H,V] cotangent of o; dht: [B,H,K,V] cotangent of the final
      state (the loss is `sum(o * do) + sum(final_state * dht)`).
    segment_ids: [B,T] int or None.
    scale: the query scale (default K**-0.5).
    **static: `use_gate_in_kernel`, `lower_bound`, `use_qk_l2norm_in_kernel`
      (`safe_gate` and `chunk_size` do not change the result).

  Returns:
    float64 numpy (o, final_state, {name: gradient}).
  """
  B, T, H, K = params["q"].shape
  scale = K ** -0.5 if scale is None else scale
  ids = np.ones((B, T), np.int32) if segment_ids is None else segment_ids
  with jax.enable_x64(True):
    segs = common.segments_from_ids(jnp.asarray(ids))

    def loss(p):
      q, k, v, g, beta = common.canonicalize(
          p["q"], p["k"], p["v"], p["g"], p["beta"], segs,
          A_log=p.get("A_log"), dt_bias=p.get("dt_bias"),
          lower_bound=static.get("lower_bound"),
          use_gate_in_kernel=static.get("use_gate_in_kernel", False),
          use_qk_l2norm_in_kernel=static.get("use_qk_l2norm_in_kernel",
                                             False), dtype=jnp.float64)
      h0 = p.get("initial_state", jnp.zeros((B, H, K, v.shape[-1]),
                                            jnp.float64))
      o, s = reference.kda_recurrent(q, k, v, g, beta, segs, h0, scale)
      return jnp.sum(o * do) + jnp.sum(s * dht), (o, s)

    p64 = {n: jnp.asarray(a, jnp.float64) for n, a in params.items()}
    grads, (o, s) = jax.jit(jax.grad(loss, has_aux=True))(p64)
    return jax.tree.map(np.asarray, (o, s, grads))


def _add_spikes(rng, g):
  """-1000 gates (hard resets): a full token, half the channels of token 64
  (a chunk's first row) and scattered entries."""
  g = g.copy()
  t, K = g.shape[1], g.shape[-1]
  g[:, min(10, t - 1)] = -1000.0
  if t > 64:
    g[:, 64, :, : K // 2] = -1000.0
  g[rng.random(g.shape) < 0.01] = -1000.0
  return g


def kda_inputs(rng: np.random.Generator, B: int, T: int, H: int, K: int,
               V: int, *, gate: str = "pre", l2norm: bool = False,
               h0: bool = True, spikes: bool = False
               ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """Random float32 `chunk_kda` inputs in FLA's test distributions.

  Args:
    rng: numpy Generator.
    B, T, H, K, V: the shapes.
    gate: "pre" (pre-activated logsigmoid gates), "softplus" (raw gates, the
      in-kernel softplus form), "safe" (raw gates, in-kernel
      lower_bound=-5 form with safe_gate=True) or "floor" (as "safe", with
      every gate within 1% of the floor -5).
    l2norm: use_qk_l2norm_in_kernel; when off, k is L2-normalised here (as
      in FLA's tests) so the delta rule stays contractive.
    h0: pass a random initial_state [B,H,K,V].
    spikes: hard resets in the gates (with gate="pre" only).

  Returns:
    (params dict for chunk_kda, static kwargs dict).

  Raises:
    ValueError: an unknown gate, or spikes with another gate than "pre".
  """
  randn = lambda *s: rng.standard_normal(s).astype(np.float32)
  q, k, v, x = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V), randn(
      B, T, H, K)
  if not l2norm:
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
  params = dict(q=q, k=k, v=v, beta=numerics.sigmoid(randn(B, T, H)))
  static = dict(use_qk_l2norm_in_kernel=l2norm)
  if gate == "pre":
    g = numerics.logsigmoid(x)
  elif gate == "softplus":
    g = x
    params["A_log"] = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    params["dt_bias"] = randn(H * K)
    static["use_gate_in_kernel"] = True
  elif gate in ("safe", "floor"):  # floor: every gate within 1% of -5
    floor = gate == "floor"
    g = 4.6 + 0.5 * np.abs(x) if floor else x
    params["A_log"] = (np.zeros(H) if floor else rng.uniform(-1, 1, H)
                       ).astype(np.float32)
    params["dt_bias"] = np.zeros(H * K) if floor else randn(H * K)
    static.update(use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True)
  else:
    raise ValueError(f"Unknown gate {gate!r}.")
  if spikes:
    if gate != "pre":
      raise ValueError("spikes need gate='pre'.")
    g = _add_spikes(rng, g)
  params["g"] = g.astype(np.float32)
  if h0:
    params["initial_state"] = randn(B, H, K, V)
  params = {n: np.asarray(a, np.float32) for n, a in params.items()}
  return params, static


def kda_cotangents(rng: np.random.Generator, o_shape: tuple[int, ...],
                   N: int, K: int) -> tuple[np.ndarray, np.ndarray]:
  """float32 cotangents: `do` like o [B,T,H,V] and `dht` [N,H,K,V]."""
  do = rng.standard_normal(o_shape).astype(np.float32)
  H, V = o_shape[2], o_shape[3]
  dht = rng.standard_normal((N, H, K, V)).astype(np.float32)
  return do, dht


def document_ids(rng: np.random.Generator, B: int, T: int, docs: int
                 ) -> np.ndarray:
  """[B,T] int32 segment ids: each row `docs` contiguous documents of random
  lengths (ids 1..docs, no padding); all zeros when `docs` is 0."""
  ids = np.zeros((B, T), np.int32)
  for b in range(B if docs > 0 else 0):
    cuts = np.sort(rng.choice(np.arange(1, T), docs - 1, replace=False))
    ids[b] = np.searchsorted(cuts, np.arange(T), side="right") + 1
  return ids
