"""Tests of data/packing.py: exact rows (seqio style) and packing invariants."""

import numpy as np
import pytest
import tensorflow as tf

from data import packing

KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def _ragged(rows, dtype):
  lengths = [len(r) for r in rows]
  values = np.concatenate([np.asarray(r) for r in rows]).astype(dtype)
  return tf.RaggedTensor.from_row_lengths(values, lengths)


def _dataset(docs, masks=None):
  """Documents as a tf.data.Dataset of dicts (tokens [, loss_mask])."""
  features = {"tokens": _ragged(docs, np.int32)}
  if masks is not None:
    features["loss_mask"] = _ragged(masks, np.bool_)
  return tf.data.Dataset.from_tensor_slices(features)


def _rows(dataset, seq_len, **kwargs):
  rows = list(packing.pack_documents(dataset, seq_len, **kwargs)
              .as_numpy_iterator())
  return {k: np.array([r[k] for r in rows]).reshape(-1, seq_len)
          for k in KEYS}


def _assert_rows(actual, expected):
  for key in KEYS:
    np.testing.assert_array_equal(actual[key], np.array(expected[key]),
                                  err_msg=key)
    assert actual[key].dtype == packing.FEATURES[key].as_numpy_dtype, key


# d0: 2 pairs; d1: a 1-token document (no pair, dropped); d2: 6 pairs, longer
# than the row of 4 (split 4 + 2), starting with a real token 0; d3: 1 pair.
DOCS = [[1, 2, 3], [5], [0, 6, 7, 8, 9, 10, 11], [12, 13]]
MASKS = [[1, 0, 1], [1], [1, 0, 1, 1, 1, 1, 1], [0, 1]]


def test_exact_rows_first_fit():
  # First fit: d2's remainder goes back into row 0; d3 opens row 2, which
  # ends in padding.
  rows = _rows(_dataset(DOCS, MASKS), 4)
  _assert_rows(rows, {
      "inputs": [[1, 2, 9, 10], [0, 6, 7, 8], [12, 0, 0, 0]],
      "targets": [[2, 3, 10, 11], [6, 7, 8, 9], [13, 0, 0, 0]],
      "segment_ids": [[1, 1, 2, 2], [1, 1, 1, 1], [1, 0, 0, 0]],
      "positions": [[0, 1, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0]],
      # A target carries its own token's mask: pair j gets mask[j + 1].
      "loss_mask": [[0, 1, 1, 1], [0, 1, 1, 1], [1, 0, 0, 0]],
  })


def test_exact_rows_without_reset():
  rows = _rows(_dataset(DOCS, MASKS), 4, reset_at_document_boundaries=False)
  _assert_rows(rows, {
      "inputs": [[1, 2, 9, 10], [0, 6, 7, 8], [12, 0, 0, 0]],
      "targets": [[2, 3, 10, 11], [6, 7, 8, 9], [13, 0, 0, 0]],
      "segment_ids": [[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]],
      "positions": [[0, 1, 2, 3], [0, 1, 2, 3], [0, 0, 0, 0]],
      "loss_mask": [[0, 1, 1, 1], [0, 1, 1, 1], [1, 0, 0, 0]],
  })


def test_exact_rows_small_windows():
  # Windows of 2 documents: {d0, d1} and {d2, d3} are packed separately.
  rows = _rows(_dataset(DOCS, MASKS), 4, window_size=2)
  _assert_rows(rows, {
      "inputs": [[1, 2, 0, 0], [0, 6, 7, 8], [9, 10, 12, 0]],
      "targets": [[2, 3, 0, 0], [6, 7, 8, 9], [10, 11, 13, 0]],
      "segment_ids": [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 2, 0]],
      "positions": [[0, 1, 0, 0], [0, 1, 2, 3], [0, 1, 0, 0]],
      "loss_mask": [[0, 1, 0, 0], [0, 1, 1, 1], [1, 1, 1, 0]],
  })


def test_exact_rows_plain_tokens_and_exact_fit():
  # Plain tensors are tokens without a mask (all ones); a document of exactly
  # seq_len pairs fills a row, one with seq_len + 1 pairs needs two.
  docs = [[1, 2, 3, 4], [5, 6, 7, 8, 9], [20, 21]]
  ds = tf.data.Dataset.from_tensor_slices(_ragged(docs, np.int64))
  rows = _rows(ds, 3)
  _assert_rows(rows, {
      "inputs": [[1, 2, 3], [5, 6, 7], [8, 20, 0]],
      "targets": [[2, 3, 4], [6, 7, 8], [9, 21, 0]],
      "segment_ids": [[1, 1, 1], [1, 1, 1], [1, 2, 0]],
      "positions": [[0, 1, 2], [0, 1, 2], [0, 0, 0]],
      "loss_mask": [[1, 1, 1], [1, 1, 1], [1, 1, 0]],
  })


def test_split_documents_exact_pieces_and_same_rows():
  pieces = list(packing.split_documents(_dataset(DOCS, MASKS), 4)
                .as_numpy_iterator())
  # d2 (7 tokens, 6 pairs) -> tokens 0..4 and 4..6 (one token shared); d1
  # (one token) gives no piece.
  assert [p["tokens"].tolist() for p in pieces] == [
      [1, 2, 3], [0, 6, 7, 8, 9], [9, 10, 11], [12, 13]]
  assert [p["loss_mask"].tolist() for p in pieces] == [
      [1, 0, 1], [1, 0, 1, 1, 1], [1, 1, 1], [0, 1]]
  # Packed as documents, the pieces give exactly the rows of the documents
  # (`test_exact_rows_first_fit`'s).
  rows = _rows(packing.split_documents(_dataset(DOCS, MASKS), 4), 4)
  _assert_rows(rows, _rows(_dataset(DOCS, MASKS), 4))


def test_no_documents_no_rows():
  rows = list(packing.pack_documents(_dataset([[3], [4]]), 4))
  assert not rows


@pytest.mark.parametrize("reset", [True, False])
@pytest.mark.parametrize("seq_len,window_size", [(16, 1000), (16, 7),
                                                 (5, 3), (64, 50)])
def test_packing_properties(seq_len, window_size, reset):
  rng = np.random.default_rng(seq_len * 100 + window_size)
  num_docs = 150
  lengths = rng.integers(1, 41, size=num_docs)
  # Token i of document d is d * 1000 + i: unique, so every pair is traceable.
  docs = [list(d * 1000 + np.arange(n)) for d, n in enumerate(lengths)]
  masks = [list(rng.integers(0, 2, size=n)) for n in lengths]
  rows = _rows(_dataset(docs, masks), seq_len, window_size=window_size,
               reset_at_document_boundaries=reset)
  inputs, targets = rows["inputs"], rows["targets"]
  seg, pos, mask = rows["segment_ids"], rows["positions"], rows["loss_mask"]
  real = seg > 0
  assert real.any(axis=1).all()  # No empty row.

  seen = {}
  for r in range(inputs.shape[0]):
    n = real[r].sum()
    assert real[r, :n].all() and not real[r, n:].any()  # Trailing padding.
    for key in KEYS:
      assert not rows[key][r, n:].any(), key  # Padding is all zeros.
    if reset:
      # Segment ids 1..k, each a contiguous run; positions restart at 0.
      starts = np.flatnonzero(np.diff(np.concatenate([[0], seg[r, :n]])))
      np.testing.assert_array_equal(seg[r, starts], np.arange(len(starts)) + 1)
      np.testing.assert_array_equal(
          np.diff(seg[r, :n]) != 0, np.isin(np.arange(1, n), starts))
      bounds = list(starts) + [n]
    else:
      np.testing.assert_array_equal(seg[r, :n], 1)
      np.testing.assert_array_equal(pos[r, :n], np.arange(n))
      # Segments are still the document pieces, found from the tokens.
      bounds = [0] + [j for j in range(1, n)
                      if inputs[r, j] != inputs[r, j - 1] + 1] + [n]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
      x, y = inputs[r, a:b], targets[r, a:b]
      doc, first = divmod(int(x[0]), 1000)
      # A piece is a run of one document: targets follow inputs, never
      # crossing into another document.
      np.testing.assert_array_equal(x, x[0] + np.arange(b - a))
      np.testing.assert_array_equal(y, x + 1)
      assert (y // 1000 == doc).all()
      if reset:
        np.testing.assert_array_equal(pos[r, a:b], np.arange(b - a))
      np.testing.assert_array_equal(
          mask[r, a:b], np.array(masks[doc])[first + 1:first + 1 + b - a])
      seen.setdefault(doc, []).append((first, b - a))

  # Every pair of every document exactly once, in pieces of seq_len in order.
  expected = {d: n - 1 for d, n in enumerate(lengths) if n >= 2}
  assert sorted(seen) == sorted(expected)
  for doc, pieces in seen.items():
    pieces.sort()
    num = expected[doc]
    want = [(s, min(seq_len, num - s)) for s in range(0, num, seq_len)]
    if reset:
      assert pieces == want, doc
    else:  # Adjacent pieces of one document may touch; compare coverage.
      covered = np.concatenate([np.arange(s, s + k) for s, k in pieces])
      np.testing.assert_array_equal(covered, np.arange(num))
  # First fit: within a window at most one row is at most half full.
  tokens = sum(expected.values())
  half_full = (real.sum(axis=1) <= seq_len / 2).sum()
  assert half_full <= -(-num_docs // window_size)
  assert inputs.shape[0] < 2 * tokens / seq_len + half_full + 1


def test_errors():
  ds = _dataset([[1, 2, 3]])
  with pytest.raises(ValueError, match="seq_len"):
    packing.pack_documents(ds, 1)
  with pytest.raises(ValueError, match="window_size"):
    packing.pack_documents(ds, 4, window_size=0)
  floats = tf.data.Dataset.from_tensors({"tokens": tf.constant([1.0, 2.0])})
  with pytest.raises(TypeError, match="'tokens'.*float32"):
    packing.pack_documents(floats, 4)
  strings = tf.data.Dataset.from_tensors({"tokens": tf.constant(["a"])})
  with pytest.raises(TypeError, match="dtype"):
    packing.pack_documents(strings, 4)
  rank2 = tf.data.Dataset.from_tensors({"tokens": tf.constant([[1, 2]])})
  with pytest.raises(ValueError, match="rank 1"):
    packing.pack_documents(rank2, 4)
  bad_mask = tf.data.Dataset.from_tensors(
      {"tokens": tf.constant([1, 2]), "loss_mask": tf.constant(["x", "y"])})
  with pytest.raises(TypeError, match="'loss_mask'"):
    packing.pack_documents(bad_mask, 4)
  no_tokens = tf.data.Dataset.from_tensors({"ids": tf.constant([1, 2])})
  with pytest.raises(TypeError, match="'tokens'"):
    packing.pack_documents(no_tokens, 4)
  short_mask = tf.data.Dataset.from_tensors(
      {"tokens": tf.constant([1, 2, 3]), "loss_mask": tf.constant([1, 1])})
  with pytest.raises(tf.errors.InvalidArgumentError, match="differ in length"):
    list(packing.pack_documents(short_mask, 4))
