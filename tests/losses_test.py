"""Tests of kda_lm/losses.py: masked cross-entropy and the MTP loss."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from kda_lm import losses
from kda_lm.parallel import sharding
from testbed import numerics

# A packed row of two documents, then padding.
ROW = helpers.LOSS_ROW


def test_loss_terms_are_masked_sums():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(1, 8, 32)), jnp.float32)
  batch = {k: jnp.asarray(v) for k, v in ROW.items()}
  loss_sum, correct, weight = losses.loss_terms(logits, batch)
  ce = optax.softmax_cross_entropy_with_integer_labels(
      logits[0, :7], batch["targets"][0, :7])
  np.testing.assert_allclose(loss_sum, ce.sum(), rtol=1e-6)
  hits = np.argmax(logits[0, :7], -1) == ROW["targets"][0, :7]
  assert float(correct) == hits.sum() and float(weight) == 7.0


def test_a_tied_maximum_is_not_a_correct_prediction():
  """Correct = the target's logit is the unique maximum, in the logits
  path and in the chunked head alike (argmax's first-index rule would
  count row 1, and at initialisation with equal logits, token 0)."""
  y = jnp.eye(4, dtype=jnp.float32)[None]           # [1, 4, 4]
  w = jnp.asarray([[2., 0., 2., 0.],                 # tie: tokens 0 and 2
                   [0., 3., 1., 0.],                 # 1 alone on top
                   [1., 1., 1., 1.],                 # all tied
                   [0., 0., 0., 5.]], jnp.float32)   # 3 alone on top
  batch = dict(targets=jnp.asarray([[0, 1, 0, 2]]),
               loss_mask=jnp.ones((1, 4), jnp.float32))
  # Token 0's target 0 is tied, 1's target is the top, 2's target ties
  # with everything, 3's target 2 is not the top: one correct.
  for got in (losses.loss_terms(y @ w, batch),
              losses.loss_terms(y, batch, head_DW=w, chunks=2)):
    assert float(got[1]) == 1.0
  w = w.at[0, 2].set(1.5)                             # token 0: 0 on top
  assert float(losses.loss_terms(y @ w, batch)[1]) == 2.0
  # No argmax: a pass over the logits of its own on a TPU.
  jaxpr = jax.make_jaxpr(lambda a, b: jax.value_and_grad(
      lambda a, b: losses.loss_terms(a, batch, b, 2)[0], (0, 1))(a, b))(y, w)
  assert "argmax" not in str(jaxpr) and "reduce_max" in str(jaxpr)


def test_mtp_loss_ignores_padding_and_boundaries():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(1, 1, 8, 32)), jnp.float32)
  batch = {k: jnp.asarray(v) for k, v in ROW.items()}
  base = losses.mtp_loss(logits, batch)
  # Garbage at positions without an MTP target changes nothing.
  noisy = logits.at[0, 0, jnp.array([2, 6, 7])].set(1e3)
  np.testing.assert_allclose(losses.mtp_loss(noisy, batch), base,
                             rtol=1e-6)
  want = optax.softmax_cross_entropy_with_integer_labels(
      logits[0, 0, jnp.array([0, 1, 3, 4, 5])],
      jnp.array([12, 13, 22, 23, 24])).mean()
  np.testing.assert_allclose(base, want, rtol=1e-6)


def test_chunked_head_equals_the_logits_and_names_a_bad_split():
  rng = np.random.default_rng(2)
  y = jnp.asarray(rng.normal(size=(1, 8, 6)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(6, 32)), jnp.float32)
  batch = {k: jnp.asarray(v) for k, v in ROW.items()}
  want = losses.loss_terms(y @ w, batch)
  got = losses.loss_terms(y, batch, head_DW=w, chunks=4)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # One piece unless told.
  np.testing.assert_allclose(losses.loss_terms(y, batch, head_DW=w), want,
                             rtol=1e-6)
  grad = lambda f: jax.grad(f, argnums=(0, 1))(y, w)
  want_g = grad(lambda a, b: losses.loss_terms(a @ b, batch)[0])
  got_g = grad(lambda a, b: losses.loss_terms(a, batch, b, 4)[0])
  for g, h in zip(got_g, want_g, strict=True):
    assert numerics.rel_err(g, h) < 1e-6
  mtp = losses.mtp_loss((y @ w)[None], batch)
  np.testing.assert_allclose(losses.mtp_loss(y[None], batch, None, w, 2),
                             mtp, rtol=1e-6)
  with pytest.raises(ValueError, match="loss_chunks must .* divides the "
                     "row length 8, got 3"):
    losses.loss_terms(y, batch, head_DW=w, chunks=3)


@pytest.mark.parametrize("chunks", [0, -2, 2.0, 3])
def test_a_bad_loss_split_is_refused_by_name(chunks):
  """Zero, negative, non-int and non-dividing piece counts (`2.0` divides
  the row, but only an int is a count)."""
  y = jnp.zeros((1, 8, 6), jnp.float32)
  w = jnp.zeros((6, 32), jnp.float32)
  batch = {k: jnp.asarray(v) for k, v in ROW.items()}
  with pytest.raises(ValueError) as info:
    losses.loss_terms(y, batch, head_DW=w, chunks=chunks)
  assert str(info.value) == (
      "config.train.loss_chunks must be an int >= 1 that divides the row "
      f"length 8, got {chunks!r}.")


def test_mtp_weights_count_each_layers_scored_targets():
  """MTP layer k scores the targets k tokens ahead in the same document:
  5, 3 and 1 of the row's (documents of 3 and 4 tokens, then padding)."""
  batch = {k: jnp.asarray(v) for k, v in ROW.items()}
  assert losses.mtp_weights(batch, 3).tolist() == [5.0, 3.0, 1.0]
  assert losses.mtp_weights(batch, 1).tolist() == [5.0]


def test_the_gradient_pass_sums_as_the_plain_pass():
  """Under `jax.grad` the chunked head's loss and correct counts come from
  its gradient pass (the custom VJP's forward, summing over the pieces),
  which training logs: they equal the plain pass's (a seed where two of
  the seven scored tokens are predicted)."""
  rng = np.random.default_rng(18)
  y = jnp.asarray(rng.normal(size=(1, 8, 6)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(6, 32)), jnp.float32)
  batch = {k: jnp.asarray(v) for k, v in ROW.items()}
  want = losses.loss_terms(y, batch, head_DW=w, chunks=4)
  (loss, correct), _ = jax.value_and_grad(
      lambda a, b: tuple(losses.loss_terms(a, batch, b, 4)[:2]),
      argnums=(0, 1), has_aux=True)(y, w)
  np.testing.assert_allclose(loss, want[0], rtol=1e-6)
  assert float(correct) == float(want[1]) == 2.0


def test_loss_piece_j_holds_tokens_j_mod_c():
  """Piece j of `loss_chunks` c is tokens j, j+c, ... of every row, so a
  row split over `context` splits every piece alike (no all-gather). A
  split along another axis gives the same loss on one device, so the
  layout itself is asserted."""
  B, T, c = 2, 12, 3
  x = jnp.arange(B * T * 2).reshape(B, T, 2)
  pieces = losses._pieces(x, c)  # pylint: disable=protected-access
  assert pieces.shape == (c, B, T // c, 2)
  for j in range(c):
    np.testing.assert_array_equal(pieces[j], x[:, j::c])


def test_chunked_head_makes_its_gradient_with_the_loss():
  """Three matmuls per piece (logits, then the two gradients while the
  logits exist), none in the backward pass; the gradient scales with the
  loss's cotangent; in bfloat16 it stays within bfloat16's rounding of the
  float32 gradient."""
  rng = np.random.default_rng(3)
  y = jnp.asarray(rng.normal(size=(2, 16, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)
  batch = {"targets": jnp.asarray(rng.integers(0, 64, (2, 16)), jnp.int32),
           "loss_mask": jnp.asarray(rng.random((2, 16)) > 0.2, jnp.float32)}
  loss = lambda a, b, s=1.0: s * losses.loss_terms(a, batch, b, 4)[0]
  grad = jax.grad(loss, argnums=(0, 1))
  dots = [e for e in helpers.jaxpr_eqns(jax.make_jaxpr(grad)(y, w).jaxpr)
          if e.primitive.name == "dot_general"]
  assert len(dots) == 3
  g1 = grad(y, w)
  g3 = jax.grad(loss, argnums=(0, 1))(y, w, -3.0)
  for a, b in zip(g1, g3, strict=True):
    np.testing.assert_allclose(b, -3.0 * a, rtol=1e-6)
  bf = lambda x: x.astype(jnp.bfloat16)
  got = jax.grad(loss, argnums=(0, 1))(bf(y), bf(w))
  want = jax.grad(loss, argnums=(0, 1))(
      bf(y).astype(jnp.float32), bf(w).astype(jnp.float32))
  for g, h in zip(got, want, strict=True):
    assert g.dtype == jnp.bfloat16
    assert numerics.rel_err(g.astype(jnp.float32), h) < 1e-2


@pytest.mark.parametrize("shape", [(1, 4, 1, 1), (2, 2, 1, 1),
                                   (1, 2, 1, 2), (1, 1, 4, 1)])
def test_head_and_loss_run_on_each_devices_rows(shape):
  """On every mesh the head's matmuls and the cross-entropy run inside
  `shard_map` on each device's rows: GSPMD, left to place them, gathered
  the whole batch's logits onto every device when the head's vocabulary
  and the rows were split over the same axis (`fsdp`)."""
  auto = (jax.sharding.AxisType.Auto,) * 4
  mesh = jax.sharding.AbstractMesh(shape, sharding.AXES, axis_types=auto)
  y = jax.ShapeDtypeStruct((4, 16, 8), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((8, 64), jnp.bfloat16)
  batch = {"targets": jax.ShapeDtypeStruct((4, 16), jnp.int32),
           "loss_mask": jax.ShapeDtypeStruct((4, 16), jnp.float32)}
  loss = lambda a, b, batch: losses.loss_terms(a, batch, b, 2)[0]
  with jax.sharding.use_abstract_mesh(mesh):
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1)))(
        y, w, batch).jaxpr
  maps = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
  inside = [e.primitive.name for m in maps
            for e in helpers.jaxpr_eqns(m.params["jaxpr"])]
  outside = [e.primitive.name for e in helpers.jaxpr_eqns(jaxpr)]
  assert inside.count("dot_general") == 3, inside
  assert outside.count("dot_general") == 3, outside  # none outside
  assert "reduce_max" in inside and "exp" in inside
