"""Tests of the update step, the loss terms and the eval sums (train.step)."""

import helpers
import jax
import numpy as np
import optax
import pytest

from data import pipeline
from kda_lm import losses
from kda_lm.train import state as state_lib
from kda_lm.train import step as step_lib

# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

tiny_config = helpers.tiny_train_config
_table_batch = helpers.table_batch
_one_device_sharding = helpers.one_device_batch_sharding


# ---------------------------------------------------------------------------
# The batch check: token ids within the vocabulary.


def test_check_batch_names_bad_token():
  batch = {"inputs": np.array([[1, 2]]), "targets": np.array([[2, 9]])}
  step_lib.check_batch(batch, 10, "the batch of step 7")
  with pytest.raises(ValueError, match=r"^The batch of step 7: targets has "
                     r"token id 9 outside the model vocabulary \[0, 9\)"):
    step_lib.check_batch(batch, 9, "the batch of step 7")


# ---------------------------------------------------------------------------
# Loss and evaluation sums, checked against values computed here in numpy.


class _TableModel:
  """A stand-in for the model: the logits of token x are `table[x]`."""

  @staticmethod
  def apply(params, inputs, *args, **kwargs):
    del args, kwargs
    return params["table"][inputs]


def _cross_entropy64(logits, targets):
  """Per-position cross-entropy in float64 numpy: logsumexp - target logit."""
  z = np.asarray(logits, np.float64)
  top = z.max(-1, keepdims=True)
  lse = np.log(np.exp(z - top).sum(-1)) + top[..., 0]
  return lse - np.take_along_axis(z, targets[..., None], -1)[..., 0]


def test_loss_terms_count_only_masked_positions():
  rng = np.random.default_rng(0)
  vocab = 11
  batch = _table_batch(rng, vocab, 3, 8, 13)
  batch["loss_mask"][0, 2] = 0.0            # a hole inside the real tokens
  logits = rng.standard_normal((3, 8, vocab)).astype(np.float32)
  mask = batch["loss_mask"] > 0
  # Huge garbage wherever loss_mask == 0: large enough to dominate any sum
  # or argmax that counts those positions.
  garbage = np.where(rng.random((3, 8, vocab)) < 0.5, 1e4, -1e4)
  logits[~mask] = garbage[~mask]
  loss_sum, correct, weight = (float(x) for x in losses.loss_terms(
      logits, {k: jax.numpy.asarray(v) for k, v in batch.items()}))
  ce = _cross_entropy64(logits[mask], batch["targets"][mask])
  hits = np.argmax(logits[mask], -1) == batch["targets"][mask]
  assert weight == mask.sum() == 12
  np.testing.assert_allclose(loss_sum, ce.sum(), rtol=1e-6)
  assert correct == hits.sum()


def _frozen_table_step(table):
  """The jitted update of the table model with a learning rate of 0, and
  its state."""
  params = {"table": table}
  tx = optax.sgd(0.0)
  update = jax.jit(step_lib.make_update_fn(_TableModel(), tx,
                                           lambda step: 0.0))
  state = state_lib.TrainState(params, tx.init(params), jax.random.key(0),
                              jax.numpy.zeros((), jax.numpy.int32))
  return update, state


def test_update_loss_counts_only_masked_positions():
  """The training step's `loss` / `accuracy`, with a stand-in model."""
  rng = np.random.default_rng(1)
  vocab = 11
  batch = _table_batch(rng, vocab, 2, 8, 9)
  table = rng.standard_normal((vocab, vocab)).astype(np.float32)
  # Inputs at masked positions read a garbage row of the table.
  garbage = vocab - 1
  batch["inputs"][batch["loss_mask"] == 0] = garbage
  table[garbage] = np.where(np.arange(vocab) % 2, 1e4, -1e4)
  batch["inputs"][batch["loss_mask"] > 0] %= garbage
  update, state = _frozen_table_step(table)
  _, step_metrics = update(state, batch)
  mask = batch["loss_mask"] > 0
  logits = table[batch["inputs"][mask]]
  want_loss = _cross_entropy64(logits, batch["targets"][mask]).mean()
  want_acc = np.mean(np.argmax(logits, -1) == batch["targets"][mask])
  np.testing.assert_allclose(step_metrics["loss"], want_loss, rtol=1e-6)
  np.testing.assert_allclose(step_metrics["accuracy"], want_acc, rtol=1e-6)


def test_loss_is_divided_by_the_scored_targets_and_never_by_zero():
  """One scored target: its own cross-entropy; none: loss 0, not NaN."""
  rng = np.random.default_rng(2)
  vocab = 7
  table = rng.standard_normal((vocab, vocab)).astype(np.float32)
  update, state = _frozen_table_step(table)
  one = _table_batch(rng, vocab, 2, 4, 1)
  _, step_metrics = update(state, one)
  want = _cross_entropy64(table[one["inputs"][0, :1]], one["targets"][0, :1])
  np.testing.assert_allclose(step_metrics["loss"], want[0], rtol=1e-6)
  _, step_metrics = update(state, _table_batch(rng, vocab, 2, 4, 0))
  assert float(step_metrics["loss"]) == 0.0
  assert float(step_metrics["grad_norm"]) == 0.0


def test_update_norm_is_logged_only_when_asked():
  """`update_norm` is the update's global norm, and costs a pass of its
  own, so a step makes it only with `update_norm=True`."""
  rng = np.random.default_rng(2)
  vocab = 7
  batch = _table_batch(rng, vocab, 2, 8, 9)
  params = {"table": rng.standard_normal((vocab, vocab)).astype(np.float32)}
  tx = optax.sgd(0.5)
  state = state_lib.TrainState(params, tx.init(params), jax.random.key(0),
                              jax.numpy.zeros((), jax.numpy.int32))
  metrics = {}
  for flag in (False, True):
    update = jax.jit(step_lib.make_update_fn(_TableModel(), tx,
                                             lambda step: 0.5,
                                             update_norm=flag))
    new, metrics[flag] = update(state, batch)
  assert "update_norm" not in metrics[False]
  moved = np.linalg.norm(new.params["table"] - params["table"])
  np.testing.assert_allclose(metrics[True]["update_norm"], moved, rtol=1e-5)
  np.testing.assert_allclose(metrics[True]["grad_norm"], moved / 0.5,
                             rtol=1e-5)
  assert metrics[True]["grad_norm"] == metrics[False]["grad_norm"]


def test_evaluate_pools_sums_over_all_batches():
  """Batches of 5, 13, 0 and 1 real tokens: pooled over tokens, not batches."""
  rng = np.random.default_rng(2)
  vocab, rows, t = 11, 2, 8
  batches = [_table_batch(rng, vocab, rows, t, n) for n in (5, 13, 0, 1)]
  params = {"table": rng.standard_normal((vocab, vocab)).astype(np.float32)}
  eval_step = jax.jit(losses.make_eval_step(_TableModel()))
  got = step_lib.evaluate(eval_step, params, iter(batches),
                          _one_device_sharding(), vocab)
  ce, hits = [], []
  for b in batches:
    mask = b["loss_mask"] > 0
    logits = params["table"][b["inputs"][mask]]
    ce.append(_cross_entropy64(logits, b["targets"][mask]))
    hits.append(np.argmax(logits, -1) == b["targets"][mask])
  ce, hits = np.concatenate(ce), np.concatenate(hits)
  assert got["eval_tokens"] == len(ce) == 19
  np.testing.assert_allclose(got["eval_loss"], ce.mean(), rtol=1e-6)
  np.testing.assert_allclose(got["eval_accuracy"], hits.mean(), rtol=1e-6)
  # No batches: NaN loss and accuracy, zero tokens.
  empty = step_lib.evaluate(eval_step, params, iter([]),
                            _one_device_sharding(), vocab)
  assert empty["eval_tokens"] == 0 and np.isnan(empty["eval_loss"])


def test_eval_tokens_are_the_eval_iterators_loss_mask_sum(tmp_path,
                                                           data_dir):
  """`evaluate` over the real eval stream (the split, then padded batches).

  One shard of a two-process run: with several processes the shorter shards
  are padded with empty batches up to `num_batches` (one process would
  evaluate only the batches that exist).
  """
  config = tiny_config(data_dir)
  batches = pipeline.make_eval_iterator(config.data, workdir=str(tmp_path),
                                        num_batches=6, process_index=0,
                                        process_count=2)
  real = [float(b["loss_mask"].sum()) for b in batches]
  # Several non-empty batches, then padding batches: dropping any shows.
  assert len(real) == 6 and real[-1] == 0.0
  assert sum(r > 0 for r in real) >= 2 and max(real) < sum(real)
  vocab = int(config.model.vocab_size)
  rng = np.random.default_rng(3)
  params = {"table": rng.standard_normal((vocab, vocab)).astype(np.float32)}
  got = step_lib.evaluate(jax.jit(losses.make_eval_step(_TableModel())),
                          params, iter(batches), _one_device_sharding(),
                          vocab)
  assert got["eval_tokens"] == sum(real)
  ce = np.concatenate([
      _cross_entropy64(params["table"][b["inputs"][b["loss_mask"] > 0]],
                       b["targets"][b["loss_mask"] > 0]) for b in batches])
  np.testing.assert_allclose(got["eval_loss"], ce.mean(), rtol=1e-6)
