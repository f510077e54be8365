"""Rotary position embedding, interleaved (GPT-J) layout, and YaRN.

Shape glossary: B batch rows, T tokens, H heads, R rotary dims (even).

Channel pairs `(x[2i], x[2i+1])` are rotated by the angle
`position * f_i`, computed in float32, with the inverse frequencies
`f_i = theta^(-2i/R)`.

YaRN (`RopeScaling(type="yarn")`, arXiv:2309.00071; exactly what
`transformers` computes for DeepSeek-style MLA, e.g. Ling 3.0's
`rope_parameters`) blends each frequency between its interpolated value
`f_i / factor` and the original `f_i` by a linear ramp `r_i` in [0, 1] over
the pair index i:

  f'_i = f_i / factor * r_i + f_i * (1 - r_i)
  r_i  = clip((i - lo) / (hi - lo), 0, 1)

where `lo` and `hi` are the pair indices that make `beta_fast` and
`beta_slow` rotations in `original_max_position_embeddings` tokens
(`_correction_dim`; floored and ceiled with `truncate`, clipped to
[0, R - 1]). Pairs turning fast keep their frequency, slow ones are
interpolated. The rotated pairs (cos and sin alike, so both q and k) are
multiplied by `rope_attention_factor`: `attention_factor` if given (not 0),
else `m(factor, mscale) / m(factor, mscale_all_dim)` when both are given,
else `m(factor)`, with `m(s, a) = 1 + 0.1 a ln(s)` (1 for s <= 1). The
attention softmax scale is multiplied by `softmax_scale_factor` =
`m(factor, mscale_all_dim)^2` when `mscale_all_dim` is given. As in
transformers, 0 is "not given" for `mscale` and `mscale_all_dim`.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

SCALING_TYPES = ("none", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE scaling (`config.model.rope_scaling`), validated.

  Field names and meanings follow `transformers`' `rope_parameters`; no
  field defaults to None, so that the sub-section is a plain ConfigDict.
  """
  # "none" (plain RoPE; the other fields are unused) or "yarn".
  type: str = "none"
  # Context extension factor (> 0): interpolated frequencies are f / factor.
  factor: float = 1.0
  # Pretraining context (tokens) the ramp is measured in; yarn needs it > 0.
  original_max_position_embeddings: int = 0
  # Pairs making more than beta_fast rotations in that context keep their
  # frequency, fewer than beta_slow are interpolated (both > 0).
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  # Floor/ceil the ramp's ends to whole pair indices.
  truncate: bool = True
  # Multiplier of cos and sin (>= 0); 0 = derived from the mscales.
  attention_factor: float = 0.0
  # YaRN's magnitude scales; 0 = not given (see the module docstring).
  mscale: float = 0.0
  mscale_all_dim: float = 0.0

  def __post_init__(self):
    if self.type not in SCALING_TYPES:
      raise ValueError(f"rope_scaling.type must be one of {SCALING_TYPES}, "
                       f"got {self.type!r}.")
    if self.type == "none":
      return
    n = self.original_max_position_embeddings
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
      raise ValueError(f"rope_scaling.original_max_position_embeddings must "
                       f"be a positive int with type {self.type!r}, got "
                       f"{n!r}.")
    object.__setattr__(self, "original_max_position_embeddings", int(n))
    for name in ("factor", "beta_fast", "beta_slow"):
      if not getattr(self, name) > 0:
        raise ValueError(f"rope_scaling.{name} must be > 0, got "
                         f"{getattr(self, name)!r}.")
    if not self.attention_factor >= 0:
      raise ValueError(f"rope_scaling.attention_factor must be >= 0 (0: "
                       f"derived), got {self.attention_factor!r}.")
    for name in ("mscale", "mscale_all_dim"):
      if not math.isfinite(getattr(self, name)):
        raise ValueError(f"rope_scaling.{name} must be a finite number, "
                         f"got {getattr(self, name)!r}.")

  @property
  def active(self) -> bool:
    return self.type != "none"


NO_SCALING = RopeScaling()


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction `1 + 0.1 mscale ln(scale)` (1 if
  scale <= 1)."""
  if scale <= 1:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(rotations: float, R: int, theta: float,
                    context: int) -> float:
  """The (fractional) pair index whose frequency makes `rotations` turns in
  `context` tokens."""
  return (R * math.log(context / (rotations * 2 * math.pi))
          / (2 * math.log(theta)))


def _ramp(R: int, theta: float, s: RopeScaling) -> np.ndarray:
  """YaRN's interpolation weight per pair: [R/2] float64 in [0, 1]."""
  n = s.original_max_position_embeddings
  lo = _correction_dim(s.beta_fast, R, theta, n)
  hi = _correction_dim(s.beta_slow, R, theta, n)
  if s.truncate:
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, R - 1)
  if lo == hi:
    hi += 0.001   # As transformers: no division by zero.
  return np.clip((np.arange(R // 2, dtype=np.float64) - lo) / (hi - lo),
                 0.0, 1.0)


def inv_frequencies(R: int, theta: float,
                    scaling: RopeScaling = NO_SCALING) -> np.ndarray:
  """The inverse frequencies `f'_i` of the R/2 pairs: [R/2] float64."""
  f = 1.0 / theta ** (np.arange(0, R, 2, dtype=np.float64) / R)
  if not scaling.active:
    return f
  ramp = _ramp(R, theta, scaling)
  return f / scaling.factor * ramp + f * (1.0 - ramp)


def rope_attention_factor(scaling: RopeScaling) -> float:
  """The multiplier of cos and sin (1 without scaling)."""
  if not scaling.active:
    return 1.0
  if scaling.attention_factor:
    return float(scaling.attention_factor)
  if scaling.mscale and scaling.mscale_all_dim:
    return (yarn_mscale(scaling.factor, scaling.mscale)
            / yarn_mscale(scaling.factor, scaling.mscale_all_dim))
  return yarn_mscale(scaling.factor)


def softmax_scale_factor(scaling: RopeScaling) -> float:
  """The multiplier of the attention softmax scale (1 without scaling)."""
  if not scaling.active or not scaling.mscale_all_dim:
    return 1.0
  return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def apply_rope(x: jax.Array, positions: jax.Array, theta: float,
               scaling: RopeScaling = NO_SCALING) -> jax.Array:
  """Rotates `x` by its positions.

  Args:
    x: [B,T,H,R] with R even.
    positions: [B,T] int positions (per document).
    theta: RoPE base.
    scaling: the RoPE scaling (YaRN's frequencies and factor).

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
  if scaling.active:
    inv_freq = jnp.asarray(inv_frequencies(R, theta, scaling), jnp.float32)
  else:   # Kept as it was: runs without scaling stay bit-identical.
    inv_freq = theta ** (-jnp.arange(0, R, 2, dtype=jnp.float32) / R)
  angle_BTR = positions.astype(jnp.float32)[:, :, None] * inv_freq
  cos = jnp.cos(angle_BTR)[:, :, None, :]
  sin = jnp.sin(angle_BTR)[:, :, None, :]
  if scaling.active:
    factor = rope_attention_factor(scaling)
    cos, sin = cos * factor, sin * factor
  x32 = x.astype(jnp.float32).reshape(*x.shape[:-1], R // 2, 2)
  x_even, x_odd = x32[..., 0], x32[..., 1]
  out = jnp.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos],
                  axis=-1)
  return out.reshape(x.shape).astype(x.dtype)
