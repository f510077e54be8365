"""Packs variable-length documents into fixed rows with segment ids.

`pack_documents` turns a `tf.data.Dataset` of documents into a dataset of
fixed-length rows, the layout the KDA/MLA model consumes:

* Per document with tokens `t[0..L-1]` it forms `L-1` input/target pairs
  `inputs = t[:-1]`, `targets = t[1:]`, so no target ever crosses a document
  boundary. A document with fewer than 2 tokens has no pair and is dropped
  (it never becomes an empty segment). The optional per-token `loss_mask`
  travels with the target: pair `j` gets `loss_mask[j + 1]`.
* A document with more than `seq_len` pairs is split into pieces of `seq_len`
  pairs plus a remainder; nothing is truncated away. Each piece is a segment
  of its own (the model cannot attend across rows anyway), so its positions
  restart at 0.
* Pieces are packed greedily, first fit, within windows of `window_size`
  consecutive documents: each piece goes into the first row of the window that
  still has room, else into a new row. Rows are emitted in the order in which
  they were opened. Pieces are appended, so within a row segments are
  contiguous and padding is only at the end of the row.

Each output element is a dict of `[seq_len]` tensors:

* `inputs`, `targets` (int32): the token pairs, 0 on padding.
* `segment_ids` (int32): 1..n for the n segments of the row in order, 0 on
  padding (derived from document structure, never from token values, so a
  real token 0 is never mistaken for padding).
* `positions` (int32): position in the segment, restarting at 0; 0 on padding.
* `loss_mask` (float32): the document's loss mask on real targets (1 when the
  document has no `loss_mask`), 0 on padding.

With `reset_at_document_boundaries=False` the row is treated as one sequence
(Megatron's `reset_attention_mask=False`): every real token gets segment id 1
and its position is its index in the row (0..n-1); padding still has segment
0, position 0 and loss mask 0, and targets still never cross documents, so the
loss of the two modes is directly comparable.

The pipeline uses graph ops only (no `from_generator`/`py_function`), so the
iterator over it can be saved with `tf.train.Checkpoint`.
"""

from typing import Any

import tensorflow as tf

# Keys of the packed rows, with their dtypes.
FEATURES = {
    "inputs": tf.int32,
    "targets": tf.int32,
    "segment_ids": tf.int32,
    "positions": tf.int32,
    "loss_mask": tf.float32,
}

DEFAULT_WINDOW_SIZE = 512

_TOKEN_DTYPES = (tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8, tf.uint16,
                 tf.uint32)
_MASK_DTYPES = (tf.bool, tf.float16, tf.bfloat16, tf.float32, tf.float64) + (
    _TOKEN_DTYPES)


def _check_spec(spec: Any) -> bool:
  """Validates the documents' element spec.

  Args:
    spec: `element_spec` of the documents dataset.

  Returns:
    Whether the documents carry a `loss_mask`.

  Raises:
    TypeError: the element is not a tensor or a dict with `tokens`, or a
      feature has the wrong dtype.
    ValueError: a feature is not of rank 1.
  """
  if isinstance(spec, (tf.TensorSpec, tf.RaggedTensorSpec)):
    spec = {"tokens": spec}
  if not isinstance(spec, dict) or "tokens" not in spec:
    raise TypeError(
        "pack_documents expects a dataset of dicts with a 'tokens' feature "
        f"(int32 [L]) and an optional 'loss_mask' [L]; got {spec}.")
  for key, dtypes in (("tokens", _TOKEN_DTYPES), ("loss_mask", _MASK_DTYPES)):
    if key not in spec:
      continue
    feature = spec[key]
    if not isinstance(feature, (tf.TensorSpec, tf.RaggedTensorSpec)):
      raise TypeError(f"Document feature {key!r} must be a tensor, got "
                      f"{feature}.")
    if feature.dtype not in dtypes:
      raise TypeError(
          f"Document feature {key!r} must have an integer dtype"
          f"{' or bool/float' if key == 'loss_mask' else ''} (int32 "
          f"preferred), got {feature.dtype.name}.")
    if feature.shape.rank != 1:
      raise ValueError(
          f"Document feature {key!r} must have rank 1 ([L], one document per "
          f"element; unbatch first), got shape {feature.shape}.")
  return "loss_mask" in spec


def _dense(x: tf.Tensor | tf.RaggedTensor) -> tf.Tensor:
  return x.to_tensor() if isinstance(x, tf.RaggedTensor) else x


def _to_ragged(x: tf.Tensor | tf.RaggedTensor) -> tf.RaggedTensor:
  if isinstance(x, tf.RaggedTensor):
    return x
  return tf.RaggedTensor.from_tensor(x)


def _first_fit(piece_len: tf.Tensor, seq_len: int):
  """Assigns pieces to rows, first fit in order.

  Args:
    piece_len: int32 [P], each in 1..seq_len.
    seq_len: row length.

  Returns:
    (row, offset, segment) int32 [P] each: the row of each piece, its start in
    the row and its 1-based segment index in the row.
  """
  num = tf.shape(piece_len)[0]
  # At most one row per piece; unopened rows have all seq_len slots free, so
  # the first row with room is an open one if any fits, else the next new one.
  free0 = tf.fill([num], tf.constant(seq_len, tf.int32))
  count0 = tf.zeros([num], tf.int32)
  ta = lambda: tf.TensorArray(tf.int32, size=num, element_shape=[])

  def body(i, free, count, rows, offsets, segments):
    length = piece_len[i]
    row = tf.argmax(tf.cast(free >= length, tf.int32), output_type=tf.int32)
    offset = seq_len - free[row]
    segment = count[row] + 1
    onehot = tf.one_hot(row, num, dtype=tf.int32)
    return (i + 1, free - length * onehot, count + onehot,
            rows.write(i, row), offsets.write(i, offset),
            segments.write(i, segment))

  _, _, _, rows, offsets, segments = tf.while_loop(
      lambda i, *_: i < num, body,
      (tf.constant(0), free0, count0, ta(), ta(), ta()),
      parallel_iterations=1)
  return rows.stack(), offsets.stack(), segments.stack()


def _pack_window(batch: dict[str, Any], seq_len: int, has_mask: bool,
                 reset: bool) -> dict[str, tf.Tensor]:
  """Packs one window of documents into rows [B,T] (T = seq_len)."""
  tokens = _to_ragged(batch["tokens"])
  tokens = tokens.with_row_splits_dtype(tf.int32)
  tokens = tf.ragged.map_flat_values(tf.cast, tokens, tf.int32)
  if has_mask:
    mask = _to_ragged(batch["loss_mask"]).with_row_splits_dtype(tf.int32)
    tf.debugging.assert_equal(
        mask.row_lengths(), tokens.row_lengths(),
        message="Document features 'loss_mask' and 'tokens' differ in length")
    mask = tf.ragged.map_flat_values(tf.cast, mask, tf.float32)
  else:
    mask = tf.ragged.map_flat_values(tf.ones_like, tokens, dtype=tf.float32)

  # Pairs; documents with fewer than 2 tokens get 0 pairs.
  inputs = tokens[:, :-1]
  targets = tokens[:, 1:]
  mask = mask[:, 1:]
  lengths = inputs.row_lengths()  # int32 [N]

  # Split documents into pieces of at most seq_len pairs.
  num_pieces = (lengths + seq_len - 1) // seq_len
  piece_doc = tf.repeat(tf.range(tf.shape(lengths)[0]), num_pieces)
  piece_rank = tf.ragged.range(num_pieces).flat_values
  piece_len = tf.minimum(seq_len,
                         tf.gather(lengths, piece_doc) - piece_rank * seq_len)

  row, offset, segment = _first_fit(piece_len, seq_len)
  num_rows = tf.reduce_max(tf.concat([row, [-1]], 0)) + 1

  # Per pair: its piece, its position in the piece and its slot.
  pair_piece = tf.repeat(tf.range(tf.shape(piece_len)[0]), piece_len)
  pair_pos = tf.ragged.range(piece_len).flat_values
  pair_offset = tf.gather(offset, pair_piece) + pair_pos
  slot = tf.gather(row, pair_piece) * seq_len + pair_offset
  if reset:
    pair_segment = tf.gather(segment, pair_piece)
    pair_position = pair_pos
  else:
    pair_segment = tf.ones_like(pair_pos)
    pair_position = pair_offset

  index = slot[:, None]
  shape = [num_rows * seq_len]
  values = {
      "inputs": inputs.flat_values,
      "targets": targets.flat_values,
      "segment_ids": pair_segment,
      "positions": pair_position,
      "loss_mask": mask.flat_values,
  }
  return {
      key: tf.reshape(tf.scatter_nd(index, value, shape), [-1, seq_len])
      for key, value in values.items()
  }


def split_documents(documents: tf.data.Dataset, seq_len: int
                    ) -> tf.data.Dataset:
  """Cuts documents into the pieces `pack_documents` would make of them.

  Piece `k` of a document holds tokens `[k * seq_len, (k + 1) * seq_len]`
  (`seq_len + 1` tokens, the last piece fewer): consecutive pieces share one
  token, so each piece has the same `seq_len` input/target pairs as the
  packer's piece `k`, and packing the pieces as documents gives the same
  segments, positions and loss masks. Documents with fewer than 2 tokens
  give no piece.

  Args:
    documents: dataset of dicts with `tokens` [L] and optionally
      `loss_mask` [L] (other keys are dropped).
    seq_len: row length (pairs per piece), >= 2.

  Returns:
    A dataset of such dicts, one piece each, in document order.

  Raises:
    ValueError, TypeError: as `pack_documents`.
  """
  if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
    raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}.")
  has_mask = _check_spec(documents.element_spec)
  keys = ("tokens", "loss_mask") if has_mask else ("tokens",)

  def pieces(doc):
    if not isinstance(doc, dict):
      doc = {"tokens": doc}
    doc = {k: _dense(doc[k]) for k in keys}
    length = tf.shape(doc["tokens"], out_type=tf.int32)[0]
    pairs = tf.maximum(length - 1, 0)
    starts = tf.range((pairs + seq_len - 1) // seq_len) * seq_len
    index = tf.ragged.range(starts, tf.minimum(starts + seq_len + 1, length),
                            row_splits_dtype=tf.int32)
    return {k: tf.gather(doc[k], index) for k in keys}

  # Each document becomes a ragged batch of its pieces, then one element per
  # piece (cheaper per document than a dataset per document).
  return documents.map(pieces).unbatch()


def pack_documents(documents: tf.data.Dataset,
                   seq_len: int,
                   *,
                   reset_at_document_boundaries: bool = True,
                   window_size: int = DEFAULT_WINDOW_SIZE,
                   num_parallel_calls: int | None = None) -> tf.data.Dataset:
  """Packs a dataset of documents into fixed rows of `seq_len` pairs.

  See the module docstring for the exact layout.

  Args:
    documents: dataset whose elements are dicts with `tokens` (integer [L],
      one document) and optionally `loss_mask` ([L], bool/int/float: which
      tokens are worth predicting); other keys are ignored. A plain integer
      tensor element is taken as `tokens`.
    seq_len: row length (number of input/target pairs per row), >= 2.
    reset_at_document_boundaries: emit per-document segment ids and positions
      (True) or one segment with running positions per row (False).
    window_size: number of consecutive documents packed together. Larger
      windows fill rows better and cost more memory; aim for tens of rows'
      worth of tokens.
    num_parallel_calls: parallelism of the window packing map (deterministic
      order either way); None packs sequentially.

  Returns:
    A dataset of dicts of `[seq_len]` tensors: int32 `inputs`, `targets`,
    `segment_ids`, `positions` and float32 `loss_mask`.

  Raises:
    ValueError: `seq_len < 2`, `window_size < 1`, or a feature of rank != 1.
    TypeError: a feature of the wrong dtype, or no `tokens` feature.
  """
  if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
    raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}.")
  if not isinstance(window_size, int) or window_size < 1:
    raise ValueError(f"window_size must be an int >= 1, got {window_size!r}.")
  has_mask = _check_spec(documents.element_spec)
  keys = ("tokens", "loss_mask") if has_mask else ("tokens",)
  if isinstance(documents.element_spec, dict):
    documents = documents.map(lambda d: {k: _dense(d[k]) for k in keys})
  else:
    documents = documents.map(lambda t: {"tokens": _dense(t)})

  windows = documents.ragged_batch(window_size, row_splits_dtype=tf.int32)
  pack = lambda b: _pack_window(b, seq_len, has_mask,
                                reset_at_document_boundaries)
  if num_parallel_calls is None:
    rows = windows.map(pack)
  else:
    rows = windows.map(pack, num_parallel_calls=num_parallel_calls,
                       deterministic=True)
  return rows.unbatch()
