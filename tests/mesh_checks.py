"""Multi-device training-step checks, run in a subprocess with 4 fake CPU
devices by `mesh_test.py` (fake devices must be set before JAX starts).
Prints one JSON object of measured relative errors. Argument: the
`kda_impl,moe_impl` pair to check (`xla,xla` or `pallas,megablox`).

ling3_tiny's widths cut to two layers (KDA with the dense feed-forward,
then MLA with the MoE: each kind of layer the step shards) with the Pallas
KDA kernels and the megablox grouped matmul in interpret mode, and with the
XLA paths:
one training step's loss and gradients under a mesh against the same
step without one (the XLA paths under fsdp=4, the kernels, slow in
interpret mode, under data=2 x fsdp=2, a mesh with both batch axes: the
step's sharding is the same code for both, only the op inside each
`shard_map` differs); and, with the XLA paths under fsdp=4,
each document of a packed row against the logits it gets alone. (data=4,
each device whole rows and whole parameters, is the simplest split: the
training loop's four-device runs reproduce its losses.)
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")

import kda_lm  # noqa: E402,F401  (XLA flags)  # isort: skip
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from configs import ling3_tiny  # noqa: E402
from kda_lm import config as config_lib  # noqa: E402
from kda_lm import model as model_lib  # noqa: E402
from kda_lm import optimizer, segments  # noqa
from kda_lm.ops.kda import pallas  # noqa: E402
from kda_lm.parallel import sharding
from kda_lm.train import state as state_lib
from kda_lm.train import step as step_lib
from testbed import numerics  # noqa

B, T = 4, 128
MESHES = {"fsdp4": (1, 4, 1), "data2_fsdp2": (2, 2, 1)}


def meshes(kda_impl):
  """The mesh a step is checked on for this implementation."""
  return ("fsdp4",) if kda_impl == "xla" else ("data2_fsdp2",)


def packed_batch():
  """[4,128] rows of several documents, padding inside and at the end."""
  rng = np.random.default_rng(0)
  ids = np.zeros((B, T), np.int32)
  ids[0, :40], ids[0, 40:90], ids[0, 90:128] = 1, 2, 3
  ids[1, :128] = 1
  ids[2, 5:60], ids[2, 70:71], ids[2, 71:120] = 1, 2, 3
  ids[3, :64], ids[3, 64:100] = 1, 2
  tokens = rng.integers(0, 32, (B, T)).astype(np.int32)
  return {"inputs": tokens,
          "targets": rng.integers(0, 32, (B, T)).astype(np.int32),
          "segment_ids": ids,
          "positions": np.asarray(segments.positions_from_segment_ids(
              jnp.asarray(ids))),
          "loss_mask": (ids > 0).astype(np.float32)}


def model_config(kda_impl, moe_impl):
  config = ling3_tiny.get_config().model
  config.kda_impl, config.moe_impl = kda_impl, moe_impl
  config.attention_pattern = "KM"
  return config_lib.ModelConfig.from_config(config)


def mesh(shape):
  data, fsdp, context = shape
  return sharding.make_mesh(ml_collections.ConfigDict(
      dict(data=data, fsdp=fsdp, context=context)))


def step_errors(kda_impl, moe_impl):
  """Loss and gradient errors of each mesh against no mesh."""
  cfg = model_config(kda_impl, moe_impl)
  model = model_lib.build(cfg)
  tx, schedule = optimizer.make_optimizer(ling3_tiny.get_config().opt, 10)
  state = jax.jit(state_lib.make_init_fn(model, tx, T))(
      jax.random.PRNGKey(0))
  loss_fn = step_lib._loss_fn(model, cfg)  # pylint: disable=protected-access
  batch = packed_batch()
  denominators = step_lib._denominators(batch, cfg)  # pylint: disable=protected-access
  grad = jax.value_and_grad(
      lambda p, b: loss_fn(p, b, denominators), has_aux=True)
  (loss1, _), grads1 = jax.jit(grad)(state.params, batch)
  out = {}
  for name in meshes(kda_impl):
    m = mesh(MESHES[name])
    shardings = sharding.state_shardings(state.params, m)
    params = jax.device_put(state.params, shardings)
    rows = jax.device_put(batch, sharding.batch_sharding(m))
    with jax.set_mesh(m):
      (loss, _), grads = jax.jit(grad)(params, rows)
    out[f"{kda_impl}_{moe_impl}_{name}"] = {
        "loss": numerics.rel_err(loss, loss1),
        "grads": max(numerics.rel_err(a, b) for a, b in zip(
            jax.tree.leaves(grads), jax.tree.leaves(grads1), strict=True))}
  return out


def document_errors(kda_impl, moe_impl):
  """Under fsdp=4: each document of the packed rows against itself alone
  (one document per row, padded, no mesh)."""
  model = model_lib.build(model_config(kda_impl, moe_impl))
  batch = packed_batch()
  params = jax.jit(model.init)(jax.random.PRNGKey(1), batch["inputs"][:1])
  m = mesh(MESHES["fsdp4"])
  with jax.set_mesh(m):
    packed = jax.jit(model.apply)(
        jax.device_put(params, sharding.state_shardings(params, m)),
        batch["inputs"], batch["segment_ids"])
  # Every document alone at the start of its own row, then padding (one
  # compile for all of them; causal, so the padding changes nothing).
  docs = []
  for row in range(B):
    ids = batch["segment_ids"][row]
    docs += [(row, np.flatnonzero(ids == doc))
             for doc in sorted(set(ids[ids > 0].tolist()))]
  tokens = np.zeros((len(docs), T), np.int32)
  seg = np.zeros((len(docs), T), np.int32)
  for i, (row, where) in enumerate(docs):
    tokens[i, :len(where)] = batch["inputs"][row, where]
    seg[i, :len(where)] = 1
  alone = jax.jit(model.apply)(params, tokens, seg)
  worst = 0.0
  for i, (row, where) in enumerate(docs):
    worst = max(worst, numerics.rel_err(packed[row, where],
                                        alone[i, :len(where)]))
  return worst


def main(kda_impl, moe_impl):
  results = step_errors(kda_impl, moe_impl)
  # The kernels' packed rows: ops_kda_golden_test.py (one call site in the
  # layer for every implementation).
  if kda_impl == "xla":
    results[f"{kda_impl}_{moe_impl}_documents"] = document_errors(
        kda_impl, moe_impl)
  print(json.dumps(results))


if __name__ == "__main__":
  assert pallas.for_platform("cpu").interpret
  assert jax.device_count() == 4, jax.devices()
  sys.exit(main(*sys.argv[1].split(",")))
