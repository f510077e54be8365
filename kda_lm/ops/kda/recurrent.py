"""`recurrent_kda`: KDA token by token from a given state (decoding).

Shape glossary: B batch rows, T tokens (1 when decoding), H heads,
K key/query head dim, V value head dim.

The closed-form recurrence of the oracle (`reference.kda_recurrent`) on the
same canonical inputs as `chunk_kda` (`common.canonicalize`: in-kernel gate,
L2-normalised q and k), for rows without document boundaries or padding:
a decode step continues the state a chunked prefill returned
(`chunk_kda(..., output_final_state=True)`). Cost per token O(H*K*V),
whatever the length before it.
"""

from typing import Optional

import jax
import jax.numpy as jnp

from kda_lm.ops.kda import common, reference


def recurrent_kda(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                  beta: jax.Array, initial_state: jax.Array, *,
                  A_log: jax.Array, dt_bias: Optional[jax.Array],
                  lower_bound: Optional[float] = None,
                  scale: Optional[float] = None
                  ) -> tuple[jax.Array, jax.Array]:
  """Runs KDA over `T` tokens per row, starting from `initial_state`.

  The gate and the q/k normalisation are those of `chunk_kda(...,
  use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)`.

  Args:
    q: [B,T,H,K] queries.
    k: [B,T,H,K] keys.
    v: [B,T,H,V] values.
    g: [B,T,H,K] raw gate projection.
    beta: [B,T,H] write strengths.
    initial_state: [B,H,K,V] state before the first token.
    A_log: [H] float32 gate parameter.
    dt_bias: [H*K] float32 gate bias or None.
    lower_bound: None = the softplus gate, else the bounded gate's bound.
    scale: query scale; default K**-0.5.

  Returns:
    `(o [B,T,H,V] in q's dtype, final state [B,H,K,V] float32)`.

  Raises:
    ValueError: `initial_state` is not [B,H,K,V].
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  if initial_state.shape != (B, H, K, V):
    raise ValueError(f"initial_state must be [B,H,K,V] = {(B, H, K, V)}, "
                     f"got {initial_state.shape}.")
  no_BT = jnp.zeros((B, T), bool)
  masks = common.Segments(pad=no_BT, reset=no_BT)
  q32, k32, v32, g32, beta32 = common.canonicalize(
      q, k, v, g, beta, masks, A_log=A_log, dt_bias=dt_bias,
      lower_bound=lower_bound, use_gate_in_kernel=True,
      use_qk_l2norm_in_kernel=True)
  scale = float(K ** -0.5 if scale is None else scale)
  o, state = reference.kda_recurrent(q32, k32, v32, g32, beta32, masks,
                                     initial_state.astype(jnp.float32),
                                     scale)
  return o.astype(q.dtype), state
