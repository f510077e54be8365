r"""Compiled cost of the routed experts' grouped matmul against `ragged_dot`.

For M rows (token, expert pairs) of width K -> N over E experts (bfloat16,
rows spread evenly over the experts), compiles the forward and the
gradient (both operands) of `kda_lm.ops.gmm.gmm` with each implementation
for each target, without running anything, and prints the compiled FLOPs
and temporaries against the useful work (`2 M K N` forward, twice that for
the gradient):

  cpu   this host's XLA:CPU: "ragged_dot" vs "xla" (the tile loop)
  v5p   TPU v5p through libtpu: "ragged_dot" vs "megablox"
  h100  H100 (sm_90a) through the CUDA plugin: "ragged_dot" vs "xla"

XLA's cost analysis counts a loop body once, so the "xla" rows report the
loop's FLOPs as body x trip count (`counted`), computed from the
implementation's static work-item count. The TPU and GPU targets need the
compile check's environment:

  py="$(bash experiments/compile_check_env.sh)"
  "$py" -m experiments.bench_gmm                      # all targets
  python -m experiments.bench_gmm --targets=cpu       # the test venv
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments import compile_mesh  # noqa: E402
import kda_lm  # noqa: E402,F401  (XLA:CPU flags)
from kda_lm.ops import gmm  # noqa: E402

_TARGETS = flags.DEFINE_list("targets", ["cpu", "v5p", "h100"],
                             "cpu, v5p, h100.")
_EXPERTS = flags.DEFINE_list("experts", ["8", "128", "512"], "E values.")
_SHAPE = flags.DEFINE_list("shape", ["32768", "1536", "512"], "M,K,N.")

IMPLS = {"cpu": ("ragged_dot", "xla"), "v5p": ("ragged_dot", "megablox"),
         "h100": ("ragged_dot", "xla")}
GIB = 2.0 ** 30


def _sharding(target):
  if target == "cpu":
    return None
  name = "h100x1" if target == "h100" else target
  dev = compile_mesh.devices(name)[0]
  return jax.sharding.SingleDeviceSharding(dev)


def _compile(fn, args, target):
  platform = {"cpu": None, "v5p": "tpu", "h100": "gpu"}[target]
  with compile_mesh.backend(platform or jax.default_backend()):
    traced = jax.jit(fn).trace(*args)
  start = time.time()
  if platform is None:
    compiled = traced.lower().compile()
  else:
    compiled = traced.lower(lowering_platforms=(
        "cuda" if platform == "gpu" else "tpu",)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
  return (float(cost.get("flops", 0.0)),
          compiled.memory_analysis().temp_size_in_bytes / GIB,
          time.time() - start)


def _loop_flops(M, K, N, E, what):
  """The xla path's FLOPs: work items x one tile's matmul (per matmul)."""
  tm = gmm.default_tile_m(M, E)
  items = -(-M // tm) + E - 1
  one = 2.0 * items * tm * K * N
  return one if what == "forward" else 2 * one


def row(target, impl, M, K, N, E, what):
  sh = _sharding(target)
  S = functools.partial(jax.ShapeDtypeStruct, sharding=sh)
  args = (S((M, K), jnp.bfloat16), S((E, K, N), jnp.bfloat16),
          S((E,), jnp.int32))
  fwd = lambda a, b, c: gmm.gmm(a, b, c, impl=impl)
  fn = fwd if what == "forward" else jax.grad(
      lambda a, b, c: jnp.sum(fwd(a, b, c).astype(jnp.float32)),
      argnums=(0, 1))
  flops, temp, seconds = _compile(fn, args, target)
  useful = 2.0 * M * K * N * (1 if what == "forward" else 2)
  counted = _loop_flops(M, K, N, E, what) if impl == "xla" else flops
  tflop = lambda x: f"{x / 1e12:.3f}" if x else "-"   # GPU: none reported
  ratio = f"{counted / useful:.2f}x" if counted else "-"
  return (f"| {target} | {E} | {what} | {impl} | {tflop(flops)} | "
          f"{tflop(counted)} | {ratio} | {temp:.2f} | {seconds:.1f} |")


def main(argv):
  del argv
  M, K, N = (int(x) for x in _SHAPE.value)
  print(f"jax {jax.__version__}; M={M} rows, K={K} -> N={N}, bfloat16; "
        f"useful work {2 * M * K * N / 1e12:.3f} TFLOP forward")
  print("| target | E | program | impl | compiled TFLOP | counted TFLOP "
        "| / useful | temp GiB | compile s |")
  print("|" + "---|" * 9, flush=True)
  for target in _TARGETS.value:
    for E in (int(e) for e in _EXPERTS.value):
      for what in ("forward", "gradient"):
        for impl in IMPLS[target]:
          try:
            print(row(target, impl, M, K, N, E, what), flush=True)
          except Exception as e:  # pylint: disable=broad-except
            print(f"| {target} | {E} | {what} | {impl} | failed: "
                  f"{type(e).__name__}: {str(e).splitlines()[0][:120]} |",
                  flush=True)
  return 0


if __name__ == "__main__":
  app.run(lambda argv: sys.exit(main(argv)))
