"""Tests of kda_lm/layers/mtp.py and the MTP head of the decoder."""

import functools

import haiku as hk
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from kda_lm import losses, model
from kda_lm.layers import moe, mtp
from kda_lm.train import state as state_lib
from kda_lm.train import step as step_lib

# Tiny shapes: compilation dominates (conftest.fast_compile).
ROW = helpers.LOSS_ROW

pytestmark = pytest.mark.usefixtures("fast_compile")


def test_targets_never_cross_documents_exact():
  for k, want_mask, want in (
      (1, [1, 1, 0, 1, 1, 1, 0, 0], [12, 13, 0, 22, 23, 24, 0, 0]),
      (2, [1, 0, 0, 1, 1, 0, 0, 0], [13, 0, 0, 23, 24, 0, 0, 0])):
    targets, mask = mtp.targets_and_mask(
        jnp.asarray(ROW["targets"]), jnp.asarray(ROW["loss_mask"]),
        jnp.asarray(ROW["segment_ids"]), k)
    np.testing.assert_array_equal(mask[0], want_mask)
    np.testing.assert_array_equal(np.where(mask[0] > 0, targets[0], 0), want)
  # A masked-out main target (e.g. delayed copy's first tokens) masks the
  # MTP target that predicts the same token.
  lm = ROW["loss_mask"].copy()
  lm[0, 4] = 0
  _, mask = mtp.targets_and_mask(jnp.asarray(ROW["targets"]),
                                 jnp.asarray(lm),
                                 jnp.asarray(ROW["segment_ids"]), 1)
  np.testing.assert_array_equal(mask[0], [1, 1, 0, 0, 1, 1, 0, 0])
  # Without segment ids only the row end stops the shift.
  _, mask = mtp.targets_and_mask(jnp.asarray(ROW["targets"]),
                                 jnp.ones((1, 8)), None, 2)
  np.testing.assert_array_equal(mask[0], [1] * 6 + [0, 0])


# MLA-only main stack (compiles fast); MoE after one dense layer.
MTP_CONFIG = helpers.tiny_model(
    attention_pattern="MM", num_mtp_layers=2, num_experts=4,
    num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=16,
    first_k_dense_replace=1)


@functools.lru_cache(maxsize=None)
def _setup():
  m = model.build(MTP_CONFIG)
  tokens, seg = helpers.packed_row(0)
  params = jax.jit(m.init)(jax.random.key(0), tokens, seg)
  return m, params, jax.jit(m.apply, static_argnames="return_aux")


def test_mtp_model_packed_equals_unpacked_and_shapes():
  m, params, apply = _setup()
  assert {"mtp_0/input/eh_proj", "mtp_1/block/moe", "mtp_1/final_norm"} <= (
      set(params))
  assert params["mtp_0/input/eh_proj"]["w"].shape == (64, 32)
  n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  assert n == model.param_count(MTP_CONFIG)
  assert "lm_head_1" not in params   # the LM head is shared
  tokens, seg = helpers.alone_rows(*helpers.packed_row(1))
  logits, aux = apply(params, tokens, seg, return_aux=True)
  assert aux["mtp_logits"].shape == (2, 4, helpers.T, helpers.VOCAB)
  assert aux["expert_load"].shape == (1 + 2, 4)
  mtp_logits = np.asarray(aux["mtp_logits"])
  for i, n in enumerate(helpers.LENS):
    for k in range(2):
      # Positions with an MTP target in the document (the last k+1 have
      # none; they see a zero embedding instead of the next document).
      got = helpers.doc(mtp_logits[k, :1], i)[0]
      want = mtp_logits[k, 1 + i, :n]
      n_valid = n - (k + 1)
      if n_valid > 0:
        err = (np.abs(got[:n_valid] - want[:n_valid]).max()
               / np.abs(want).max())
        assert err <= 1e-5, (i, k, err)
  # return_aux leaves the logits unchanged (same shapes, so the same
  # compiled kernels: bit-identical).
  np.testing.assert_array_equal(logits, apply(params, tokens, seg))


def test_update_step_mtp_loss_and_router_bias():
  """One update: loss + 0.1 * MTP, biases moved from the load, not by SGD."""
  m, params, apply = _setup()
  tokens, seg = helpers.packed_row(2)
  batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1),
           "segment_ids": seg, "loss_mask": (seg != 0).astype(np.float32),
           "positions": np.asarray(model.segments.positions_from_segment_ids(
               jnp.asarray(seg)))}
  tx = optax.sgd(1.0)
  update = jax.jit(step_lib.make_update_fn(m, tx, lambda s: 1.0, MTP_CONFIG))
  state = state_lib.TrainState(params, tx.init(params), jax.random.key(0),
                              jnp.zeros((), jnp.int32))
  new, metrics = update(state, batch)
  logits, aux = apply(params, tokens, seg, return_aux=True)
  jb = {k: jnp.asarray(v) for k, v in batch.items()}
  loss_sum, _, weight = losses.loss_terms(logits, jb)
  np.testing.assert_allclose(metrics["loss"], loss_sum / weight, rtol=1e-5)
  np.testing.assert_allclose(metrics["mtp_loss"],
                             losses.mtp_loss(aux["mtp_logits"], jb),
                             rtol=1e-5)
  # With SGD(1) the update is -grad(main + 0.1 * MTP); the main loss does
  # not reach the MTP weights.
  def mtp_only(p):
    return 0.1 * losses.mtp_loss(
        m.apply(p, tokens, seg, return_aux=True)[1]["mtp_logits"], jb)
  g = jax.jit(jax.grad(mtp_only))(params)
  delta = (new.params["mtp_1/input/eh_proj"]["w"]
           - params["mtp_1/input/eh_proj"]["w"])
  np.testing.assert_allclose(delta, -g["mtp_1/input/eh_proj"]["w"],
                             rtol=1e-4, atol=1e-7)
  assert hk.data_structures.tree_size(params) == hk.data_structures.tree_size(
      new.params)
  # MoE: load metrics, and each selection bias moved by rate * sign(mean -
  # load) from the step's own load (SGD would not move it: no gradient).
  for key in ("moe_load_max", "moe_load_min", "moe_load_imbalance"):
    assert key in metrics
  assert 0 <= metrics["moe_load_min"] <= 1 / 4 <= metrics["moe_load_max"]
  rate = MTP_CONFIG.router_bias_update_rate
  modules = model.router_bias_modules(MTP_CONFIG)
  assert modules == ["layer_1/moe", "mtp_0/block/moe", "mtp_1/block/moe"]
  for row, module in enumerate(modules):
    old = params[module][moe.BIAS_NAME]
    load = aux["expert_load"][row]
    np.testing.assert_allclose(
        new.params[module][moe.BIAS_NAME],
        old + rate * np.sign(np.mean(load) - load), rtol=0, atol=1e-7)
  assert np.any(new.params["layer_1/moe"]["gate_proj"]
                != params["layer_1/moe"]["gate_proj"])


def test_mtp_logits_packed_equal_alone_at_every_position():
  """Every position of each document, its last k+1 included.

  Past its document's end, MTP layer k reads a zero embedding, which is what
  the document sees alone (followed by padding); the embedding of the next
  document must not leak into those logits, nor into the MoE load.
  """
  m, params, apply = _setup()
  del m
  tokens, seg = helpers.alone_rows(*helpers.packed_row(4))
  _, aux = apply(params, tokens, seg, return_aux=True)
  mtp_logits = np.asarray(aux["mtp_logits"])
  for i, n in enumerate(helpers.LENS):
    for k in range(2):
      got = helpers.doc(mtp_logits[k, :1], i)[0]
      want = mtp_logits[k, 1 + i, :n]
      err = np.abs(got - want).max() / np.abs(want).max()
      assert err <= 1e-5, (i, k, err)
  # The packed row's expert load (this batch's minus the same batch with row
  # 0 all padding) equals that of the documents alone, in every MoE layer.
  tokens0, seg0 = tokens.copy(), seg.copy()
  tokens0[0], seg0[0] = 0, 0
  _, aux0 = apply(params, tokens0, seg0, return_aux=True)
  load_all = np.asarray(aux["expert_load"])
  load_alone = np.asarray(aux0["expert_load"])
  np.testing.assert_array_equal(load_all - load_alone, load_alone)
