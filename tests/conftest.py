"""Shared pytest setup.

`kda_lm` is imported first so that its XLA:CPU flags (see kda_lm/__init__.py)
are in place before any test initialises a JAX backend.
"""

import kda_lm  # noqa: F401  (side effect: XLA flags)  # isort: skip
import pytest

from kda_lm import testing


@pytest.fixture(scope="module")
def fast_compile():
  """Skips most XLA optimizations for a test module (tiny shapes, where
  compilation dominates); restores the setting afterwards. Use with
  `pytestmark = pytest.mark.usefixtures("fast_compile")`.

  The flag is read when compiling and is not part of jit's cache key, so a
  function compiled here and called again by a later module in the same
  process keeps its unoptimised executable: a speed effect only, except
  that two programs compiled with and without optimizations may round
  differently (tests of bit-identity between programs compile both fresh,
  e.g. `ops_kda_reference_test.py`).
  """
  with testing.most_optimizations_disabled():
    yield
