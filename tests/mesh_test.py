"""The training step on multi-device meshes: every kernel call and every
token sort inside `jax.shard_map`, numbers equal to one device, clear
errors for batches and meshes the model cannot shard.

On CPU the Pallas kernels run in interpret mode, which GSPMD partitions
like any XLA code: a kernel left outside `shard_map` works here and fails
on a TPU ("Mosaic kernels cannot be automatically partitioned") or is
replicated on a GPU. So the structure of the traced step is what guards
it: `test_kernels_and_sorts_run_inside_shard_map` traces the step on
abstract meshes (no devices needed). The numbers run in a subprocess with
4 fake CPU devices (`mesh_checks.py`).
"""

import collections
import json
import os
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import process_support
import pytest

from configs import ling3_tiny
from kda_lm import config as config_lib
from kda_lm import model as model_lib
from kda_lm import optimizer
from kda_lm.parallel import maps as parallel_maps
from kda_lm.parallel import sharding
from kda_lm.train import state as state_lib
from kda_lm.train import step as step_lib

REPO = process_support.REPO
CHECKS = os.path.join(REPO, "tests", "mesh_checks.py")
TOL = 1e-5
AUTO = jax.sharding.AxisType.Auto


def abstract_mesh(data, fsdp, context, expert=1):
  return jax.sharding.AbstractMesh((data, fsdp, expert, context),
                                   sharding.AXES, axis_types=(AUTO,) * 4)


def placements(jaxpr, inside=False, out=None, kernels=None):
  """(primitive, inside a shard_map) for every pallas_call, sort and
  all_to_all; with a list `kernels`, also appends each pallas_call's
  name to it."""
  out = [] if out is None else out
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("pallas_call", "sort", "all_to_all", "ragged_all_to_all"):
      out.append((name, inside))
    if name == "pallas_call" and kernels is not None:
      kernels.append(eqn.params["name"])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax.extend.core.Jaxpr):
          placements(sub, inside or name == "shard_map", out, kernels)
  return out


def traced_step(kda_impl="pallas", moe_impl="megablox"):
  """`make_jaxpr` of ling3_tiny's training step, for a given mesh."""
  config = ling3_tiny.get_config()
  config.model.kda_impl, config.model.moe_impl = kda_impl, moe_impl
  model_config = config_lib.ModelConfig.from_config(config.model)
  model = model_lib.build(model_config)
  tx, schedule = optimizer.make_optimizer(config.opt, 10)
  update = step_lib.make_update_fn(model, tx, schedule, model_config)
  state = jax.eval_shape(state_lib.make_init_fn(model, tx, 128),
                         jax.random.PRNGKey(0))
  tok = jax.ShapeDtypeStruct((4, 128), jnp.int32)
  batch = dict(inputs=tok, targets=tok, segment_ids=tok, positions=tok,
               loss_mask=jax.ShapeDtypeStruct((4, 128), jnp.float32))

  def trace(mesh):
    with jax.sharding.use_abstract_mesh(mesh):
      return jax.make_jaxpr(update)(state, batch).jaxpr

  return trace


@pytest.mark.parametrize("shape", [(1, 4, 1), (4, 1, 1), (2, 2, 1),
                                   (1, 2, 2), (1, 1, 1), (1, 2, 1, 2),
                                   (1, 1, 1, 4)])
def test_kernels_and_sorts_run_inside_shard_map(shape):
  found = collections.Counter(placements(traced_step()(abstract_mesh(
      *shape))))
  # 3 KDA layers' forward and backward kernels, 3 MoE layers' grouped
  # matmuls and their sorts (with an `expert` axis, also the sort of the
  # received pairs and the token exchange, 3 all_to_alls forward and 2
  # back per layer): all of them inside shard_map.
  expert = len(shape) == 4
  assert found[("pallas_call", False)] == 0, found
  assert found[("sort", False)] == 0, found
  assert found[("all_to_all", False)] == 0, found
  assert found[("pallas_call", True)] >= 3 * 2 + 3 * 3, found
  assert found[("sort", True)] == (6 if expert else 3), found
  assert found[("all_to_all", True)] == (3 * 5 if expert else 0), found


@pytest.mark.parametrize("shape", [(1, 4, 1), (2, 2, 1), (1, 2, 2),
                                   (1, 2, 1, 2)])
def test_tpu_kernels_run_inside_shard_map(shape, monkeypatch):
  """Traced as on a TPU (JAX's default backend read as "tpu": the "tpu"
  kernel family for the bounded gate, `ragged_dot` for ling3_tiny's 8
  experts, the ragged exchange of expert parallelism): each KDA layer's
  two TPU kernels, every other kernel and every exchange inside
  shard_map (the megablox kernels: `test_kernels_and_sorts_run_inside_
  shard_map`)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  kernels = []
  found = collections.Counter(placements(
      traced_step("auto", "auto")(abstract_mesh(*shape)), kernels=kernels))
  assert found[("pallas_call", False)] == 0, found
  assert found[("ragged_all_to_all", False)] == 0, found
  # Per MoE layer two ragged exchanges forward (out and back) and two for
  # their transposes; the small counts and offsets still by all_to_all.
  assert found[("ragged_all_to_all", True)] == (
      3 * 4 if len(shape) == 4 else 0), found
  names = collections.Counter(kernels)
  assert names["kda_tpu_forward"] == 3 and names["kda_tpu_backward"] == 3, (
      names)


def test_gpu_step_exchanges_ragged_inside_shard_map(monkeypatch):
  """Traced as on a GPU (the XLA grouped matmul, whose `shard_map` checks
  varying axes): the ragged exchange's buffers are typed as the rows
  they receive, forward and backward."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  found = collections.Counter(placements(
      traced_step("xla", "auto")(abstract_mesh(1, 2, 1, 2))))
  assert found[("ragged_all_to_all", False)] == 0, found
  assert found[("ragged_all_to_all", True)] == 3 * 4, found


def test_xla_paths_sort_inside_shard_map():
  found = collections.Counter(placements(
      traced_step("xla", "xla")(abstract_mesh(1, 4, 1))))
  assert set(found) == {("sort", True)}, found


def test_without_a_mesh_the_layers_call_the_ops_directly():
  assert not parallel_maps.under_mesh()
  config = ling3_tiny.get_config().model
  config.kda_impl, config.moe_impl = "pallas", "megablox"
  model = model_lib.build(config_lib.ModelConfig.from_config(config))
  tokens = jnp.zeros((2, 64), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
  found = placements(jax.make_jaxpr(model.apply)(params, tokens,
                                                 tokens + 1).jaxpr)
  assert found and not any(inside for _, inside in found), found


@pytest.mark.parametrize("impl", ["xla,xla", "pallas,megablox"])
def test_sharded_step_equals_one_device(impl):
  result = subprocess.run([sys.executable, CHECKS, impl], cwd=REPO,
                          env=process_support.subprocess_env(),
                          capture_output=True, text=True, timeout=900,
                          check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  results = json.loads(result.stdout.strip().splitlines()[-1])
  # The kernels run in interpret mode: one mesh with both batch axes; the
  # XLA paths on fsdp=4.
  meshes = ("fsdp4",) if impl == "xla,xla" else ("data2_fsdp2",)
  impl = impl.replace(",", "_")
  documents = [f"{impl}_documents"] if impl == "xla_xla" else []
  assert sorted(results) == sorted([f"{impl}_{m}" for m in meshes] +
                                   documents)
  for mesh in meshes:
    errors = results[f"{impl}_{mesh}"]
    assert errors["loss"] <= TOL and errors["grads"] <= TOL, (
        impl, mesh, errors)
  # Each document of a packed row (fsdp=4) gets the logits it has alone
  # (the XLA paths; the kernels' packed rows: ops_kda_golden_test.py).
  for name in documents:
    assert results[name] <= TOL, results


def _apply_under(mesh, B, T=16):
  cfg = config_lib.ModelConfig.from_config(ling3_tiny.get_config().model)
  model = model_lib.build(cfg)
  tokens = jnp.zeros((B, T), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens[:1])
  with jax.sharding.use_abstract_mesh(mesh):
    jax.eval_shape(model.apply, params, tokens, tokens + 1)


def test_batch_that_does_not_divide_over_the_mesh():
  with pytest.raises(ValueError, match="B = 3 rows is not a multiple of the "
                     "4 data x fsdp x expert devices"):
    _apply_under(abstract_mesh(2, 2, 1), 3)
  with pytest.raises(ValueError, match="not a multiple of mesh.context"):
    _apply_under(abstract_mesh(1, 1, 4), 2, T=18)


def test_mesh_axis_the_model_cannot_shard():
  mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"),
                                   axis_types=(AUTO,) * 2)
  with pytest.raises(ValueError, match="mesh axis 'tensor' is none of"):
    _apply_under(mesh, 4)


def test_experts_that_do_not_divide_over_the_expert_axis():
  """E = 8 over expert = 3: refused when the layer is traced (and before,
  by `check_expert_axis`, see parallel_sharding_test.py)."""
  with pytest.raises(ValueError, match="num_experts = 8 is not a multiple "
                     "of config.mesh.expert = 3"):
    _apply_under(abstract_mesh(1, 1, 1, 3), 3)

