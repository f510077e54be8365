"""Where documents begin and end in a packed row: the one segment definition.

Shape glossary: B batch rows, T tokens per row.

`segment_ids [B,T]` are int document ids, 1-based, with 0 marking padding.
A new *piece* starts wherever the id differs from the previous token's id
(and at t = 0); a piece of id 0 is padding, any other piece is one segment
(one document, or the part of a document that padding has not interrupted).
Reused ids are new pieces: `1 1 0 1` holds the two segments `1 1` and `1`.

The op (`kda_lm.ops.kda.common`: state resets) and every layer (the
convolution window, the MLA mask, the MTP targets, the RoPE positions) build
on these functions, so all of them agree on where a document begins, even for
layouts the packer never produces (padding between documents, a document
split by padding, ids reused later in the row).

Names: a *piece id* (`piece_ids`) numbers the pieces of a row, padding
pieces included; the op's *state run* (`state_runs`) counts the state resets
before a token, so padding shares the run of the segment before it.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np


def check(segment_ids: Any, shape: tuple[int, ...],
          what: str = "segment_ids") -> Optional[jax.Array]:
  """The one validation of `segment_ids`; returns them as int32 (or None).

  Every entry point that takes segment ids (the model, each layer, the op)
  calls this and passes the result on, so the ids are checked and cast
  once per entry.

  Args:
    segment_ids: [B,T] int ids (1-based documents, 0 = padding), or None.
    shape: the (B, T) the ids must have.
    what: how to name the ids in a message.

  Raises:
    ValueError: not an array, another shape, a non-integer dtype, or
      (for concrete values) a negative id.
  """
  if segment_ids is None:
    return None
  if not hasattr(segment_ids, "shape") or not hasattr(segment_ids, "dtype"):
    raise ValueError(f"{what} must be a [B,T] integer array, got "
                     f"{type(segment_ids).__name__}.")
  if tuple(segment_ids.shape) != tuple(shape):
    raise ValueError(f"{what} must be [B,T] = {tuple(shape)}, got "
                     f"{tuple(segment_ids.shape)}.")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):  # bool is not.
    raise ValueError(f"{what} must be an integer array (int32), got dtype "
                     f"{segment_ids.dtype}.")
  try:
    ids = np.asarray(segment_ids)
  except (jax.errors.TracerArrayConversionError,
          jax.errors.ConcretizationTypeError, RuntimeError):
    ids = None  # Traced, or spread over other processes' devices.
  if ids is not None and ids.size and ids.min() < 0:
    raise ValueError(f"{what} must be >= 0 (1-based documents, 0 = "
                     f"padding); found {ids.min()}.")
  return jnp.asarray(segment_ids).astype(jnp.int32)


def starts(segment_ids: jax.Array) -> jax.Array:
  """Returns [B,T] bool, True where a piece (segment or padding) begins."""
  seg = segment_ids.astype(jnp.int32)
  prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  return seg != prev


def segment_starts(segment_ids: jax.Array) -> jax.Array:
  """Returns [B,T] bool, True at the first token of each (non-padding)
  segment."""
  return starts(segment_ids) & (segment_ids != 0)


def resets(segment_ids: jax.Array) -> jax.Array:
  """Returns [B,T] bool, True where a recurrent state is zeroed before the
  token: a segment start that is not the row's first segment (the first one
  starts from the initial state)."""
  first = segment_starts(segment_ids)
  return first & (jnp.cumsum(first.astype(jnp.int32), axis=1) > 1)


def state_runs(reset: jax.Array) -> jax.Array:
  """Returns [B,T] int32, the number of state resets up to each token.

  Two tokens of a row share a recurrent state chain iff their counts are
  equal (padding shares the count of the segment before it); the chunked
  op and the Pallas kernels mask their intra-chunk terms with it.
  """
  return jnp.cumsum(reset.astype(jnp.int32), axis=1)


def piece_ids(segment_ids: jax.Array) -> jax.Array:
  """Returns [B,T] int32 (1-based), a distinct id per piece of a row.

  Two tokens have the same piece id iff they lie in the same contiguous run
  of equal segment ids, i.e. the same document in the sense of `chunk_kda`.
  """
  return jnp.cumsum(starts(segment_ids).astype(jnp.int32), axis=1)


def offsets(segment_ids: jax.Array) -> jax.Array:
  """Returns [B,T] int32, each token's index inside its piece (0 at a
  start)."""
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


def same_segment_ahead(segment_ids: jax.Array | None, k: int,
                       shape: tuple[int, int]) -> jax.Array:
  """[B,T] bool: token i + k exists, is not padding and is in i's segment.

  Args:
    segment_ids: [B,T] int ids (0 = padding), or None (one segment per row).
    k: the distance ahead, >= 0.
    shape: (B, T).
  """
  B, T = shape
  within_row = jnp.broadcast_to(jnp.arange(T) + k < T, (B, T))
  if segment_ids is None:
    return within_row
  piece = piece_ids(segment_ids)
  ahead = jnp.roll(piece, -k, axis=1)
  return within_row & (ahead == piece) & (segment_ids != 0)
