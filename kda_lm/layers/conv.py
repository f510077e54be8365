"""ShortConvolution: FLA's depthwise causal convolution, segment-aware.

Shape glossary (`kda_lm/model.py`'s): B batch rows, T tokens, D channels,
J kernel size (taps).

`y[t, d] = act(sum_{j=0}^{J-1} w[J-1-j, d] * x[t-j, d] (+ b[d]))`, where a
tap `x[t-j]` reads as zero unless it lies in the same segment as `t` (the
window never reaches across a document boundary or into padding), as if each
document had been run alone with FLA's zero left padding.
"""

from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp

from kda_lm import segments


class ShortConvolution(hk.Module):
  """Depthwise causal convolution with a per-document window."""

  def __init__(self, kernel_size: int = 4, *, with_bias: bool = False,
               activation: Optional[str] = "silu", param_dtype=jnp.float32,
               name: Optional[str] = None):
    """Initialises the module.

    Args:
      kernel_size: J, taps per channel (current token and J-1 before it).
      with_bias: add a per-channel bias before the activation.
      activation: "silu" or None.
      param_dtype: dtype of the stored parameters.
      name: module name.

    Raises:
      ValueError: kernel_size < 1 or an unknown activation.
    """
    super().__init__(name=name)
    if (isinstance(kernel_size, bool) or not isinstance(kernel_size, int)
        or kernel_size < 1):
      raise ValueError(f"kernel_size must be a positive int, got "
                       f"{kernel_size!r}.")
    if activation not in ("silu", None):
      raise ValueError(f"activation must be 'silu' or None, got "
                       f"{activation!r}.")
    self.kernel_size = kernel_size
    self.with_bias = with_bias
    self.activation = activation
    self.param_dtype = param_dtype

  def __call__(self, x: jax.Array,
               segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """Convolves `x`.

    Args:
      x: [B,T,D] inputs.
      segment_ids: optional [B,T] int ids (0 = padding); None = one segment
        per row.

    Returns:
      [B,T,D] in `x`'s dtype.

    Raises:
      ValueError: `x` is not 3-D or `segment_ids` is not [B,T].
    """
    if x.ndim != 3:
      raise ValueError(f"x must be [B,T,D], got shape {x.shape}.")
    B, T, D = x.shape
    J = self.kernel_size
    # PyTorch's Conv1d default init for a depthwise kernel: fan_in = J.
    bound = J ** -0.5
    init = hk.initializers.RandomUniform(-bound, bound)
    w_JD = hk.get_parameter("weight", [J, D], self.param_dtype, init=init)
    w_JD = w_JD.astype(x.dtype)
    x_pad = jnp.pad(x, ((0, 0), (J - 1, 0), (0, 0)))
    if segment_ids is not None:
      if segment_ids.shape != (B, T):
        raise ValueError(f"segment_ids must be [B,T] = {(B, T)}, got "
                         f"{segment_ids.shape}.")
      off_BT = segments.offsets(segment_ids)
    y = x * w_JD[J - 1]
    for j in range(1, J):
      tap = x_pad[:, J - 1 - j:J - 1 - j + T] * w_JD[J - 1 - j]
      if segment_ids is not None:
        tap = jnp.where((off_BT >= j)[:, :, None], tap, jnp.zeros_like(tap))
      y = y + tap
    if self.with_bias:
      b_D = hk.get_parameter("bias", [D], self.param_dtype, init=init)
      y = y + b_D.astype(x.dtype)
    if self.activation == "silu":
      y = jax.nn.silu(y)
    return y
