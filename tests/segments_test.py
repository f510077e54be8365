"""Tests of kda_lm/segments.py: one segment definition for the op and layers.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_lm import segments
from kda_lm.layers import mtp
from kda_lm.ops.kda import common

SEG = np.array([[1, 1, 2, 2, 2, 0, 0, 3, 3, 1]], np.int32)


def test_segment_helpers():
  np.testing.assert_array_equal(segments.offsets(SEG),
                                [[0, 1, 0, 1, 2, 0, 1, 0, 1, 0]])
  np.testing.assert_array_equal(segments.positions_from_segment_ids(SEG),
                                [[0, 1, 0, 1, 2, 0, 0, 0, 1, 0]])
  # A reused id later in the row is a new piece (as in chunk_kda).
  np.testing.assert_array_equal(segments.piece_ids(SEG),
                                [[1, 1, 2, 2, 2, 3, 3, 4, 4, 5]])
  np.testing.assert_array_equal(
      segments.segment_starts(SEG),
      [[1, 0, 1, 0, 0, 0, 0, 1, 0, 1]])


def test_op_resets_follow_the_same_definition():
  segs = common.segments_from_ids(jnp.asarray(SEG))
  np.testing.assert_array_equal(segs.pad, SEG == 0)
  # Every segment start but the row's first resets the state.
  np.testing.assert_array_equal(segs.reset,
                                [[0, 0, 1, 0, 0, 0, 0, 1, 0, 1]])
  np.testing.assert_array_equal(segments.state_runs(segs.reset),
                                [[0, 0, 1, 1, 1, 1, 1, 2, 2, 3]])


def test_same_segment_ahead_reused_id_after_padding():
  """`1 1 0 1` is two documents for MTP as for KDA and MLA."""
  seg = jnp.asarray([[1, 1, 0, 1, 1]], jnp.int32)
  for k, want in ((1, [1, 0, 0, 1, 0]), (2, [0, 0, 0, 0, 0]),
                  (0, [1, 1, 0, 1, 1])):
    np.testing.assert_array_equal(
        segments.same_segment_ahead(seg, k, (1, 5))[0], want, err_msg=k)
  np.testing.assert_array_equal(
      segments.same_segment_ahead(None, 2, (1, 5))[0], [1, 1, 1, 0, 0])


def test_mtp_targets_do_not_cross_a_reused_id():
  """MTP targets of `1 1 0 1` equal those of `1 1 0 2`."""
  targets = jnp.arange(1, 7, dtype=jnp.int32)[None]
  loss_mask = jnp.ones((1, 6), jnp.float32).at[0, 2].set(0.0)
  reused = jnp.asarray([[1, 1, 0, 1, 1, 1]], jnp.int32)
  fresh = jnp.asarray([[1, 1, 0, 2, 2, 2]], jnp.int32)
  for k in (1, 2, 3):
    got = mtp.targets_and_mask(targets, loss_mask, reused, k)
    want = mtp.targets_and_mask(targets, loss_mask, fresh, k)
    np.testing.assert_array_equal(got[1], want[1], err_msg=k)
  # Position 1 (first piece) never reads a target of the second piece.
  _, mask = mtp.targets_and_mask(targets, loss_mask, reused, 2)
  np.testing.assert_array_equal(mask[0], [0, 0, 0, 1, 0, 0])


def test_a_row_that_begins_with_padding():
  """Leading padding is a piece of its own: piece ids stay 1-based and
  t = 0 always starts a piece, whatever the first id."""
  seg = np.array([[0, 0, 1, 1, 0, 2]], np.int32)
  np.testing.assert_array_equal(segments.starts(seg),
                                [[1, 0, 1, 0, 1, 1]])
  np.testing.assert_array_equal(segments.piece_ids(seg),
                                [[1, 1, 2, 2, 3, 4]])
  np.testing.assert_array_equal(segments.offsets(seg),
                                [[0, 1, 0, 1, 0, 0]])
  np.testing.assert_array_equal(segments.resets(seg),
                                [[0, 0, 0, 0, 0, 1]])


def test_check_validates_once_and_casts_to_int32():
  """The one check of segment ids: shape, integer dtype, no negative id."""
  assert segments.check(None, (1, 10)) is None
  out = segments.check(SEG.astype(np.int16), (1, 10))
  assert out.dtype == jnp.int32
  np.testing.assert_array_equal(out, SEG)
  np.testing.assert_array_equal(segments.check(SEG + 1, (1, 10)), SEG + 1)
  for bad, message in ((SEG[:, :9], r"must be \[B,T\] = \(1, 10\)"),
                       (np.ones((1, 11), np.int32), r"got \(1, 11\)"),
                       (np.ones((2, 10), np.int32), r"got \(2, 10\)"),
                       (types.SimpleNamespace(shape=(1, 10)), "Namespace"),
                       (SEG.astype(np.float32), "integer array"),
                       (SEG.astype(bool), "integer array"),
                       (SEG - 1, "must be >= 0"),
                       ([[1, 2]], "integer array")):
    with pytest.raises(ValueError, match=message):
      segments.check(bad, (1, 10))
  # Traced ids cannot be inspected for negatives, but shape and dtype can.
  jax.jit(lambda s: segments.check(s, (1, 10)))(SEG)
  with pytest.raises(ValueError, match="integer array"):
    jax.jit(lambda s: segments.check(s, (1, 10)))(SEG.astype(np.float32))
