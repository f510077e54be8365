"""Tests of kda_lm.context_parallel: one row sharded along T equals one
device, for the KDA op, the short convolution, MLA and the model.

Fake CPU devices must exist before JAX starts, so the checks run in a
subprocess (`context_parallel_checks.py`, one per test: the op, the
layers, the model and refusals, the state-carry rule at shard boundaries;
each reuses its compiled functions) that prints the measured errors; the
tests here hold them to the tolerances:
forward 1e-5 relative, gradients 1e-4. The op runs with impl "xla" (chunk
16) and "pallas" (interpret mode, chunk 64).
"""

import json
import os
import subprocess
import sys

import jax

from kda_lm import context_parallel, testing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = os.path.join(REPO, "tests", "context_parallel_checks.py")
FWD, GRAD = 1e-5, 1e-4


def _run_checks(group):
  result = subprocess.run([sys.executable, CHECKS, group], cwd=REPO,
                          env=testing.subprocess_env(),
                          capture_output=True, text=True, timeout=600,
                          check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_chunk_kda_sharded_equals_one_device():
  results = _run_checks("op")
  assert sorted(results) == sorted(["op_xla_safe_4", "op_xla_safe_8",
                                    "op_xla_pre_2", "op_pallas_safe_2"])
  for case, errors in results.items():
    grads = {k for k in errors if k.startswith("d")}
    want = {"dq", "dk", "dv", "dg", "dbeta", "dinitial_state"}
    if "safe" in case:
      want |= {"dA_log", "ddt_bias"}
    assert grads == want, case
    assert errors["o"] <= FWD and errors["final_state"] <= FWD, (case, errors)
    assert max(errors[k] for k in grads) <= GRAD, (case, errors)


def test_layers_sharded_equal_one_device():
  results = _run_checks("layers")
  assert sorted(results) == ["conv", "mla", "mla_2", "mla_8", "mla_odd"]
  for layer, errors in results.items():
    assert errors["y"] <= FWD and errors["grads"] <= GRAD, (layer, errors)


def test_model_sharded_equals_one_device_and_refusals():
  results = _run_checks("model")
  errors = results["model"]
  assert errors["logits"] <= FWD, errors
  assert errors["grads"] <= GRAD, errors
  # Each document of a packed row: the logits (main and MTP) it gets alone.
  assert errors["documents"] <= FWD, errors
  messages = results["refusals"]
  assert "not a multiple of mesh.context = 4" in messages["t_not_divisible"]
  assert "not cu_seqlens" in messages["cu_seqlens"]
  assert "kernel_size - 1 = 7" in messages["short_shard"]


def test_without_mesh_is_the_plain_op():
  assert context_parallel.context_size() == 1
  mesh = jax.make_mesh((1,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh):
    assert context_parallel.context_size() == 1


def test_keep_state_follows_the_segment_rule_at_shard_boundaries():
  """`_keep_state` on every id row over {0, 1, 2} of 6 or 8 tokens (2, 3
  and 4 shards) against the segment rule, and the op at n = 4 on rows where
  a shard begins with padding after one that ended with padding, then a
  new document (or a reused id, or the row's first document)."""
  results = _run_checks("keep")
  assert sorted(results) == ["keep_op_4", "keep_state_2", "keep_state_3",
                             "keep_state_4", "keep_state_ids"]
  for n, T in ((2, 6), (3, 6), (4, 8)):
    errors = results[f"keep_state_{n}"]
    assert errors["rows"] == 3 ** T
    assert errors["mismatches"] == 0, errors
  assert results["keep_state_ids"]["mismatches"] == 0
  errors = results["keep_op_4"]
  assert errors["o"] <= FWD and errors["final_state"] <= FWD, errors
