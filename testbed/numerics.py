"""The error metric shared by the tests and the benchmarks, and the numpy
logistic functions.

`rel_err(a, b) = ||a - b||_2 / ||b||_2` over the whole array, in float64 (0
when both are exactly zero). A norm-wise error does not blow up on the many
entries that are near zero (where an element-wise rtol is meaningless) and
is invariant to the array's size and scale; it is FLA's `get_err_ratio`
(relative RMS).
"""

from typing import Any

import numpy as np


def rel_err(a: Any, b: Any) -> float:
  """`||a - b||_2 / ||b||_2` in float64; 0 if both are exactly zero, inf if
  only `b` is.

  Raises:
    AssertionError: the shapes differ.
  """
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  assert a.shape == b.shape, (a.shape, b.shape)
  num = np.linalg.norm((a - b).ravel())
  den = np.linalg.norm(b.ravel())
  if den == 0.0:
    return 0.0 if num == 0.0 else float("inf")
  return float(num / den)


def sigmoid(x):
  """The logistic function, in numpy."""
  return 1.0 / (1.0 + np.exp(-x))


def logsigmoid(x):
  """log(sigmoid(x)), in numpy, stable for large |x|."""
  return -np.logaddexp(0.0, -x)
