"""Segment-id helpers shared by every layer (RFC-0026 packing convention).

Shape glossary: B batch rows, T tokens per row.

`segment_ids [B,T]` are int document ids, 1-based, with 0 marking padding.
As in `kda_lm.ops.chunk_kda`, a new segment starts wherever the id differs
from the previous token's id (and at t = 0). Every layer uses this one
definition, so the KDA state reset, the convolution window, the attention
mask and the RoPE positions agree on where a document begins, even for
layouts the packer never produces (padding between documents, a document
split by padding, ids reused later in the row).
"""

import jax
import jax.numpy as jnp


def starts(segment_ids: jax.Array) -> jax.Array:
  """Returns [B,T] bool, True where a segment (or a padding run) begins."""
  seg = segment_ids.astype(jnp.int32)
  prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  return seg != prev


def run_ids(segment_ids: jax.Array) -> jax.Array:
  """Returns [B,T] int32, a distinct id per contiguous run of equal ids.

  Two tokens have the same run id iff they lie in the same contiguous run of
  equal segment ids, i.e. the same document in the sense of `chunk_kda`.
  """
  return jnp.cumsum(starts(segment_ids).astype(jnp.int32), axis=1)


def offsets(segment_ids: jax.Array) -> jax.Array:
  """Returns [B,T] int32, each token's index inside its run (0 at a start)."""
  T = segment_ids.shape[1]
  t_T = jnp.arange(T, dtype=jnp.int32)[None, :]
  start_t = jnp.where(starts(segment_ids), t_T, 0)
  return t_T - jax.lax.cummax(start_t, axis=1)


def positions_from_segment_ids(segment_ids: jax.Array) -> jax.Array:
  """Per-document positions: restart at 0 per document, 0 on padding.

  Args:
    segment_ids: [B,T] int document ids (0 = padding).

  Returns:
    [B,T] int32 positions, equal to the `positions` feature of
    `data.packing` for rows it packs.
  """
  return jnp.where(segment_ids == 0, 0, offsets(segment_ids))
