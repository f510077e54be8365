r"""Times the routed experts' grouped matmul on the present device, by tile.

The MoE layer of the step benchmark (`bench_step`: 4096 tokens, top-8 of
16 experts) multiplies M = 32768 (token, expert) rows, sorted by expert,
from D = 1536 to F = 512 twice (gate and up) and back. This times the
forward and the gradient (both operands) of `kda_lm.ops.gmm.gmm` for
XLA's `ragged_dot` and for JAX's megablox kernels at several tilings
(rows, contraction, output columns), rows spread over the experts as the
router spreads them (evenly, or skewed), and prints a table with each
one's share of the device's matmul rate:

  python -m experiments.bench_gmm_tiles
  python -m experiments.bench_gmm_tiles --shape=32768,1536,1024   # gate+up
"""

import functools

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from kda_lm.ops import gmm
from testbed import timing

_SHAPE = flags.DEFINE_list("shape", ["32768", "1536", "512"], "M,K,N.")
_EXPERTS = flags.DEFINE_integer("experts", 16, "Groups.")
_TILES = flags.DEFINE_list(
    "tiles", ["128x512x512", "256x512x512", "512x512x512", "512x1536x512",
              "512x512x1024", "1024x512x512", "256x1536x512"],
    "megablox tilings tm x tk x tn (clipped to the shape).")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed calls (median).")


def group_sizes(M, E, skew):
  """Rows per expert summing to M: even, or geometric with ratio `skew`."""
  w = np.asarray([skew ** -i for i in range(E)])
  sizes = np.floor(M * w / w.sum()).astype(np.int32)
  sizes[0] += M - sizes.sum()
  return jnp.asarray(sizes)


def fwd_bwd(fn):
  """Forward and gradient (both operands) of `sum(fn(lhs, rhs) * dout)`."""
  def loss(lhs, rhs, dout):
    return jnp.sum(fn(lhs, rhs).astype(jnp.float32) * dout)
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def candidates(K, N):
  """{name: fn(lhs, rhs, sizes)} of the implementations and tilings."""
  out = {"ragged_dot": jax.lax.ragged_dot}
  interpret = jax.default_backend() == "cpu"
  for spec in _TILES.value:
    tm, tk, tn = (int(v) for v in spec.split("x"))
    tiling = (tm, min(tk, K), min(tn, N))
    if K % tiling[1] or N % tiling[2]:
      continue
    out[f"megablox {tiling}"] = functools.partial(
        lambda x, w, s, t: gmm._megablox_call(  # pylint: disable=protected-access
            x, w, s, t, interpret, None), t=tiling)
  return out


def main(argv):
  del argv
  M, K, N = (int(v) for v in _SHAPE.value)
  E = _EXPERTS.value
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((E, K, N)) * K ** -0.5, jnp.bfloat16)
  dout = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
  rate = timing.matmul_rate(8192 if jax.default_backend() != "cpu" else 1024)
  flop = 3 * 2 * M * K * N
  print(f"device {jax.devices()[0].device_kind}; M={M} K={K} N={N} E={E}; "
        f"matmul rate {rate / 1e12:.1f} TFLOP/s\n")
  print("| implementation | rows | fwd+bwd ms | of the matmul rate |\n"
        "| --- | --- | --- | --- |")
  for skew_name, skew in (("even", 1.0), ("skewed", 1.15)):
    sizes = group_sizes(M, E, skew)
    for name, fn in candidates(K, N).items():
      step = fwd_bwd(lambda x, w, f=fn, s=sizes: f(x, w, s))
      sec = timing.median_seconds(step.lower(lhs, rhs, dout).compile(),
                                  (lhs, rhs, dout), _REPEATS.value)
      print(f"| {name} | {skew_name} | {1e3 * sec:.2f} | "
            f"{100 * flop / sec / rate:.0f}% |", flush=True)


if __name__ == "__main__":
  app.run(main)
