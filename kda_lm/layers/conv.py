"""ShortConvolution: FLA's depthwise causal convolution, segment-aware.

Shape glossary: B batch rows, T tokens, D channels, J kernel size.

`y[t, d] = act(sum_{j=0}^{J-1} w[J-1-j, d] * x[t-j, d] (+ b[d]))`, where a
tap `x[t-j]` reads as zero unless it lies in the same segment as `t` (the
window never reaches across a document boundary or into padding), as if each
document had been run alone with FLA's zero left padding.

Under context parallelism (a `context` mesh axis > 1, see
`kda_lm/parallel/context.py`) each shard reads the last J-1 inputs of its
left neighbour as a halo.

Decoding keeps the window of the last `J-1` inputs as a cache: a prefill
returns it (`return_window=True`, zero outside the row's last segment), and
each decode step convolves `concat(window, x)` and returns the shifted
window.
"""

from typing import Any, Optional

import haiku as hk
import jax
import jax.numpy as jnp

from kda_lm import segments
from kda_lm.parallel import context as context_parallel
from kda_lm.parallel import maps as parallel_maps


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
               segment_ids: Optional[jax.Array] = None, *,
               window: Optional[jax.Array] = None,
               return_window: bool = False) -> Any:
    """Convolves `x`.

    Args:
      x: [B,T,D] inputs.
      segment_ids: optional [B,T] int ids (0 = padding); None = one segment
        per row.
      window: optional [B,J-1,D] inputs that precede `x` in its document
        (a decode cache; zeros = the document starts with `x`). Not with
        `segment_ids`.
      return_window: also return the window after `x`.

    Returns:
      [B,T,D] in `x`'s dtype; with `window` or `return_window`, `(y,
      window [B,J-1,D])`: the last J-1 inputs of the row's last segment,
      zero before its start.

    Raises:
      ValueError: `x` is not 3-D, `segment_ids` is not [B,T], or `window`
        is not [B,J-1,D] or comes with `segment_ids`.
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
    if parallel_maps.context_size() > 1:
      return self._context_parallel(x, segment_ids, w_JD, window,
                                    return_window)
    if window is None:
      x_pad = jnp.pad(x, ((0, 0), (J - 1, 0), (0, 0)))
    else:
      if segment_ids is not None or window.shape != (B, J - 1, D):
        raise ValueError(f"window must be [B,J-1,D] = {(B, J - 1, D)} and "
                         f"comes without segment_ids; got "
                         f"{window.shape}.")
      x_pad = jnp.concatenate([window.astype(x.dtype), x], axis=1)
    segment_ids = segments.check(segment_ids, (B, T))
    if segment_ids is not None:
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
    if window is None and not return_window:
      return y
    return y, self._last_window(x_pad, segment_ids)

  def _context_parallel(self, x, segment_ids, w_JD, window, return_window):
    """The convolution with T sharded over `context`: each shard reads the
    last J-1 inputs (and ids) of its left neighbour."""
    if window is not None or return_window:
      raise ValueError("The short convolution's decode window is not "
                       "supported under context parallelism.")
    B, T, D = x.shape
    J = self.kernel_size
    segment_ids = segments.check(segment_ids, (B, T))
    if segment_ids is None:
      segment_ids = jnp.ones((B, T), jnp.int32)
    b_D = None
    if self.with_bias:
      bound = J ** -0.5
      b_D = hk.get_parameter("bias", [D], self.param_dtype,
                             init=hk.initializers.RandomUniform(-bound,
                                                                bound))
    params = (w_JD,) if b_D is None else (w_JD, b_D.astype(x.dtype))
    if J == 1:
      return self._finish(x * w_JD[0], *params[1:])

    def local(x_ext, ids_ext, w_JD, *bias):
      # The window's first J-1 tokens are the halo; offsets on the
      # extended row are exact for every tap a local token reads.
      off_BT = segments.offsets(ids_ext)[:, J - 1:]
      t = x_ext.shape[1] - (J - 1)
      y = x_ext[:, J - 1:] * w_JD[J - 1]
      for j in range(1, J):
        tap = x_ext[:, J - 1 - j:J - 1 - j + t] * w_JD[J - 1 - j]
        y = y + jnp.where((off_BT >= j)[:, :, None], tap, 0)
      return self._finish(y, *bias)

    return context_parallel.left_halo_map(local, x, segment_ids, J - 1,
                                          *params)

  def _finish(self, y, b_D=None):
    """Bias and activation."""
    if b_D is not None:
      y = y + b_D
    return jax.nn.silu(y) if self.activation == "silu" else y

  def _last_window(self, x_pad: jax.Array,
                   segment_ids: Optional[jax.Array]) -> jax.Array:
    """The last J-1 inputs of `x_pad [B,J-1+T,D]`, zero outside the row's
    last segment."""
    J = self.kernel_size
    T = x_pad.shape[1] - (J - 1)
    win_BJD = x_pad[:, T:]
    if segment_ids is None:
      return win_BJD
    piece_BT = jnp.pad(segments.piece_ids(segment_ids), ((0, 0), (J - 1, 0)),
                       constant_values=-1)[:, T:]
    keep_BJ = ((piece_BT == piece_BT[:, -1:])
               & (segment_ids[:, -1:] != 0))
    return jnp.where(keep_BJ[:, :, None], win_BJD, 0).astype(x_pad.dtype)
