"""Timing helpers shared by the benchmarks (no flags: importable by any).

`median_seconds` times a function's calls after a warm-up; `matmul_rate` is
the device's rate on one large square matmul, the reference the benchmarks
report their rates against (machines are noisy: ratios in one run).
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_seconds(fn, args, repeats):
  """The median seconds of `fn(*args)` over `repeats` calls after one."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def matmul_rate(n, dtype=jnp.bfloat16, repeats=5):
  """FLOP/s of an n x n x n matmul in `dtype` on the default device."""
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype)
  return 2 * n ** 3 / median_seconds(jax.jit(lambda x: x @ x), (a,),
                                     repeats)
