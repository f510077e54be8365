"""Tests of kda_lm.context_parallel: one row sharded along T equals one
device, for the KDA op, the short convolution, MLA and the model.

Fake CPU devices must exist before JAX starts, so the checks run in a
subprocess (`context_parallel_checks.py`, one per group, each reusing its
compiled functions) that prints the measured errors; the tests here hold
them to the tolerances: forward 1e-5 relative, gradients 1e-4. Each group's
tests share an `xdist_group`, so that one worker runs its subprocess. The
op runs with impl "xla" (chunk 16) and "pallas" (interpret mode, chunk 64).
"""

import json
import os
import subprocess
import sys

import jax
import pytest

from kda_lm import context_parallel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = os.path.join(REPO, "tests", "context_parallel_checks.py")
FWD, GRAD = 1e-5, 1e-4


def _run_checks(group):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run([sys.executable, CHECKS, group], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600,
                          check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def op_results():
  return _run_checks("op")


@pytest.fixture(scope="module")
def layer_results():
  return _run_checks("layers")


@pytest.mark.xdist_group("context_parallel_op")
@pytest.mark.parametrize("case", ["op_xla_safe_4", "op_xla_safe_8",
                                  "op_xla_pre_2", "op_pallas_safe_2"])
def test_chunk_kda_sharded_equals_one_device(op_results, case):
  errors = op_results[case]
  grads = {k for k in errors if k.startswith("d")}
  want = {"dq", "dk", "dv", "dg", "dbeta", "dinitial_state"}
  if "safe" in case:
    want |= {"dA_log", "ddt_bias"}
  assert grads == want
  assert errors["o"] <= FWD and errors["final_state"] <= FWD, errors
  assert max(errors[k] for k in grads) <= GRAD, errors


@pytest.mark.xdist_group("context_parallel_layers")
@pytest.mark.parametrize("layer", ["conv", "mla", "mla_2", "mla_8",
                                   "mla_odd"])
def test_layers_sharded_equal_one_device(layer_results, layer):
  errors = layer_results[layer]
  assert errors["y"] <= FWD and errors["grads"] <= GRAD, errors


@pytest.mark.xdist_group("context_parallel_layers")
def test_model_sharded_equals_one_device(layer_results):
  errors = layer_results["model"]
  assert errors["logits"] <= FWD, errors
  assert errors["grads"] <= GRAD, errors
  # Each document of a packed row: the logits (main and MTP) it gets alone.
  assert errors["documents"] <= FWD, errors


@pytest.mark.xdist_group("context_parallel_layers")
def test_refusals_name_the_problem(layer_results):
  messages = layer_results["refusals"]
  assert "not a multiple of mesh.context = 4" in messages["t_not_divisible"]
  assert "not cu_seqlens" in messages["cu_seqlens"]
  assert "kernel_size - 1 = 7" in messages["short_shard"]


def test_without_mesh_is_the_plain_op():
  assert context_parallel.context_size() == 1
  mesh = jax.make_mesh((1,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh):
    assert context_parallel.context_size() == 1
