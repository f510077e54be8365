r"""Multi-token prediction (DeepSeek-V3 / Ling-3.0-flash MTP), segment-aware.

Shape glossary: B batch rows, T tokens, D model width.

MTP layer k (1-based) at position i predicts token t_{i+k+1}:

  e_i = emb(t_{i+k})   (zeros where t_{i+k} is in another document, padding
                        or past the row)
  h^k_i = Block(eh_proj([RMSNorm(e_i); RMSNorm(h^{k-1}_i)]))
  logits^k_i = LM head(RMSNorm(h^k_i))

with h^0 the main stack's hidden state before its final norm, and the
embedding and LM head shared with the main model (`kda_lm/model.py` builds
the blocks). With the training batch's `inputs` t_0..t_{T-1}` and `targets`
t_1..t_T, layer k's target at i is `targets[i + k]`, counted iff that target
is counted by the main loss (`loss_mask[i + k]`) and lies in the same
segment as position i (`kda_lm.segments.same_segment_ahead`: no padding or
other document between them, so a reused id after padding is another
document, as for KDA and MLA).
"""

from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp

from kda_lm import segments
from kda_lm.layers import linear, norm


def shift_left(x: jax.Array, k: int, fill=0) -> jax.Array:
  """`y[:, i] = x[:, i + k]`, `fill` past the end. x: [B,T,...]."""
  if k == 0:
    return x
  T = x.shape[1]
  pad = jnp.full((x.shape[0], min(k, T), *x.shape[2:]), fill, x.dtype)
  return jnp.concatenate([x[:, k:], pad], axis=1)[:, :T]


def targets_and_mask(targets: jax.Array, loss_mask: jax.Array,
                     segment_ids: Optional[jax.Array], k: int
                     ) -> tuple[jax.Array, jax.Array]:
  """MTP layer k's targets [B,T] and float32 weights [B,T].

  Args:
    targets: [B,T] next-token targets of the main loss.
    loss_mask: [B,T] weights of the main loss (0 on padding).
    segment_ids: [B,T] document ids (0 = padding) or None.
    k: the MTP depth, >= 1.

  Returns:
    (`targets[i + k]`, `loss_mask[i + k]` where position i + k is in the
    same document as i, else 0).
  """
  same = segments.same_segment_ahead(segment_ids, k, tuple(targets.shape))
  mask = shift_left(loss_mask.astype(jnp.float32), k, fill=0.0)
  return (shift_left(targets, k, fill=0),
          jnp.where(same, mask, 0.0).astype(jnp.float32))


class MTPInput(hk.Module):
  """`eh_proj([RMSNorm(e); RMSNorm(h)])`, D + D -> D, no bias."""

  def __init__(self, eps: float = 1e-6, param_dtype=jnp.float32,
               name: Optional[str] = None):
    super().__init__(name=name)
    self.eps = eps
    self.param_dtype = param_dtype

  def __call__(self, e: jax.Array, h: jax.Array) -> jax.Array:
    """Maps `e, h [B,T,D]` to `[B,T,D]`."""
    e = norm.RMSNorm(self.eps, self.param_dtype, name="enorm")(e)
    h = norm.RMSNorm(self.eps, self.param_dtype, name="hnorm")(h)
    return linear.Dense(h.shape[-1], param_dtype=self.param_dtype,
                        name="eh_proj")(jnp.concatenate([e, h], axis=-1))
