"""The update step and `evaluate` (train.step) against plain formulas.

A stand-in model (`helpers.StandInModel`: an embedding, a head and MTP
matmuls, a counted expert load) stands for the kda_lm model, so each test
compiles a few small matmuls instead of a model: the step's loss, gradient,
accumulation, optimizer step, selection-bias update and metrics are
compared with the same quantities written out here in float32 jnp.
"""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from kda_lm import model as model_lib
from kda_lm.layers import moe
from kda_lm.train import state as state_lib
from kda_lm.train import step as step_lib

# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

# pylint: disable=protected-access
_loss_fn = step_lib._loss_fn
_denominators = step_lib._denominators
_grads_and_extra = step_lib._grads_and_extra
# pylint: enable=protected-access

VOCAB, WIDTH, B, T = 16, 8, 4, 8
LR, RATE, SCALE, STEP = 0.25, 0.01, 0.3, 5

# A dense layer, MoE layers in a scanned group (two stacked selection
# biases), two MTP layers with MoE blocks: five bias slots.
MOE_MTP = dict(
    attention_pattern="KMKMKM", num_experts=4, num_experts_per_tok=2,
    num_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1,
    num_mtp_layers=2, router_bias_update_rate=RATE, mtp_loss_scale=SCALE,
    scan_layers=True)


def _config(kind):
  """None (a model that is not kda_lm's), a dense config (no auxiliary
  outputs), an MTP-only one, or MoE with MTP."""
  if kind == "none":
    return None
  if kind == "dense":
    return helpers.tiny_model(vocab_size=VOCAB, attention_pattern="KM",
                              num_experts=0)
  if kind == "mtp":
    return helpers.tiny_model(vocab_size=VOCAB, attention_pattern="KM",
                              num_experts=0, num_mtp_layers=2,
                              mtp_loss_scale=SCALE)
  return helpers.tiny_model(vocab_size=VOCAB, **MOE_MTP)


def _batch(seed):
  """Rows of two or three documents (ids 1, 2, 3), then padding, with
  unequal scored counts per row; the first target of each row unscored."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((B, T), np.int32)
  for b, cuts in enumerate([(3, 6, 8), (2, 5, 7), (4, 8, 8), (1, 3, 4)]):
    seg[b, :cuts[0]] = 1
    seg[b, cuts[0]:cuts[1]] = 2
    seg[b, cuts[1]:cuts[2]] = 3
  positions = np.zeros((B, T), np.int32)
  for b in range(B):
    for t in range(1, T):
      same = seg[b, t] == seg[b, t - 1]
      positions[b, t] = positions[b, t - 1] + 1 if same else 0
  mask = (seg != 0).astype(np.float32)
  mask[:, 0] = 0.0
  return {"inputs": rng.integers(0, VOCAB, (B, T)).astype(np.int32),
          "targets": rng.integers(0, VOCAB, (B, T)).astype(np.int32),
          "segment_ids": seg, "positions": positions, "loss_mask": mask}


class _Sums:
  """A stand-in eval step: batch i's sums are `table[i]`, read from the
  batch's first input; records the parameters and batch shardings."""

  def __init__(self, table):
    self.table = np.asarray(table, np.float32)
    self.seen = []

  def __call__(self, params, batch):
    self.seen.append((params, batch["inputs"].sharding))
    return jnp.asarray(self.table[int(batch["inputs"][0, 0])])


def _eval_batches(count):
  """`count` host batches; batch i's first input is i."""
  out = []
  for i in range(count):
    inputs = np.full((2, 4), i, np.int32)
    out.append({"inputs": inputs, "targets": inputs.copy(),
                "loss_mask": np.ones((2, 4), np.float32)})
  return out


@pytest.mark.parametrize("table,want", [
    # Pooled over tokens: (2 + 6 + 1) / 4 and (1 + 2 + 0) / 4.
    ([[2.0, 1.0, 1.0, 9.0], [6.0, 2.0, 3.0, 9.0], [1.0, 0.0, 0.0, 9.0]],
     (9.0 / 4, 3.0 / 4, 4.0)),
    # One scored target: its own loss and accuracy.
    ([[2.5, 1.0, 1.0, 1.0]], (2.5, 1.0, 1.0)),
    # Batches without a scored target: 0, not NaN or an error.
    ([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], (0.0, 0.0, 0.0)),
    # No batch at all: NaN.
    ([], (np.nan, np.nan, 0.0))])
def test_evaluate_pools_the_eval_steps_sums(table, want):
  """`evaluate` adds up the eval step's [loss, correct, weight, bytes] over
  every batch, then divides by the pooled weight (at least 1)."""
  eval_step = _Sums(table)
  sharding = helpers.one_device_batch_sharding()
  params = {"w": np.float32(1.0)}
  got = step_lib.evaluate(eval_step, params, iter(_eval_batches(len(table))),
                          sharding, VOCAB)
  assert set(got) == {"eval_loss", "eval_accuracy", "eval_tokens"}
  np.testing.assert_allclose(
      [got["eval_loss"], got["eval_accuracy"], got["eval_tokens"]], want,
      rtol=1e-6)
  assert all(type(v) is float for v in got.values())
  assert len(eval_step.seen) == len(table)
  for seen_params, seen_sharding in eval_step.seen:
    assert seen_params is params and seen_sharding == sharding


def test_evaluate_checks_each_batchs_token_ids():
  """A token id outside the vocabulary is named, as the eval batch's."""
  batches = _eval_batches(3)
  batches[2]["targets"][1, 2] = VOCAB
  with pytest.raises(ValueError) as info:
    step_lib.evaluate(_Sums(np.zeros((3, 4))), {}, iter(batches),
                      helpers.one_device_batch_sharding(), VOCAB)
  assert str(info.value).startswith(
      f"An eval batch: targets has token id {VOCAB} outside")


def _shift(x, k):
  """x[:, i + k], zero past the row's end."""
  return jnp.concatenate([x[:, k:], jnp.zeros_like(x[:, :k])], axis=1)


def _masked_mean_ce(logits, targets, mask):
  """sum(mask * cross-entropy) / max(sum(mask), 1)."""
  ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None],
                            -1)[..., 0]
  return (ce * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def _plain_loss(cfg, params, batch):
  """The step's loss written out: (main + scale * MTP loss, (main loss,
  accuracy, MTP loss)); the MTP loss is the mean over layers k of the
  cross-entropy of targets k ahead in the same document."""
  h = params["embed"]["embeddings"][batch["inputs"]] * (
      1.0 + batch["positions"][..., None] / 8.0)
  head = (params["lm_head"]["w"] if cfg is None
          else model_lib.head_weight(cfg, params))
  logits = h @ head
  mask = batch["loss_mask"]
  main = _masked_mean_ce(logits, batch["targets"], mask)
  hits = (jnp.argmax(logits, -1) == batch["targets"]) * mask
  accuracy = hits.sum() / mask.sum()
  if cfg is None or not cfg.num_mtp_layers:
    return main, (main, accuracy, None)
  seg = batch["segment_ids"]
  per_layer = []
  for k in range(1, cfg.num_mtp_layers + 1):
    same = (_shift(seg, k) == seg) & (seg != 0)
    mask_k = _shift(mask, k) * same
    logits_k = jnp.tanh(h @ params["mtp"]["w"][k - 1]) @ head
    per_layer.append(_masked_mean_ce(logits_k, _shift(batch["targets"], k),
                                     mask_k))
  mtp = sum(per_layer) / len(per_layer)
  return main + cfg.mtp_loss_scale * mtp, (main, accuracy, mtp)


def _plain_load(cfg, batch):
  """The stand-in's expert load of the whole batch, [layers, E]."""
  layers = sum(map(cfg.is_moe_layer, range(cfg.num_layers)))
  e = cfg.num_experts
  real = batch["segment_ids"] != 0
  return np.stack([
      np.bincount(((batch["inputs"] + i) % e)[real], minlength=e)
      for i in range(layers + cfg.num_mtp_layers)]).astype(np.float32)


def _state(params):
  tx = optax.sgd(LR)
  return tx, state_lib.TrainState(params, tx.init(params),
                                  jax.random.key(3),
                                  jnp.asarray(STEP, jnp.int32))


def _schedule(step):
  return 0.01 * step + 0.5


@pytest.mark.parametrize("kind,n,chunks", [
    ("none", 1, 1), ("none", 2, 1), ("dense", 1, 2), ("mtp", 2, 1),
    ("moe_mtp", 1, 1), ("moe_mtp", 4, 2)])
def test_update_is_an_sgd_step_on_the_plain_loss(kind, n, chunks):
  """Loss, accuracy, MTP loss, gradient norm, learning rate, the new
  parameters (params - lr * jax.grad of the plain loss), step, rng, and
  with MoE the selection biases moved by the whole batch's load and the
  load metrics; in n micro-batches (each call of the model on B / n rows)
  and with the head in `chunks` pieces alike. Tolerance: float32 sums in
  another order, 1e-5 relative."""
  cfg = _config(kind)
  model = helpers.StandInModel(cfg)
  params = model.init(0, VOCAB, WIDTH)
  batch = jax.tree.map(jnp.asarray, _batch(1))
  tx, state = _state(params)
  # The first case by the defaults: no config, one micro-batch, one piece.
  args = () if (cfg, n, chunks) == (None, 1, 1) else (cfg, n, chunks)
  update = jax.jit(step_lib.make_update_fn(model, tx, _schedule, *args))
  new, metrics = update(state, batch)
  (_, (main, accuracy, mtp)), grads = jax.value_and_grad(
      lambda p: _plain_loss(cfg, p, batch), has_aux=True)(params)
  with_aux = kind in ("mtp", "moe_mtp")
  want = {"loss": main, "accuracy": accuracy,
          "grad_norm": optax.global_norm(grads), "lr": _schedule(STEP)}
  if with_aux:
    want["mtp_loss"] = mtp
  if kind == "moe_mtp":
    frac = _plain_load(cfg, batch)
    frac /= frac.sum(-1, keepdims=True)
    want.update(moe_load_max=frac.max(), moe_load_min=frac.min(),
                moe_load_imbalance=frac.max() * cfg.num_experts)
  assert set(metrics) == set(want)
  for key, value in want.items():
    np.testing.assert_allclose(metrics[key], value, rtol=1e-5, err_msg=key)
  # Every call of the model: B / n rows, auxiliary outputs only for MTP or
  # MoE, hidden states (the head inside the loss) with a kda_lm config.
  assert set(model.calls) == {(B // n, with_aux, cfg is None)}
  slots = model_lib.router_bias_slots(cfg) if kind == "moe_mtp" else []
  load = _plain_load(cfg, batch) if slots else None
  for module in params:
    for name, old in params[module].items():
      got = new.params[module][name]
      if name == moe.BIAS_NAME:
        slot, = [s for s in slots if s.module == module]
        rows = load[list(slot.rows)]
        rows = rows if slot.stacked else rows[0]
        want_bias = old + RATE * np.sign(rows.mean(-1, keepdims=True) - rows)
        np.testing.assert_allclose(got, want_bias, rtol=1e-6, err_msg=module)
        assert np.any(got != old)
      else:
        np.testing.assert_allclose(got, old - LR * grads[module][name],
                                   rtol=1e-5, atol=1e-6, err_msg=module)
  assert int(new.step) == STEP + 1
  np.testing.assert_array_equal(
      jax.random.key_data(new.rng),
      jax.random.key_data(jax.random.split(state.rng)[0]))


def test_one_micro_batch_runs_no_accumulation_loop():
  """With one micro-batch the step takes the gradient of the batch as it
  is; with n it loops over n micro-batches (one `scan` of length n): the
  loop and its zero-initialised sums are paid only when asked for."""
  model = helpers.StandInModel()
  params = model.init(0, VOCAB, WIDTH)
  batch = jax.tree.map(jnp.asarray, _batch(2))
  tx, state = _state(params)
  for n in (1, 2, 4):
    jaxpr = jax.make_jaxpr(step_lib.make_update_fn(
        model, tx, _schedule, grad_accum_steps=n))(state, batch)
    scans = [e.params["length"] for e in helpers.jaxpr_eqns(jaxpr.jaxpr)
             if e.primitive.name == "scan"]
    assert scans == ([] if n == 1 else [n])


def test_micro_batches_sum_to_the_batch_not_average():
  """Micro-batches of unequal scored counts: the accumulated loss and
  gradient are the whole batch's token-weighted ones (each micro-batch
  divided by the batch's count), not a mean of the micro-batches' means;
  the expert loads add up over the micro-batches."""
  cfg = _config("moe_mtp")
  model = helpers.StandInModel(cfg)
  params = model.init(4, VOCAB, WIDTH)
  batch = jax.tree.map(jnp.asarray, _batch(3))
  counts = step_lib.micro_batches(batch, 2)["loss_mask"].sum((1, 2))
  assert counts[0] != counts[1]
  loss_fn = _loss_fn(model, cfg)
  denominators = _denominators(batch, cfg)
  grads, extra = jax.jit(
      lambda p, b: _grads_and_extra(
          loss_fn, p, b, 2, denominators))(params, batch)
  (_, (main, accuracy, mtp)), want = jax.value_and_grad(
      lambda p: _plain_loss(cfg, p, batch), has_aux=True)(params)
  np.testing.assert_allclose(extra["main_loss"], main, rtol=1e-5)
  np.testing.assert_allclose(extra["accuracy"], accuracy, rtol=1e-5)
  np.testing.assert_allclose(extra["mtp_loss"], mtp, rtol=1e-5)
  np.testing.assert_array_equal(extra["expert_load"], _plain_load(cfg, batch))
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_loss_fn_terms_and_its_bad_split():
  """`_loss_fn`'s loss is main + mtp_loss_scale * MTP loss, each divided by
  the given denominators (not the batch's own counts). A split of the loss
  without the model config is refused."""
  cfg = _config("moe_mtp")
  model = helpers.StandInModel(cfg)
  params = model.init(5, VOCAB, WIDTH)
  batch = jax.tree.map(jnp.asarray, _batch(4))
  denominators = _denominators(batch, cfg)
  halved = jax.tree.map(lambda x: 2.0 * x, denominators)
  loss_fn = _loss_fn(model, cfg, 2)
  loss, extra = jax.jit(loss_fn)(params, batch, halved)
  _, (main, accuracy, mtp) = _plain_loss(cfg, params, batch)
  np.testing.assert_allclose(extra["main_loss"], main / 2, rtol=1e-5)
  np.testing.assert_allclose(extra["accuracy"], accuracy / 2, rtol=1e-5)
  np.testing.assert_allclose(extra["mtp_loss"], mtp / 2, rtol=1e-5)
  np.testing.assert_allclose(loss, (main + SCALE * mtp) / 2, rtol=1e-5)
  _loss_fn(model, None, 1)
  with pytest.raises(ValueError) as info:
    _loss_fn(model, None, 2)
  assert str(info.value) == (
      "config.train.loss_chunks > 1 needs the model config.")


def test_one_piece_and_one_micro_batch_unless_told():
  """With a model config, the loss and the update run the head in one
  piece and the batch in one micro-batch unless told: on rows of 7 tokens
  (split in no other way) they give the plain loss, the model called on
  all B rows."""
  cfg = _config("mtp")
  model = helpers.StandInModel(cfg)
  params = model.init(6, VOCAB, WIDTH)
  short = jax.tree.map(lambda x: jnp.asarray(x[:, :7]), _batch(5))
  want, (main, _, _) = _plain_loss(cfg, params, short)
  loss, _ = jax.jit(_loss_fn(model, cfg))(params, short,
                                          _denominators(short, cfg))
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  tx, state = _state(params)
  model.calls.clear()
  _, metrics = jax.jit(step_lib.make_update_fn(model, tx, _schedule, cfg))(
      state, short)
  np.testing.assert_allclose(metrics["loss"], main, rtol=1e-5)
  assert {rows for rows, _, _ in model.calls} == {B}
