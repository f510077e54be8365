"""Shared pytest setup.

`kda_lm` is imported first so that its XLA:CPU flags (see kda_lm/__init__.py)
are in place before any test initialises a JAX backend.
"""

import kda_lm  # noqa: F401  (side effect: XLA flags)  # isort: skip
import jax
from jax.experimental.compilation_cache import compilation_cache
import process_support
import pytest


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
  with process_support.most_optimizations_disabled():
    yield


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  """A persistent compilation cache for a test module, shared with its
  subprocesses: a program compiled again (a resumed run) is read back."""
  path = str(tmp_path_factory.mktemp("jax_cache"))
  old = (jax.config.jax_compilation_cache_dir,
         jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  yield path
  jax.config.update("jax_compilation_cache_dir", old[0])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
  compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """A module's TFDS data directory (built datasets are reused within it)."""
  return str(tmp_path_factory.mktemp("tfds"))
