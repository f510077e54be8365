"""The oracle: KDA as a token-by-token `lax.scan` in float32.

Obviously correct by construction: it is the recurrence of the paper, one
token at a time, with the document reset applied by an explicit `where`.
Slow, and its autodiff stores one [B,H,K,V] state per token; use it to test,
never to train.
"""

import jax
import jax.numpy as jnp


def kda_recurrent(q, k, v, g, beta, masks, h0, scale):
  """Runs the recurrence over canonical inputs (see `common`).

  Args:
    q, k, g: [B,T,H,K] float32, zero at padding.
    v: [B,T,H,V] float32.
    beta: [B,T,H] float32.
    segs: `common.Segments` with `pad` and `reset` [B,T] bool.
    h0: [B,H,K,V] float32 state entering each row's first segment.
    scale: float multiplying q.

  Returns:
    o [B,T,H,V] float32 (zero at padding) and the final state [B,H,K,V].
  """
  def step(S, x):
    q_t, k_t, v_t, g_t, b_t, reset_t, pad_t = x  # q_t [B,H,K], b_t [B,H]
    S = jnp.where(reset_t[:, None, None, None], 0.0, S)
    S_dec = S * jnp.exp(g_t)[..., None]
    kS = jnp.einsum("bhk,bhkv->bhv", k_t, S_dec)
    d = b_t[..., None] * (v_t - kS)
    S_new = S_dec + k_t[..., :, None] * d[..., None, :]
    o_t = scale * jnp.einsum("bhk,bhkv->bhv", q_t, S_new)
    S = jnp.where(pad_t[:, None, None, None], S, S_new)
    o_t = jnp.where(pad_t[:, None, None], 0.0, o_t)
    return S, o_t

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in
             (q, k, v, g, beta, masks.reset, masks.pad))
  final, o = jax.lax.scan(step, h0, xs)
  return jnp.moveaxis(o, 0, 1), final
