"""Losses of the training and eval steps: masked next-token cross-entropy,
the segment-aware multi-token-prediction loss, and the one eval step that
training and `kda_lm.infer.evaluate` share.

Shapes as docs/glossary.md (B rows, T tokens, W vocabulary).
"""

from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import optax

from kda_lm.layers import mtp

Batch = Mapping[str, jax.Array]


def loss_terms(logits: jax.Array, batch: Batch
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Masked cross-entropy sums.

  Args:
    logits: [B,T,W] float32.
    batch: with `targets` [B,T] int and `loss_mask` [B,T] float.

  Returns:
    (sum of loss_mask-weighted cross-entropy, weighted count of correct
    argmax predictions, sum of loss_mask), float32 scalars.
  """
  targets = batch["targets"]
  mask = batch["loss_mask"].astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return (ce * mask).sum(), (correct * mask).sum(), mask.sum()


def mtp_weights(batch: Batch, num_layers: int) -> jax.Array:
  """[num_layers] float32: each MTP layer's scored-target count (the
  `loss_mask` sum of `kda_lm.layers.mtp.targets_and_mask`)."""
  return jnp.stack([
      mtp.targets_and_mask(batch["targets"], batch["loss_mask"],
                           batch["segment_ids"], k)[1].sum()
      for k in range(1, num_layers + 1)])


def mtp_loss(mtp_logits: jax.Array, batch: Batch,
             weights: Optional[jax.Array] = None) -> jax.Array:
  """Mean MTP cross-entropy over MTP layers, segment-aware.

  Args:
    mtp_logits: [num_mtp_layers, B,T,W]; layer k-1 predicts t_{i+k+1}.
    batch: with `targets`, `loss_mask` and `segment_ids`.
    weights: [num_mtp_layers] each layer's denominator, default its count
      in `batch` (`mtp_weights`); gradient accumulation passes the full
      batch's, so that the micro-batches' losses add up to the batch's.

  Returns:
    The float32 mean over layers of each layer's masked mean cross-entropy
    (targets and weights from `kda_lm.layers.mtp.targets_and_mask`).
  """
  losses = []
  for k in range(1, mtp_logits.shape[0] + 1):
    targets, mask = mtp.targets_and_mask(batch["targets"], batch["loss_mask"],
                                         batch["segment_ids"], k)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        mtp_logits[k - 1].astype(jnp.float32), targets)
    weight = mask.sum() if weights is None else weights[k - 1]
    losses.append((ce * mask).sum() / jnp.maximum(weight, 1.0))
  return jnp.mean(jnp.stack(losses))


def apply_batch(model: Any, params: Any, batch: Batch,
                return_aux: bool = False) -> Any:
  """The model (`kda_lm.model.build`) on a packed batch: its `inputs`,
  `segment_ids` and `positions` (`data.packing.FEATURES`)."""
  return model.apply(params, batch["inputs"],
                     segment_ids=batch["segment_ids"],
                     positions=batch["positions"], return_aux=return_aux)


def make_eval_step(model: Any, token_bytes: Optional[Any] = None
                   ) -> Callable[[Any, Batch], jax.Array]:
  """`eval_step(params, batch) -> [loss_sum, correct, weight, bytes]`.

  The sums are over the batch's `loss_mask`-weighted targets; `bytes`
  counts the UTF-8 bytes the scored targets stand for, for bits per byte.

  Args:
    model: the `hk.Transformed` model.
    token_bytes: float `[W]` bytes per token id (`pipeline.token_bytes`);
      None counts one byte per scored token.
  """
  nbytes_W = (None if token_bytes is None
              else jnp.asarray(token_bytes, jnp.float32))

  def eval_step(params, batch):
    loss_sum, correct, weight = loss_terms(
        apply_batch(model, params, batch), batch)
    mask = batch["loss_mask"].astype(jnp.float32)
    byte_count = weight if nbytes_W is None else (
        nbytes_W[batch["targets"]] * mask).sum()
    return jnp.stack([loss_sum, correct, weight, byte_count])

  return eval_step
