"""The MTP loss, the chunked head's sums and gradient, `apply_batch` and the
eval step (kda_lm/losses.py) against plain formulas, on tiny float32
inputs and a stand-in model (`helpers.StandInModel`), no model compiled.
"""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_lm import losses

# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

W, D = 16, 6


def _ce(logits, targets):
  """Per-token cross-entropy, float32."""
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None],
                              -1)[..., 0]


def _shift(x, k):
  """x[:, i + k], zero past the row's end."""
  return jnp.concatenate([x[:, k:], jnp.zeros_like(x[:, :k])], axis=1)


class _Recorder:
  """A model that records the arguments of each `apply`."""

  def __init__(self):
    self.calls = []

  def apply(self, params, inputs, **kwargs):
    self.calls.append((params, inputs, kwargs))
    return inputs


def test_apply_batch_passes_the_batch_and_the_mode():
  """The packed batch's inputs, segment ids and positions; `return_aux`
  False and no `logits` argument unless asked (a model that is not
  kda_lm's takes none); `logits=False` passed as such."""
  batch = {"inputs": np.arange(3), "segment_ids": np.ones(3, np.int32),
           "positions": np.arange(3) + 1, "targets": np.zeros(3)}
  model = _Recorder()
  params = {"p": 1}
  losses.apply_batch(model, params, batch)
  losses.apply_batch(model, params, batch, return_aux=True)
  losses.apply_batch(model, params, batch, logits=False)
  losses.apply_batch(model, params, batch, True, True)
  common = {"segment_ids": batch["segment_ids"],
            "positions": batch["positions"]}
  want = [dict(common, return_aux=False), dict(common, return_aux=True),
          dict(common, return_aux=False, logits=False),
          dict(common, return_aux=True)]
  assert len(model.calls) == len(want)
  for (p, inputs, kwargs), w in zip(model.calls, want, strict=True):
    assert p is params and inputs is batch["inputs"]
    assert kwargs.keys() == w.keys()
    for key, value in w.items():
      assert kwargs[key] is value


def test_eval_step_in_pieces_needs_the_head():
  """`chunks` > 1 without `head_weight` is refused by name; one piece
  without it and several with it are not."""
  model = helpers.StandInModel()
  losses.make_eval_step(model, chunks=1)
  losses.make_eval_step(model, head_weight=lambda p: p, chunks=2)
  with pytest.raises(ValueError) as info:
    losses.make_eval_step(model, chunks=2)
  assert str(info.value) == ("An eval step in loss_chunks > 1 pieces needs "
                             "the model's head_weight.")


def _head_inputs(seed, B=2, T=8):
  """Hidden states, a head, and targets of which about half are the
  logits' argmax (so the correct count is neither 0 nor all), a mask with
  holes."""
  rng = np.random.default_rng(seed)
  y = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(D, W)), jnp.float32)
  top = np.asarray(jnp.argmax(y @ w, -1))
  other = rng.integers(0, W, (B, T))
  targets = np.where(rng.random((B, T)) < 0.5, top, other).astype(np.int32)
  mask = (rng.random((B, T)) < 0.75).astype(np.float32)
  return y, w, {"targets": jnp.asarray(targets),
                "loss_mask": jnp.asarray(mask)}


def _plain_sums(y, w, batch):
  """[masked cross-entropy sum, masked correct count] of y @ w."""
  logits = y @ w
  mask = batch["loss_mask"]
  hits = jnp.argmax(logits, -1) == batch["targets"]
  return jnp.stack([(_ce(logits, batch["targets"]) * mask).sum(),
                    (hits * mask).sum()])


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_chunked_head_sums_every_piece(chunks):
  """The head's loss and correct sums in 1, 2 or 4 pieces (the plain pass,
  no gradient) are those of the whole logits. Tolerance: float32 sums in
  another order, 1e-6 relative."""
  y, w, batch = _head_inputs(1)
  want = _plain_sums(y, w, batch)
  assert 0 < float(want[1]) < float(batch["loss_mask"].sum())
  got = losses.loss_terms(y, batch, head_DW=w, chunks=chunks)
  np.testing.assert_allclose(got[:2], want, rtol=1e-6)


def test_chunked_head_gradient_follows_the_cotangent():
  """The head's gradient wrt the hidden states and the head, pulled back
  from a cotangent (g_loss, g_correct) = (-3, 5), is -3 times autodiff's
  gradient of the plain loss sum: the correct count carries none.
  Tolerance: float32, 1e-5 relative."""
  y, w, batch = _head_inputs(2)
  sums = lambda a, b: jnp.stack(losses.loss_terms(a, batch, b, 2)[:2])
  got_sums, pull = jax.vjp(sums, y, w)
  np.testing.assert_allclose(got_sums, _plain_sums(y, w, batch), rtol=1e-6)
  got = pull(jnp.asarray([-3.0, 5.0]))
  want = jax.grad(lambda a, b: _plain_sums(a, b, batch)[0], (0, 1))(y, w)
  for g, h in zip(got, want, strict=True):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, -3.0 * h, rtol=1e-5, atol=1e-6)


def _row():
  """helpers.LOSS_ROW with targets below W: documents of 3 and 4 scored
  targets, then padding, so MTP layers 1 to 4 score 5, 3, 1 and 0."""
  row = {k: jnp.asarray(v) for k, v in helpers.LOSS_ROW.items()}
  row["targets"] = row["targets"] % W
  return row


def _plain_mtp_sums(logits, batch):
  """Per MTP layer k (1-based): the cross-entropy sum of targets k ahead in
  the same document, and their count."""
  seg = batch["segment_ids"]
  sums, counts = [], []
  for k in range(1, logits.shape[0] + 1):
    mask = _shift(batch["loss_mask"], k) * ((_shift(seg, k) == seg)
                                            & (seg != 0))
    ce = _ce(logits[k - 1], _shift(batch["targets"], k))
    sums.append(float((ce * mask).sum()))
    counts.append(float(mask.sum()))
  return np.array(sums), np.array(counts)


def test_mtp_loss_is_the_mean_of_each_layers_mean():
  """Four MTP layers scoring 5, 3, 1 and 0 targets: the loss is the mean
  over layers of each layer's cross-entropy sum over its count (a layer
  without a target counts 0, not NaN; one with a single target, that
  target's loss), or over the given weights; from hidden states through
  the head in pieces alike. Tolerance: float32, 1e-6 relative."""
  rng = np.random.default_rng(0)
  batch = _row()
  mtp_loss = jax.jit(losses.mtp_loss, static_argnames="chunks")
  y = jnp.asarray(rng.normal(size=(4, 1, 8, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(D, W)), jnp.float32)
  logits = y @ w
  sums, counts = _plain_mtp_sums(logits, batch)
  assert counts.tolist() == [5.0, 3.0, 1.0, 0.0] and sums[3] == 0.0
  want = np.mean(sums / np.maximum(counts, 1.0))
  np.testing.assert_allclose(mtp_loss(logits, batch), want,
                             rtol=1e-6)
  for chunks in (1, 2):
    np.testing.assert_allclose(
        mtp_loss(y, batch, head_DW=w, chunks=chunks), want,
        rtol=1e-6)
  # One piece unless told: 7 tokens split in no other way.
  short = {k: v[:, :7] for k, v in batch.items()}
  short_sums, short_counts = _plain_mtp_sums(logits[:, :, :7], short)
  np.testing.assert_allclose(
      mtp_loss(y[:, :, :7], short, head_DW=w),
      np.mean(short_sums / np.maximum(short_counts, 1.0)), rtol=1e-6)
  weights = jnp.asarray([2.0, 4.0, 8.0, 16.0])
  np.testing.assert_allclose(mtp_loss(logits, batch, weights),
                             np.mean(sums / np.asarray(weights)), rtol=1e-6)
  # An odd number of layers: the mean over those only (4 layers + 1 is
  # also 4 ^ 1 and 4 | 1; 3 + 1 is neither).
  np.testing.assert_allclose(mtp_loss(logits[:3], batch),
                             np.mean(sums[:3] / counts[:3]), rtol=1e-6)


def _eval_batch(seed, T):
  rng = np.random.default_rng(seed)
  seg = np.ones((2, T), np.int32)
  mask = (rng.random((2, T)) < 0.7).astype(np.float32)
  return {"inputs": jnp.asarray(rng.integers(0, W, (2, T)), jnp.int32),
          "targets": jnp.asarray(rng.integers(0, W, (2, T)), jnp.int32),
          "segment_ids": jnp.asarray(seg),
          "positions": jnp.asarray(np.tile(np.arange(T), (2, 1))),
          "loss_mask": jnp.asarray(mask)}


@pytest.mark.parametrize("T,chunks", [(7, None), (8, 4)])
def test_eval_step_sums_against_the_plain_formula(T, chunks):
  """[loss sum, correct, weight, bytes] of a batch with unscored targets:
  from the model's logits, or with `head_weight` from its hidden states
  through the head in `chunks` pieces (one unless told: 7 tokens split in
  no other way); bytes from `token_bytes` of the scored targets, else one
  per scored target. Tolerance: float32 sums, 1e-6 relative."""
  cfg = helpers.tiny_model(vocab_size=W, attention_pattern="KM",
                           num_experts=0)
  model = helpers.StandInModel(cfg)
  params = model.init(0, W, D)
  batch = _eval_batch(T, T)
  plain = _plain_sums(model.hidden(params, batch["inputs"],
                                   batch["positions"]),
                      params["lm_head"]["w"], batch)
  mask = batch["loss_mask"]
  token_bytes = np.arange(W, dtype=np.float32) % 5 + 1
  nbytes = float((token_bytes[np.asarray(batch["targets"])] * mask).sum())
  head = lambda p: p["lm_head"]["w"]
  kwargs = {} if chunks is None else {"chunks": chunks}
  for step, want_bytes, want_logits in [
      (losses.make_eval_step(model), mask.sum(), True),
      (losses.make_eval_step(model, token_bytes), nbytes, True),
      (losses.make_eval_step(model, None, head, **kwargs), mask.sum(),
       False),
      (losses.make_eval_step(model, token_bytes, head, **kwargs), nbytes,
       False)]:
    model.calls.clear()
    got = jax.jit(step)(params, batch)
    np.testing.assert_allclose(
        got, [plain[0], plain[1], mask.sum(), want_bytes], rtol=1e-6)
    assert model.calls == [(2, False, want_logits)]
