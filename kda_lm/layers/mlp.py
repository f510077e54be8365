"""SwiGLU feed-forward block.

Shape glossary: B batch rows, T tokens, D model width, F hidden width.
"""

from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp

from kda_lm.layers import linear


class SwiGLU(hk.Module):
  """`down(silu(gate(x)) * up(x))`, no biases (LLaMA / Ling 3.0 dense MLP)."""

  def __init__(self, hidden_size: int, *, param_dtype=jnp.float32,
               name: Optional[str] = None):
    """Initialises the module.

    Args:
      hidden_size: F, the hidden width.
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
    self.param_dtype = param_dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    """Maps `x [B,T,D]` to `[B,T,D]` in `x`'s dtype."""
    F, D = self.hidden_size, x.shape[-1]
    dense = lambda size, name: linear.Dense(
        size, param_dtype=self.param_dtype, name=name)
    h_BTF = jax.nn.silu(dense(F, "gate_proj")(x)) * dense(F, "up_proj")(x)
    return dense(D, "down_proj")(h_BTF)
