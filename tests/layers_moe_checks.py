"""Expert-parallel MoE checks, run in a subprocess with 8 fake CPU devices
by `layers_moe_test.py` (fake devices must be set before JAX starts).
Prints one JSON object of measured errors.

The MoE layer (E = 8 experts, top-2 and top-1) under meshes with an
`expert` axis of 2 and 4 beside `data`, `fsdp` and `context` against the
same layer without a mesh: outputs, loads and the gradients of every
parameter and of the input, for three routings set by the selection bias
(random; only experts 0 and 5, so that six experts and, with expert=4,
two devices get nothing; top-1 with every token on expert 3, so that one
device receives every pair), with padding tokens (valid = False).

And the matmul FLOPs per device of the shared experts under `fsdp=2` x
`context=2` with several rows per device, read from the compiled HLO:
a quarter of the layer's, not replicated over `context`.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import kda_lm  # noqa: E402,F401  (XLA flags)  # isort: skip
import haiku as hk  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from kda_lm.layers import moe  # noqa: E402
from kda_lm.parallel import sharding  # noqa: E402
from testbed import hlo_flops, numerics  # noqa: E402

B, T, D, E, F = 8, 6, 8, 8, 4
# (data, fsdp, expert, context).
MESHES = {"expert2_data2_fsdp2": (2, 2, 2, 1), "expert4_fsdp2": (1, 2, 4, 1),
          "expert2_data2_context2": (2, 1, 2, 2)}


def layer(top_k, impl):
  def fn(x, valid):
    return moe.MoE(E, top_k, F, num_shared_experts=1,
                   routed_scaling_factor=2.5, impl=impl, name="moe")(x, valid)
  return hk.without_apply_rng(hk.transform(fn))


def biases(top_k):
  """The routings: {name: (top_k, bias [E])}."""
  rng = np.random.default_rng(1)
  out = {"random": rng.normal(size=E) * 0.3,
         "experts_0_and_5": np.where(np.isin(np.arange(E), [0, 5]), 10.0, 0)}
  if top_k == 1:
    out = {"all_on_expert_3": np.where(np.arange(E) == 3, 10.0, 0.0)}
  return {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}


def mesh(shape):
  data, fsdp, expert, context = shape
  return sharding.make_mesh(
      ml_collections.ConfigDict(dict(data=data, fsdp=fsdp, expert=expert,
                                     context=context)),
      jax.devices()[:int(np.prod(shape))])


def errors(top_k, impl, mesh_names):
  """{routing_mesh: {y, load, grads}} for one layer."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  valid = jnp.asarray(rng.uniform(size=(B, T)) > 0.25)
  cot = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
  net = layer(top_k, impl)
  params = net.init(jax.random.key(0), x, valid)

  def loss(p, x, valid):
    y, load = net.apply(p, x, valid)
    return jnp.sum(y * cot), (y, load)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  out = {}
  for routing, bias in biases(top_k).items():
    params["moe"][moe.BIAS_NAME] = bias
    (_, (y1, load1)), g1 = grad(params, x, valid)
    for name in mesh_names:
      m = mesh(MESHES[name])
      rows = jax.sharding.NamedSharding(
          m, jax.sharding.PartitionSpec(sharding.ROW_AXES, "context"))
      p = jax.device_put(params, sharding.state_shardings(params, m))
      with jax.set_mesh(m):
        (_, (y, load)), g = grad(p, jax.device_put(x, rows),
                                 jax.device_put(valid, rows))
      out[f"{impl}_top{top_k}_{routing}_{name}"] = {
          "y": numerics.rel_err(y, y1),
          "load": float(np.abs(np.asarray(load) - load1).max()),
          "load_total": float(np.asarray(load).sum()),
          "valid_pairs": float(top_k * np.asarray(valid).sum()),
          "grads": max(numerics.rel_err(a, b) for a, b in zip(
              jax.tree.leaves(g), jax.tree.leaves(g1), strict=True)),
          "expert_grads": max(numerics.rel_err(g[0]["moe"][k], g1[0]["moe"][k])
                              for k in sharding.EXPERT_WEIGHTS),
          "experts_used": int(np.sum(np.asarray(load1) > 0)),
          "expert_spec": str(p["moe"]["gate_proj"].sharding.spec)}
  return out


def shared_expert_flops():
  """{per_device, expected}: the shared experts' matmul FLOPs per device of
  one forward and backward pass under fsdp=2 x context=2 (B/2 rows and T/2
  tokens a device), against 3 passes x 3 matmuls x 2 x tokens x D x F."""
  x = jnp.ones((B, T, D), jnp.float32)
  net = layer(2, "xla")
  params = net.init(jax.random.key(0), x, None)
  m = mesh((1, 2, 1, 2))
  rows = jax.sharding.NamedSharding(
      m, jax.sharding.PartitionSpec(sharding.ROW_AXES, "context"))
  p = jax.device_put(params, sharding.state_shardings(params, m))
  step = jax.jit(jax.value_and_grad(
      lambda p, x, cot: jnp.sum(net.apply(p, x, None)[0] * cot),
      argnums=(0, 1)))
  x = jax.device_put(x, rows)
  with jax.set_mesh(m):
    text = step.lower(p, x, x).compile().as_text()
  per_device = hlo_flops.count(text, scope="shared_experts").total
  return {"per_device": per_device, "expected": 18 * (B * T // 4) * D * F}


def main():
  results = {}
  results.update(errors(2, "xla", list(MESHES)))
  results.update(errors(1, "xla", ["expert4_fsdp2"]))
  results.update(errors(2, "megablox", ["expert4_fsdp2"]))
  print(json.dumps({"errors": results, "flops": shared_expert_flops()}))


if __name__ == "__main__":
  assert jax.device_count() == 8, jax.devices()
  sys.exit(main())
