"""Tests of gradient accumulation (train.step) and of training with scanned
layers: equal to the plain step, and resumable bit-exactly."""

import functools

import helpers
import jax
import jax.numpy as jnp
import kda_support
import numpy as np
import optax
import pytest

from kda_lm import losses, model, segments
from kda_lm.train import loop as train_loop
from kda_lm.train import metrics
from kda_lm.train import state as state_lib
from kda_lm.train import step as step_lib
from testbed import numerics

# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

# MoE layers in a scanned group (KM twice), an MTP block.
MODEL = dict(
    attention_pattern="KMKM", num_experts=4, num_experts_per_tok=2,
    num_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=0,
    num_mtp_layers=1, router_bias_update_rate=0.01)


def _batch(seed, B=8, T=16):
  """Packed rows with padding and unequal scored-token counts per row."""
  rng = np.random.default_rng(seed)
  seg = np.stack([kda_support.random_segment_row(rng, T) for _ in range(B)])
  seg[B // 2:, T // 2:] = 0                  # half-empty rows
  tokens = rng.integers(0, helpers.VOCAB, (B, T + 1)).astype(np.int32)
  mask = (seg != 0).astype(np.float32)
  mask[:, 0] = 0                             # unscored targets too
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "segment_ids": seg.astype(np.int32),
          "positions": np.asarray(
              segments.positions_from_segment_ids(jnp.asarray(seg))),
          "loss_mask": mask}


def _step(cfg, n, state, batch, loss_chunks=1):
  m = model.build(cfg)
  tx = optax.sgd(0.5)
  update = jax.jit(step_lib.make_update_fn(m, tx, lambda _: 0.5, cfg, n,
                                           loss_chunks))
  return update(state, batch)


def _assert_same_step(got, want):
  """Metrics within 1e-6; parameters within 1e-6 overall, a leaf whose
  update cancels (float32 sums in another order) within 1e-5."""
  (s_got, m_got), (s_want, m_want) = got, want
  assert set(m_got) == set(m_want)
  for key in m_want:
    np.testing.assert_allclose(m_got[key], m_want[key], rtol=1e-6,
                               err_msg=key)
  flat = lambda s: np.concatenate(
      [np.ravel(x) for x in jax.tree.leaves(s.params)])
  assert numerics.rel_err(flat(s_got), flat(s_want)) < 1e-6
  errs = jax.tree.map(numerics.rel_err, s_got.params, s_want.params)
  assert max(jax.tree.leaves(errs)) < 1e-5


def test_accumulated_step_equals_the_whole_batch():
  # On the scanned layers only: accumulation splits the batch before the
  # model and sums after it, whatever the layout (scanned and unrolled
  # training agree: stack_test.py's gradient and decay-mask tests), and
  # the scanned layout's stacked selection biases are the harder case.
  cfg = helpers.tiny_model(**MODEL, scan_layers=True)
  init = state_lib.make_init_fn(model.build(cfg), optax.sgd(0.5), 16)
  state = jax.jit(init)(jax.random.PRNGKey(0))
  batch = jax.tree.map(jnp.asarray, _batch(1))
  # The micro-batches (rows i, i+4 for i < 4) hold unequal token counts.
  counts = step_lib.micro_batches(batch, 4)["loss_mask"].sum((1, 2))
  assert len(set(np.asarray(counts).tolist())) > 1
  whole, m1 = _step(cfg, 1, state, batch)
  # 4 micro-batches, each row's head and loss in 4 strided pieces: the
  # same step (one program for both, to compile one less; each alone is
  # checked against the plain loss in train_step_update_test.py).
  accum, m4 = _step(cfg, 4, state, batch, loss_chunks=4)
  assert set(m1) >= {"loss", "accuracy", "mtp_loss", "moe_load_max",
                     "grad_norm"}
  _assert_same_step((accum, m4), (whole, m1))
  # The selection biases moved, by the whole batch's load.
  for slot in model.router_bias_slots(cfg):
    bias = [s.params[slot.module]["e_score_correction_bias"]
            for s in (accum, whole, state)]
    np.testing.assert_array_equal(bias[0], bias[1])
    assert np.any(bias[1] != bias[2])


def test_eval_step_in_pieces_equals_whole_logits():
  cfg = helpers.tiny_model(**MODEL)
  m = model.build(cfg)
  params = jax.jit(m.init)(jax.random.PRNGKey(0),
                           jnp.zeros((1, 16), jnp.int32))
  batch = jax.tree.map(jnp.asarray, _batch(2))
  head = functools.partial(model.head_weight, cfg)
  whole = jax.jit(losses.make_eval_step(m))(params, batch)
  pieces = jax.jit(losses.make_eval_step(m, head_weight=head, chunks=4))(
      params, batch)
  np.testing.assert_allclose(pieces, whole, rtol=1e-6)
  assert float(whole[2]) == float(batch["loss_mask"].sum())
  with pytest.raises(ValueError, match="needs the model's head_weight"):
    losses.make_eval_step(m, chunks=4)


def _config(data_dir, **extra):
  values = dict(model__attention_pattern="KMKM",
                model__first_k_dense_replace=0, eval__every_steps=0,
                checkpoint__every_steps=2, train__num_steps=4)
  return helpers.tiny_train_config(data_dir, **dict(values, **extra))


def _losses(workdir):
  return [(r["step"], r["loss"]) for r in metrics.read_metrics(workdir)
          if "loss" in r]


def test_resume_with_accumulation_and_scan_is_exact(tmp_path, data_dir,
                                                   cache_dir):
  del cache_dir  # The resumed runs read the first run's compiles.
  extra = dict(model__scan_layers=True, train__grad_accum_steps=2,
               train__remat="save_outputs")
  straight = str(tmp_path / "straight")
  state = train_loop.train_and_evaluate(_config(data_dir, **extra),
                                        straight)
  resumed = str(tmp_path / "resumed")
  train_loop.train_and_evaluate(
      _config(data_dir, **dict(extra, train__num_steps=2)), resumed)
  again = train_loop.train_and_evaluate(_config(data_dir, **extra), resumed)
  assert _losses(resumed) == _losses(straight)
  assert [s for s, _ in _losses(straight)] == [1, 2, 3, 4]
  jax.tree.map(np.testing.assert_array_equal, again.params, state.params)


def test_batch_not_divisible_into_micro_batches_is_refused(tmp_path,
                                                           data_dir):
  with pytest.raises(ValueError, match="2 data x fsdp|micro-batches"):
    train_loop.train_and_evaluate(
        _config(data_dir, train__grad_accum_steps=3), str(tmp_path / "w"))


def test_micro_batch_i_holds_rows_i_mod_n():
  """Micro-batch i is rows i, i+n, ...: each device's contiguous block of
  the batch sharding splits evenly over the micro-batches, so no row
  crosses devices. A contiguous split gives the same numbers on one device
  and an all-gather on a mesh, so the layout itself is asserted."""
  B, n = 8, 4
  batch = {"inputs": jnp.arange(B * 3).reshape(B, 3),
           "loss_mask": jnp.arange(B, dtype=jnp.float32)}
  micro = step_lib.micro_batches(batch, n)
  for i in range(n):
    for key, x in batch.items():
      np.testing.assert_array_equal(micro[key][i], x[i::n])
