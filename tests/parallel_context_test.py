"""Tests of kda_lm.parallel.context: one row sharded along T equals one
device, for the KDA op, the short convolution, MLA and the model.

Fake CPU devices must exist before JAX starts, so the checks run in a
subprocess (`parallel_context_checks.py`, one per test: the op, the
layers, the model and refusals, the state-carry rule at shard boundaries;
each reuses its compiled functions) that prints the measured errors; the
tests here hold them to the tolerances:
forward 1e-5 relative, gradients 1e-4. The op runs with impl "xla" (chunk
16) and "pallas" (interpret mode, chunk 64).
"""

import itertools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import process_support
import pytest

from kda_lm.ops.kda import api as kda_api
from kda_lm.parallel import context as context_parallel
from kda_lm.parallel import maps as parallel_maps
from kda_lm.parallel import sharding

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = os.path.join(REPO, "tests", "parallel_context_checks.py")
FWD, GRAD = 1e-5, 1e-4


def _run_checks(group):
  result = subprocess.run([sys.executable, CHECKS, group], cwd=REPO,
                          env=process_support.subprocess_env(),
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
  assert parallel_maps.context_size() == 1
  mesh = jax.make_mesh((1,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh):
    assert parallel_maps.context_size() == 1


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


# The state exchange's combine in this process: `_keep_state`'s all-gather
# over `context` runs under `jax.vmap` with that axis name (one shard per
# vmapped index), so no fake devices and no KDA op are needed.


def _keep_state_vmapped(ids_BT, n):
  """`context_parallel._keep_state` on [B,T] ids split into n shards."""
  B, T = ids_BT.shape
  shards = ids_BT.reshape(B, n, T // n).transpose(1, 0, 2)   # [n,B,T/n]
  keep = jax.jit(jax.vmap(
      context_parallel._keep_state,  # pylint: disable=protected-access
      axis_name=context_parallel.CONTEXT_AXIS))(shards)
  keep = np.asarray(keep)                     # [n (shard), n, B], all equal
  np.testing.assert_array_equal(keep, np.broadcast_to(keep[:1], keep.shape))
  return keep[0]


def _keep_state_by_the_segment_rule(ids_BT, n):
  """[n,B]: 1 where shard j starts from the state entering it, from the
  segment rule alone (a reset before every segment start but the row's
  first; padding changes no state): a shard without a real token passes
  the state through, another keeps it iff its first real token is no
  reset."""
  B, T = ids_BT.shape
  keep = np.ones((n, B), np.float32)
  for b in range(B):
    starts = [t for t in range(T) if ids_BT[b, t] != 0 and
              (t == 0 or ids_BT[b, t] != ids_BT[b, t - 1])]
    resets = set(starts[1:])
    for j in range(n):
      real = [t for t in range(j * T // n, (j + 1) * T // n)
              if ids_BT[b, t] != 0]
      if real and real[0] in resets:
        keep[j, b] = 0.0
  return keep


@pytest.mark.parametrize("n,T", [(2, 6), (3, 6), (4, 8)])
def test_keep_state_on_every_short_row_in_one_process(n, T):
  """Every id row over {0, 1, 2} (shards of 2 to 3 tokens: first, middle
  and last tokens differ), against the segment rule."""
  ids = np.array(list(itertools.product(range(3), repeat=T)), np.int32)
  keep = _keep_state_vmapped(ids, n)
  want = _keep_state_by_the_segment_rule(ids, n)
  bad = np.flatnonzero(np.any(keep != want, axis=0))
  assert not bad.size, (ids[bad[0]], keep[:, bad[0]], want[:, bad[0]])
  assert keep.dtype == np.float32


def test_keep_state_on_named_rows_in_one_process():
  """Rows of 4 shards of 3 tokens, each boundary case by name."""
  rows = {
      "one document": [1] * 12,
      "new document at the split": [1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2],
      "padding across the split, new document": [1, 1, 0, 0, 2, 2] + [2] * 6,
      "padding across the split, id reused": [1, 1, 0, 0, 1, 1] + [1] * 6,
      "leading padding shards": [0] * 7 + [3] * 5,
      "all padding": [0] * 12,
      "trailing padding shards": [4] * 5 + [0] * 7,
      "padding shard, then the same id": [5] * 3 + [0] * 3 + [5] * 6,
  }
  want = {
      "one document": [1, 1, 1, 1],
      "new document at the split": [1, 0, 1, 1],
      "padding across the split, new document": [1, 0, 1, 1],
      "padding across the split, id reused": [1, 0, 1, 1],
      "leading padding shards": [1, 1, 1, 1],
      "all padding": [1, 1, 1, 1],
      "trailing padding shards": [1, 1, 1, 1],
      "padding shard, then the same id": [1, 1, 0, 1],
  }
  keep = _keep_state_vmapped(np.array(list(rows.values()), np.int32), 4)
  assert dict(zip(rows, keep.T.tolist(), strict=True)) == want


def test_incoming_states_compose_the_shards_in_order():
  """`_incoming_states` against a float64 loop: the state entering shard j
  is keep_j * (M_{j-1} x_{j-1} + C_{j-1}), from `h0` at shard 0."""
  n, B, H, K, V = 4, 3, 2, 3, 5
  rng = np.random.default_rng(0)
  M = rng.normal(size=(n, B, H, K, K)).astype(np.float32)
  C = rng.normal(size=(n, B, H, K, V)).astype(np.float32)
  h0 = rng.normal(size=(B, H, K, V)).astype(np.float32)
  keep = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 0, 1]], np.float32)
  entering, final = jax.jit(
      context_parallel._incoming_states)(  # pylint: disable=protected-access
          M, C, keep, h0)
  state, want = h0.astype(np.float64), []
  for j in range(n):
    x = keep[j][:, None, None, None] * state
    want.append(x)
    state = np.einsum("bhkj,bhjv->bhkv", M[j], x) + C[j]
  assert entering.shape == (n, B, H, K, V) and final.shape == (B, H, K, V)
  np.testing.assert_allclose(entering, np.stack(want), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(final, state, rtol=1e-5, atol=1e-5)
  # Where keep is 0 the shard starts from zero, whatever came before.
  assert not np.any(np.asarray(entering)[1, 0])


def _context_mesh(context: int) -> jax.sharding.AbstractMesh:
  auto = jax.sharding.AxisType.Auto
  return jax.sharding.AbstractMesh((1, 1, 1, context), sharding.AXES,
                                   axis_types=(auto,) * 4)


@pytest.mark.parametrize("bounded", [True, False])
def test_check_kda_counts_the_shards_and_refuses_what_it_cannot_run(
    bounded):
  """`_check_kda` on an abstract mesh (no devices): the shard count along
  T and the concrete impl, and its refusals with their messages."""
  check = context_parallel._check_kda  # pylint: disable=protected-access
  auto = kda_api.resolve_impl("auto", bounded)
  with jax.sharding.use_abstract_mesh(_context_mesh(2)):
    assert check(2, 8, None, "xla", bounded) == (2, "xla")
    assert check(2, 8, None, "pallas", bounded) == (2, "pallas")
    assert check(2, 8, None, "auto", bounded) == (2, auto)
    with pytest.raises(ValueError) as info:
      # A name built at run time (as from a command line), not the literal.
      check(2, 8, None, "".join(["refer", "ence"]), bounded)
    assert str(info.value) == (
        "chunk_kda under context parallelism needs impl 'xla', 'pallas' "
        "or 'auto' (the local passes reuse the chunked op), not "
        "'reference'.")
    with pytest.raises(ValueError, match="^chunk_kda under context "
                       "parallelism: T = 7 tokens per row is not a multiple "
                       "of mesh.context = 2.$"):
      check(2, 7, None, "xla", bounded)
    with pytest.raises(ValueError) as info:
      check(2, 8, np.array([0, 4, 8]), "xla", bounded)
    assert str(info.value) == (
        "chunk_kda on a device mesh takes segment_ids, not cu_seqlens "
        "(rows are sharded over devices).")
  with jax.sharding.use_abstract_mesh(_context_mesh(1)):
    assert check(2, 7, None, "reference", bounded) == (1, "reference")
  assert check(3, 5, None, "reference", bounded) == (1, "reference")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_swap_with_mirror_reverses_the_shards(n):
  """Shard i receives shard n - 1 - i's value (vmapped over the axis name,
  one shard per index, as `_keep_state`'s tests)."""
  swapped = jax.vmap(lambda x: context_parallel.swap_with_mirror(x, n),
                     axis_name=parallel_maps.CONTEXT_AXIS)(
                         jnp.arange(10, 10 + n))
  assert swapped.tolist() == list(range(10 + n - 1, 9, -1))
