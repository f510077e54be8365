"""RMSNorm and the gated per-head RMSNorm of the KDA output.

Shape glossary: B batch rows, T tokens, H heads, V value head dim, D width.

Both norms compute in float32 and return the input's dtype; their weights
are float32 (or `param_dtype`) and initialised to ones.
"""

from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp


class RMSNorm(hk.Module):
  """`x / sqrt(mean(x^2) + eps) * weight` over the last axis."""

  def __init__(self, eps: float = 1e-6, param_dtype=jnp.float32,
               name: Optional[str] = None):
    """Initialises the module.

    Args:
      eps: added to the mean square inside the square root.
      param_dtype: dtype of `weight`.
      name: module name.
    """
    super().__init__(name=name)
    self.eps = eps
    self.param_dtype = param_dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    """Normalises `x [..., D]`; returns the same shape and dtype."""
    return self._normalize(x).astype(x.dtype)

  def _normalize(self, x: jax.Array) -> jax.Array:
    """float32 `x / sqrt(mean(x^2) + eps) * weight` (creates `weight`)."""
    weight_D = hk.get_parameter("weight", [x.shape[-1]], self.param_dtype,
                                init=hk.initializers.Constant(1.0))
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(
        jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return y * weight_D.astype(jnp.float32)


class GatedRMSNorm(RMSNorm):
  """FLA's `FusedRMSNormGated` (sigmoid): `rmsnorm(o) * weight * sigmoid(g)`.

  Normalises each head separately over its last axis; `weight [V]` is shared
  by all heads. Constructor arguments as `RMSNorm`.
  """

  def __call__(self, o: jax.Array, gate: jax.Array) -> jax.Array:
    """Applies the gated norm.

    Args:
      o: [B,T,H,V] values to normalise.
      gate: [B,T,H,V] pre-sigmoid output gate.

    Returns:
      [B,T,H,V] in `o`'s dtype.

    Raises:
      ValueError: `gate` and `o` differ in shape.
    """
    if gate.shape != o.shape:
      raise ValueError(f"gate shape {gate.shape} != o shape {o.shape}.")
    y = self._normalize(o) * jax.nn.sigmoid(gate.astype(jnp.float32))
    return y.astype(o.dtype)
