"""SwiGLU feed-forward block.

Shape glossary: B batch rows, T tokens, D model width, F hidden width.
"""

from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp

from kda_lm.layers import linear


def swiglu(gate: jax.Array, up: jax.Array, limit: float = 0.0) -> jax.Array:
  """`silu(gate) * up`; with `limit` > 0 the clamped form of Ling 3.0's late
  layers, `min(silu(gate), limit) * clip(up, -limit, limit)`."""
  h = jax.nn.silu(gate)
  if limit:
    h = jnp.minimum(h, jnp.asarray(limit, h.dtype))
    up = jnp.clip(up, -limit, limit).astype(up.dtype)
  return h * up


class SwiGLU(hk.Module):
  """`down(silu(gate(x)) * up(x))`, no biases (LLaMA / Ling 3.0 dense MLP);
  optionally clamped (`swiglu`)."""

  def __init__(self, hidden_size: int, *, limit: float = 0.0,
               param_dtype=jnp.float32, name: Optional[str] = None):
    """Initialises the module.

    Args:
      hidden_size: F, the hidden width.
      limit: the clamp of `swiglu` (0 = none).
      param_dtype: dtype of the stored parameters.
      name: module name.

    Raises:
      ValueError: hidden_size < 1.
    """
    super().__init__(name=name)
    if (isinstance(hidden_size, bool) or not isinstance(hidden_size, int)
        or hidden_size < 1):
      raise ValueError(f"hidden_size must be a positive int, got "
                       f"{hidden_size!r}.")
    self.hidden_size = hidden_size
    self.limit = float(limit)
    self.param_dtype = param_dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    """Maps `x [B,T,D]` to `[B,T,D]` in `x`'s dtype."""
    F, D = self.hidden_size, x.shape[-1]
    dense = lambda size, name: linear.Dense(
        size, param_dtype=self.param_dtype, name=name)
    h_BTF = swiglu(dense(F, "gate_proj")(x), dense(F, "up_proj")(x),
                   self.limit)
    return dense(D, "down_proj")(h_BTF)
