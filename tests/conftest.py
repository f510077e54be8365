"""Shared pytest setup.

`kda_lm` is imported first so that its XLA:CPU flags (see kda_lm/__init__.py)
are in place before any test initialises a JAX backend; then the suite's
own code-generation flag (`process_support.SUITE_XLA_FLAG`).
"""

import kda_lm  # noqa: F401  (side effect: XLA flags)  # isort: skip
import contextlib

import jax
from jax.experimental.compilation_cache import compilation_cache
import process_support
import pytest

process_support.use_suite_cpu_codegen()


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


# The settings of JAX's persistent compilation cache that the fixtures below
# change (and restore).
_CACHE_SETTINGS = ("jax_compilation_cache_dir",
                   "jax_persistent_cache_min_compile_time_secs",
                   "jax_compilation_cache_max_size")


@contextlib.contextmanager
def _compilation_cache(path: str, min_compile_s: float, max_size: int):
  """JAX's persistent compilation cache at `path` inside, the previous
  settings after (the cache started again on both sides: JAX reads its
  settings when it first uses it)."""
  old = [getattr(jax.config, name) for name in _CACHE_SETTINGS]
  new = (path, min_compile_s, max_size)
  for name, value in zip(_CACHE_SETTINGS, new, strict=True):
    jax.config.update(name, value)
  compilation_cache.reset_cache()
  try:
    yield path
  finally:
    for name, value in zip(_CACHE_SETTINGS, old, strict=True):
      jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.fixture(scope="session", autouse=True)
def suite_compilation_cache(tmp_path_factory, worker_id):
  """One persistent compilation cache for the whole run, shared by the
  test processes (xdist's workers): a program that several test modules
  compile the same way (the same model, shapes and XLA options; JAX's
  cache key) is compiled once. Programs that took over a second to
  compile (JAX's default threshold) are kept. A size limit, never reached,
  makes JAX lock the folder around each read and write, so that one
  worker never reads what the other is still writing. Subprocesses do not
  inherit it (`process_support.subprocess_env`)."""
  root = tmp_path_factory.getbasetemp()
  if worker_id != "master":   # Each worker's folder is beside the others'.
    root = root.parent
  path = root / "jax_suite_cache"
  path.mkdir(exist_ok=True)
  with _compilation_cache(str(path), 1.0, 8 << 30):
    yield


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  """A persistent compilation cache for a test module, shared with its
  subprocesses: a program compiled again (a resumed run) is read back.
  Every program is kept; no size limit (JAX's default)."""
  with _compilation_cache(str(tmp_path_factory.mktemp("jax_cache")), 0.0,
                          -1) as path:
    yield path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """A module's TFDS data directory (built datasets are reused within it)."""
  return str(tmp_path_factory.mktemp("tfds"))
