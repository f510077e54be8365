"""Rotary position embedding, interleaved (GPT-J) layout.

Shape glossary: B batch rows, T tokens, H heads, R rotary dims (even).

Channel pairs `(x[2i], x[2i+1])` are rotated by the angle
`position * theta^(-2i/R)`, computed in float32.
"""

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotates `x` by its positions.

  Args:
    x: [B,T,H,R] with R even.
    positions: [B,T] int positions (per document).
    theta: RoPE base.

  Returns:
    [B,T,H,R] in `x`'s dtype.

  Raises:
    ValueError: R is odd or the shapes disagree.
  """
  B, T, _, R = x.shape
  if R % 2:
    raise ValueError(f"RoPE needs an even number of dims, got {R}.")
  if positions.shape != (B, T):
    raise ValueError(f"positions must be [B,T] = {(B, T)}, got "
                     f"{positions.shape}.")
  inv_freq = theta ** (-jnp.arange(0, R, 2, dtype=jnp.float32) / R)  # [R/2]
  angle_BTR = positions.astype(jnp.float32)[:, :, None] * inv_freq
  cos = jnp.cos(angle_BTR)[:, :, None, :]
  sin = jnp.sin(angle_BTR)[:, :, None, :]
  x32 = x.astype(jnp.float32).reshape(*x.shape[:-1], R // 2, 2)
  x_even, x_odd = x32[..., 0], x32[..., 1]
  out = jnp.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos],
                  axis=-1)
  return out.reshape(x.shape).astype(x.dtype)
