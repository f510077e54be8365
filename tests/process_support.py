"""The tests' processes: where the repository is, the XLA:CPU code
generation the whole suite uses, the in-process switch of XLA's
optimizations (the `fast_compile` fixture's) and the environment of a
test's Python subprocess.

Light on purpose (JAX and the library's multi-host module, no TensorFlow):
conftest.py imports it in every test process.
"""

import contextlib
import os

import jax

from kda_lm.parallel import distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# XLA:CPU's older (non-MLIR) fusion code generation: the suite's programs
# compile in about 0.6x the time (the tiny model's loss and gradient in
# `parallel_context_checks.py model`: 30 s of compiling to 18 s, the run
# 46 s to 34 s), which compile mostly without XLA's optimizations. Not for
# users: with the optimizations on it compiles slower (ling3_tiny's train.py
# start-up 31-33 s to 41-42 s on this suite's 2-core host). Set for every
# test process and, through the environment, every subprocess;
# `USER_CPU_CODEGEN` undoes it for one program (the tests of what a user's
# CPU run compiles).
SUITE_XLA_FLAG = "--xla_cpu_use_fusion_emitters=false"
# `jax.jit(..., compiler_options=USER_CPU_CODEGEN)`: XLA:CPU's default
# code generation for that program.
USER_CPU_CODEGEN = {"xla_cpu_use_fusion_emitters": True}


def use_suite_cpu_codegen():
  """Appends `SUITE_XLA_FLAG` to XLA_FLAGS; call before JAX starts its
  backends (conftest.py does, on import)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if SUITE_XLA_FLAG not in flags.split():
    os.environ["XLA_FLAGS"] = f"{flags} {SUITE_XLA_FLAG}".strip()


@contextlib.contextmanager
def most_optimizations_disabled(disabled: bool = True):
  """Sets `jax_disable_most_optimizations` inside, restoring it after.

  The flag is read when compiling and is not part of jit's cache key: a
  function compiled before keeps its executable.
  """
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", disabled)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", previous)


def subprocess_env(cache_dir: str | None = None, xla_flags: str = ""
                   ) -> dict[str, str]:
  """The environment of a test's Python subprocess (train.py, checks).

  The repository on PYTHONPATH, CPU only, most XLA optimizations skipped
  (tiny shapes, where compilation dominates; as the tests' `fast_compile`
  fixture), no CPU-collectives choice inherited (multi-process runs pick
  gloo themselves).

  Args:
    cache_dir: a persistent compilation cache shared by the subprocesses
      (every compile cached), or None.
    xla_flags: appended to XLA_FLAGS (e.g. fake device counts).

  Returns:
    A copy of `os.environ` with those settings.
  """
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  if cache_dir is not None:
    env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
  env.pop(distributed.CPU_COLLECTIVES_ENV, None)
  return env
