"""Tests of kda_lm/layers/conv.py: exact values, document resets, causality."""

import haiku as hk
import jax
import numpy as np
import pytest

from kda_lm.layers import conv

# w[J-1] multiplies the current token, w[0] the token J-1 steps back, so a
# digit of the output names the tap: y[t] = x[t] + 10 x[t-1] + 100 x[t-2] ...
W_DIGITS = np.array([[1000.0], [100.0], [10.0], [1.0]], np.float32)  # [J,D]
X_1T1 = np.arange(1, 8, dtype=np.float32)[None, :, None]             # 1..7


def _apply(x, segment_ids=None, weight=None, activation=None,
           with_bias=False):
  f = hk.transform(lambda x, s: conv.ShortConvolution(
      4, with_bias=with_bias, activation=activation)(x, s))
  params = f.init(jax.random.key(0), x, segment_ids)
  if weight is not None:
    params = {"short_convolution": {**params["short_convolution"],
                                    "weight": weight}}
  return np.asarray(f.apply(params, None, x, segment_ids)), params


@pytest.mark.parametrize("segment_ids,expected", [
    (None, [1, 12, 123, 1234, 2345, 3456, 4567]),
    ([1, 1, 1, 1, 1, 2, 2], [1, 12, 123, 1234, 2345, 6, 67]),
    # Padding between documents: the 2nd document's window starts fresh.
    ([1, 1, 1, 0, 2, 2, 2], [1, 12, 123, 4, 5, 56, 567]),
    # A 1-token document shorter than the window, then a 2nd one.
    ([3, 4, 4, 4, 4, 4, 4], [1, 2, 23, 234, 2345, 3456, 4567]),
])
def test_exact_values(segment_ids, expected):
  seg = None if segment_ids is None else np.array([segment_ids], np.int32)
  y, _ = _apply(X_1T1, seg, W_DIGITS)
  np.testing.assert_array_equal(y[0, :, 0], np.array(expected, np.float32))


def test_silu_and_bias():
  seg = np.array([[1, 1, 1, 1, 1, 2, 2]], np.int32)
  bias = np.array([-2.0], np.float32)
  f = hk.transform(lambda x, s: conv.ShortConvolution(4, with_bias=True)(x, s))
  params = {"short_convolution": {"weight": W_DIGITS / 1000.0, "bias": bias}}
  y = np.asarray(f.apply(params, None, X_1T1, seg))[0, :, 0]
  lin = np.array([1, 12, 123, 1234, 2345, 6, 67], np.float64) / 1000.0 - 2.0
  np.testing.assert_allclose(y, lin / (1.0 + np.exp(-lin)), rtol=1e-6)


def test_default_init_and_shapes():
  x = np.ones((2, 5, 6), np.float32)
  y, params = _apply(x, activation="silu")
  assert y.shape == (2, 5, 6)
  w = params["short_convolution"]["weight"]
  assert w.shape == (4, 6) and w.dtype == np.float32
  assert np.all(np.abs(w) <= 0.5)  # PyTorch depthwise init: U(-1/2, 1/2).
  assert "bias" not in params["short_convolution"]


def test_packed_equals_documents_alone_bit_identical():
  rng = np.random.default_rng(0)
  lens = (2, 9, 5)
  x = rng.standard_normal((1, sum(lens) + 3, 8)).astype(np.float32)
  seg = np.zeros((1, x.shape[1]), np.int32)
  starts = np.cumsum((0,) + lens)
  for i, n in enumerate(lens):
    seg[0, starts[i]:starts[i] + n] = i + 1
  f = hk.transform(lambda x, s: conv.ShortConvolution(4)(x, s))
  params = f.init(jax.random.key(1), x, seg)
  packed = np.asarray(f.apply(params, None, x, seg))
  for i, n in enumerate(lens):
    alone = np.asarray(f.apply(params, None,
                               x[:, starts[i]:starts[i] + n], None))
    np.testing.assert_array_equal(packed[:, starts[i]:starts[i] + n], alone)


def test_causal():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((1, 12, 4)).astype(np.float32)
  seg = np.array([[1] * 7 + [2] * 5], np.int32)
  f = hk.transform(lambda x, s: conv.ShortConvolution(4)(x, s))
  params = f.init(jax.random.key(2), x, seg)
  base = np.asarray(f.apply(params, None, x, seg))
  for t in (0, 5, 7, 11):
    x2 = x.copy()
    x2[0, t] += 1.0
    y = np.asarray(f.apply(params, None, x2, seg))
    np.testing.assert_array_equal(y[:, :t], base[:, :t])
    assert np.all(y[0, t] != base[0, t])
    # The window reaches at most 3 tokens ahead, and never past a boundary.
    end = min(t + 4, 7 if t < 7 else 12)
    np.testing.assert_array_equal(y[:, end:], base[:, end:])


def test_bad_input():
  x = np.ones((1, 5, 2), np.float32)
  for kwargs, match in (({"kernel_size": 0}, "kernel_size"),
                        ({"activation": "gelu"}, "activation")):
    f = hk.transform(lambda x, kw=kwargs: conv.ShortConvolution(**kw)(x))
    with pytest.raises(ValueError, match=match):
      f.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="segment_ids"):
    _apply(np.ones((1, 5, 2), np.float32), np.ones((1, 4), np.int32))


def _conv_fns(weight=None, activation=None, with_bias=False):
  """(full, prefill, step) applies of one ShortConvolution(4)."""
  make = lambda: conv.ShortConvolution(4, with_bias=with_bias,
                                       activation=activation)
  full = hk.without_apply_rng(hk.transform(lambda x, s: make()(x, s)))
  prefill = hk.without_apply_rng(hk.transform(
      lambda x, s: make()(x, s, return_window=True)))
  step = hk.without_apply_rng(hk.transform(
      lambda x, w: make()(x, window=w)))
  return full, prefill, step


def _decode(prefill, step, params, x, seg, p):
  """Outputs of a prefill of p tokens, then one token at a time from the
  window: [B,T,D], and the windows after each step."""
  y, window = prefill.apply(params, x[:, :p], seg)
  outs, windows = [np.asarray(y)], [np.asarray(window)]
  for t in range(p, x.shape[1]):
    y, window = step.apply(params, x[:, t:t + 1], window)
    outs.append(np.asarray(y))
    windows.append(np.asarray(window))
  return np.concatenate(outs, axis=1), windows


# Prefix ids of 7 tokens; the decoded tokens continue the last document.
DECODE_PREFIXES = {
    "one_document": [1] * 7,
    "last_shorter_than_window": [1, 1, 1, 1, 1, 2, 2],
    "last_of_one_token": [1, 1, 1, 1, 1, 1, 2],
    "left_padding": [0, 0, 0, 0, 0, 3, 3],
    "padding_between": [1, 1, 1, 0, 2, 2, 2],
    "last_longer_than_window": [1, 1, 2, 2, 2, 2, 2],
}


@pytest.mark.parametrize("case", sorted(DECODE_PREFIXES))
def test_decode_window_equals_the_full_sequence_exact_digits(case):
  """Digit weights: y[t] names the taps, so any tap of the window taken
  from the wrong token (or from the previous document) changes a digit."""
  prefix = DECODE_PREFIXES[case]
  x = np.arange(1, 12, dtype=np.float32)[None, :, None]     # 1..11
  seg_full = np.array([prefix + [prefix[-1]] * 4], np.int32)
  full, prefill, step = _conv_fns()
  params = {"short_convolution": {"weight": W_DIGITS}}
  want = np.asarray(full.apply(params, x, seg_full))
  for p in (8, 7):
    got, windows = _decode(prefill, step, params, x, seg_full[:, :p], p)
    np.testing.assert_array_equal(got, want, err_msg=f"{case} p={p}")
  # The window after 7 tokens: the last document's last 3 inputs (inputs
  # are 1..7), zero before the document's start.
  n_last = 0
  while n_last < len(prefix) and prefix[-1 - n_last] == prefix[-1]:
    n_last += 1
  k = min(n_last, 3)
  want_window = np.zeros(3, np.float32)
  want_window[3 - k:] = np.arange(8 - k, 8)
  np.testing.assert_array_equal(windows[0][0, :, 0], want_window)
  # Then each step shifts the window by one token.
  np.testing.assert_array_equal(windows[1][0, :, 0],
                                np.r_[want_window[1:], 8.0])


def test_decode_equals_full_sequence_random_with_bias_and_silu():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((3, 12, 5)).astype(np.float32)
  seg = np.array([[1] * 12, [1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2],
                  [0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4]], np.int32)
  full, prefill, step = _conv_fns(activation="silu", with_bias=True)
  params = full.init(jax.random.key(3), x, seg)
  want = np.asarray(full.apply(params, x, seg))
  got, _ = _decode(prefill, step, params, x, seg[:, :5], 5)
  np.testing.assert_allclose(got[:, 5:], want[:, 5:], rtol=1e-6, atol=1e-6)
  # Row 2's prefill is all padding: an empty window, and the decoded
  # tokens start its document.
  np.testing.assert_allclose(got[:, :5], want[:, :5], rtol=1e-6, atol=1e-6)


def test_decode_window_shape_is_checked():
  _, _, step = _conv_fns()
  params = {"short_convolution": {"weight": W_DIGITS}}
  with pytest.raises(ValueError, match="window must be"):
    step.apply(params, np.ones((1, 1, 1), np.float32),
               np.zeros((1, 2, 1), np.float32))
