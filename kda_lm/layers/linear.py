"""A dense layer whose parameters keep their dtype under a compute dtype.

Shape glossary: B batch rows, T tokens, D input width, F output width.

`hk.Linear` creates its weights in the input's dtype, so bfloat16
activations would give bfloat16 parameters. `Dense` stores them in
`param_dtype` (float32 by default) and casts them to the input's dtype for
the matmul.
"""

from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp


class Dense(hk.Module):
  """`y = x @ w (+ b)` over the last axis."""

  def __init__(self, output_size: int, *, with_bias: bool = False,
               w_init: Optional[hk.initializers.Initializer] = None,
               param_dtype=jnp.float32, out_dtype=None,
               name: Optional[str] = None):
    """Initialises the module.

    Args:
      output_size: F, the output width.
      with_bias: add a bias (initialised to zeros).
      w_init: weight initialiser; default truncated normal with stddev
        `1/sqrt(D)` (Haiku's `hk.Linear` default).
      param_dtype: dtype of the stored parameters.
      out_dtype: dtype to accumulate and return in (e.g. float32 logits from
        bfloat16 activations); default the input's dtype.
      name: module name.
    """
    super().__init__(name=name)
    self.output_size = output_size
    self.with_bias = with_bias
    self.w_init = w_init
    self.param_dtype = param_dtype
    self.out_dtype = out_dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    """Maps `x [..., D]` to `[..., F]` (in `out_dtype`, default `x`'s)."""
    D = x.shape[-1]
    w_init = self.w_init or hk.initializers.TruncatedNormal(D ** -0.5)
    w_DF = hk.get_parameter("w", [D, self.output_size], self.param_dtype,
                            init=w_init)
    out_dtype = self.out_dtype or x.dtype
    y = jnp.dot(x, w_DF.astype(x.dtype), preferred_element_type=out_dtype)
    if self.with_bias:
      b_F = hk.get_parameter("b", [self.output_size], self.param_dtype,
                             init=jnp.zeros)
      y = y + b_F.astype(out_dtype)
    return y.astype(out_dtype)
