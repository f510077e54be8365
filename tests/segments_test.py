"""Tests of kda_lm/segments.py: one segment definition for the op and layers.
"""

import jax.numpy as jnp
import numpy as np

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
