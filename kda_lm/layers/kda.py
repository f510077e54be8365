"""KimiDeltaAttention: the KDA token mixer (FLA `fla/layers/kda.py`).

Shape glossary: B batch rows, T tokens, D model width, H heads,
K key/query head dim, V value head dim.

  q, k, v = SiLU(ShortConv(x W_q)), ... (k, v alike)     [B,T,H,K], [B,T,H,V]
  g       = forget-gate projection of x (raw; activated inside the op)
  beta    = sigmoid(x W_b)                                       [B,T,H]
  o       = chunk_kda(q, k, v, g, beta, A_log, dt_bias, segment_ids)
  y       = W_o (rmsnorm_per_head(o) * weight * sigmoid(output gate of x))

q and k are L2-normalised inside the op. Two gate variants:

* `ling` (Ling 3.0, default): full-rank gates `f_proj [D, H*K]` and
  `g_proj [D, H*V]`; bounded forget gate
  `g = -5 * sigmoid(exp(A_log) * (x + dt_bias))` in (-5, 0), which allows
  the op's all-matmul `safe_gate` path; `A_log` initialised to 0.
* `kimi` (Kimi Linear): low-rank gates `f_a [D, V] -> f_b [V, H*K]` and
  `g_a [D, V] -> g_b [V, H*V] (+ bias)`; softplus forget gate
  `g = -exp(A_log) * softplus(x + dt_bias)`; `A_log = log U(1, 16)`.

`A_log [H]` and `dt_bias [H*K]` are float32 whatever the parameter dtype and
are not weight-decayed (`kda_lm.optimizer.weight_decay_mask`).

Decoding (`kda_lm.infer.decoding`): `return_cache=True` (a prefill) also
returns a `KDACache` (the float32 state after each row's last token and the last
`conv_size - 1` inputs of the q, k, v short convolutions); passing `cache`
runs the new tokens through the recurrence in closed form from it
(`ops.kda.recurrent.recurrent_kda`) and returns the updated cache. Its size
does not depend on the length.
"""

import math
from typing import Any, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp

from kda_lm import segments
from kda_lm.layers import conv, linear, norm
from kda_lm.ops.kda import common, recurrent
from kda_lm.parallel import context as context_parallel

GATES = ("ling", "kimi")
LING_LOWER_BOUND = common.GATE_FLOOR   # Ling 3.0's kda_lower_bound
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4


class KDACache(NamedTuple):
  """A KDA layer's decode cache (J = conv_size - 1 taps).

  Attributes:
    state: [B,H,K,V] float32 recurrent state after the last token.
    q_window: [B,J,H*K] last inputs of the q short convolution.
    k_window: [B,J,H*K] same for k.
    v_window: [B,J,H*V] same for v.
  """
  state: jax.Array
  q_window: jax.Array
  k_window: jax.Array
  v_window: jax.Array


def a_log_init(gate: str) -> hk.initializers.Initializer:
  """FLA's `A_log` init: zeros for `ling`, `log U(1, 16)` for `kimi`."""
  if gate == "ling":
    return jnp.zeros

  def init(shape, dtype):
    u = jax.random.uniform(hk.next_rng_key(), shape, jnp.float32, 1.0, 16.0)
    return jnp.log(u).astype(dtype)

  return init


def dt_bias_init(shape, dtype):
  """FLA's `dt_bias` init: inverse softplus of `dt = exp(U(log 1e-3, log .1))`.

  `dt` is floored at 1e-4 before the inversion.
  """
  u = jax.random.uniform(hk.next_rng_key(), shape, jnp.float32)
  dt = jnp.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
  dt = jnp.maximum(dt, DT_FLOOR)
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class KimiDeltaAttention(hk.Module):
  """The KDA layer: projections, short convolutions, gates, `chunk_kda`."""

  def __init__(self, num_heads: int, head_dim: int, *,
               head_v_dim: Optional[int] = None, gate: str = "ling",
               lower_bound: float = LING_LOWER_BOUND, conv_size: int = 4,
               conv_bias: bool = False,
               norm_eps: float = 1e-6, impl: str = "auto",
               chunk_size: Optional[int] = None,
               param_dtype=jnp.float32,
               pallas_options=None, name: Optional[str] = None):
    """Initialises the module.

    Args:
      num_heads: H.
      head_dim: K, the query/key head dim.
      head_v_dim: V, the value head dim (default K).
      gate: "ling" or "kimi" (see the module docstring).
      lower_bound: the `ling` forget gate's bound, in [-5, 0) (Ling 3.0's
        `kda_lower_bound`, -5 by default).
      conv_size: short convolution kernel size (taps).
      conv_bias: give the short convolutions a bias.
      norm_eps: epsilon of the gated output RMSNorm.
      impl: `chunk_kda` implementation ("auto", "reference", "xla", ...).
      chunk_size: `chunk_kda` chunk size (None: the op's per-backend
        choice).
      param_dtype: dtype of the projection, conv and norm parameters.
      pallas_options: `chunk_kda`'s `pallas.KernelOptions` (None: the
        defaults of JAX's default backend).
      name: module name.

    Raises:
      ValueError: a non-positive dimension or an unknown gate.
    """
    super().__init__(name=name)
    head_v_dim = head_dim if head_v_dim is None else head_v_dim
    for key, value in (("num_heads", num_heads), ("head_dim", head_dim),
                       ("head_v_dim", head_v_dim)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"KDA {key} must be a positive int, got {value!r}.")
    if gate not in GATES:
      raise ValueError(f"KDA gate must be one of {GATES}, got {gate!r}.")
    self.num_heads = num_heads
    self.head_dim = head_dim
    self.head_v_dim = head_v_dim
    self.gate = gate
    self.lower_bound = lower_bound
    self.conv_size = conv_size
    self.conv_bias = conv_bias
    self.norm_eps = norm_eps
    self.impl = impl
    self.chunk_size = chunk_size
    self.param_dtype = param_dtype
    self.pallas_options = pallas_options

  def __call__(self, x: jax.Array,
               segment_ids: Optional[jax.Array] = None, *,
               cache: Optional[KDACache] = None,
               return_cache: bool = False) -> Any:
    """Mixes tokens within each document.

    Args:
      x: [B,T,D] inputs (the compute dtype).
      segment_ids: optional [B,T] int ids, 1-based documents, 0 = padding;
        the state and the conv window reset wherever the id changes. None =
        one document per row.
      cache: optional `KDACache` of the tokens before `x` (decoding; then
        `segment_ids` must be None: every token continues its row).
      return_cache: also return the cache after `x` (a prefill; it holds
        each row's last segment).

    Returns:
      [B,T,D] in `x`'s dtype; with `cache` or `return_cache`,
      `(y, KDACache)`.

    Raises:
      ValueError: `x` is not [B,T,D], `segment_ids` is not [B,T], or a
        `cache` comes with `segment_ids`.
    """
    segment_ids = _check_inputs(x, segment_ids, cache)
    B, T, D = x.shape
    H, K, V = self.num_heads, self.head_dim, self.head_v_dim
    with_cache = cache is not None or return_cache
    windows = {}

    # Modules are built here, not in helper methods, so that their names
    # carry no method scope ("kda/q_proj", not "kda/~_dense/q_proj").
    def dense(size, name, with_bias=False):
      return linear.Dense(size, with_bias=with_bias,
                          param_dtype=self.param_dtype, name=name)

    def proj_conv(size, name):
      y = dense(size, f"{name}_proj")(x)
      y = conv.ShortConvolution(
          self.conv_size, with_bias=self.conv_bias, activation="silu",
          param_dtype=self.param_dtype, name=f"{name}_conv1d")(
              y, segment_ids, return_window=with_cache,
              window=None if cache is None else
              getattr(cache, f"{name}_window"))
      if with_cache:
        y, windows[f"{name}_window"] = y
      return y

    q_BTHK = proj_conv(H * K, "q").reshape(B, T, H, K)
    k_BTHK = proj_conv(H * K, "k").reshape(B, T, H, K)
    v_BTHV = proj_conv(H * V, "v").reshape(B, T, H, V)
    g_BTHK, out_gate, lower_bound, safe_gate = _gate_projections(
        x, dense, self.gate, H, K, V, self.lower_bound)
    beta_BTH = jax.nn.sigmoid(dense(H, "b_proj")(x))
    A_log_H = hk.get_parameter("A_log", [H], jnp.float32,
                               init=a_log_init(self.gate))
    dt_bias = hk.get_parameter("dt_bias", [H * K], jnp.float32,
                               init=dt_bias_init)
    if cache is None:
      o_BTHV, state = context_parallel.chunk_kda(
          q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, segment_ids=segment_ids,
          A_log=A_log_H, dt_bias=dt_bias, use_gate_in_kernel=True,
          lower_bound=lower_bound, safe_gate=safe_gate,
          use_qk_l2norm_in_kernel=True, output_final_state=return_cache,
          chunk_size=self.chunk_size, impl=self.impl,
          pallas_options=self.pallas_options)
    else:  # One decode step from the cached state, in closed form.
      o_BTHV, state = recurrent.recurrent_kda(
          q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, cache.state,
          A_log=A_log_H, dt_bias=dt_bias, lower_bound=lower_bound)
    o_BTHV = norm.GatedRMSNorm(eps=self.norm_eps, param_dtype=self.param_dtype,
                               name="o_norm")(
                                   o_BTHV, out_gate.reshape(B, T, H, V))
    y = dense(D, "o_proj")(o_BTHV.reshape(B, T, H * V))
    if not with_cache:
      return y
    return y, KDACache(state=state, **windows)


def _gate_projections(x, dense, gate, H, K, V,
                      ling_lower_bound=LING_LOWER_BOUND):
  """The decay gate and output gate projections of one gate form.

  A function, not a method, so that the modules `dense` builds carry no
  method scope in their names.

  Args:
    x: [B,T,D] inputs.
    dense: `dense(size, name, with_bias=False)` building a `linear.Dense`.
    gate: "ling" (full-rank gates, bounded decay) or "kimi" (low-rank gates
      through width V, the softplus decay).
    H, K, V: heads, key and value dims.
    ling_lower_bound: the `ling` gate's lower bound.

  Returns:
    (raw decay gate g [B,T,H,K], output gate [B,T,H*V], the op's
    `lower_bound`, the op's `safe_gate`).
  """
  B, T, _ = x.shape
  if gate == "ling":
    g = dense(H * K, "f_proj")(x)
    out_gate = dense(H * V, "g_proj")(x)
    lower_bound, safe_gate = ling_lower_bound, True
  else:
    g = dense(H * K, "f_b_proj")(dense(V, "f_a_proj")(x))
    out_gate = dense(H * V, "g_b_proj", with_bias=True)(
        dense(V, "g_a_proj")(x))
    lower_bound, safe_gate = None, False
  return g.reshape(B, T, H, K), out_gate, lower_bound, safe_gate


def _check_inputs(x: jax.Array, segment_ids: Optional[jax.Array],
                  cache: Optional[KDACache]) -> Optional[jax.Array]:
  """Checks the layer's inputs; returns `segment_ids` as int32 (or None)."""
  if x.ndim != 3:
    raise ValueError(f"x must be [B,T,D], got shape {x.shape}.")
  B, T, _ = x.shape
  if segment_ids is not None and cache is not None:
    raise ValueError("A KDA decode step (cache) takes no segment_ids.")
  return segments.check(segment_ids, (B, T))


def param_count(d_model: int, num_heads: int, head_dim: int, *,
                head_v_dim: Optional[int] = None, gate: str = "ling",
                conv_size: int = 4, conv_bias: bool = False) -> int:
  """Parameters of one KDA layer, by shape arithmetic (for tests)."""
  D, H, K = d_model, num_heads, head_dim
  V = K if head_v_dim is None else head_v_dim
  n = D * H * K * 2 + D * H * V + D * H + H * V * D        # q,k,v,b,o
  n += conv_size * (2 * H * K + H * V)                      # convs
  if conv_bias:
    n += 2 * H * K + H * V
  if gate == "ling":
    n += D * H * K + D * H * V
  else:
    n += D * V + V * H * K + D * V + V * H * V + H * V
  return int(n + H + H * K + V)                             # A_log, dt, norm


