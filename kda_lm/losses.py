"""Losses of the training and eval steps: masked next-token cross-entropy,
the segment-aware multi-token-prediction loss, and the one eval step that
training and `kda_lm.infer.evaluate` share.

Each takes either logits or, with the LM head's weight, the final hidden
states: then the head and the cross-entropy run inside `jax.shard_map` on
each device's own rows (`parallel.maps.row_sum_map`: no mesh can make
GSPMD gather the batch's logits), over `chunks` strided pieces of the
rows, so that no [B,T,W] float32 logits are held
(`config.train.loss_chunks`). There the gradient wrt the hidden states and
the head is made in the same pass as the loss, from each piece's logits
while they exist: three matmuls per piece instead of four (the forward,
then a recomputing backward), the logits' gradient in the hidden states'
dtype (bfloat16 in training) with float32 accumulation.

Shapes as docs/glossary.md (B rows, T tokens, D width, W vocabulary).
"""

import functools
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp

from kda_lm.layers import mtp
from kda_lm.parallel import maps as parallel_maps

Batch = Mapping[str, jax.Array]


def _token_terms(logits, targets):
  """Per token: the cross-entropy, whether the prediction is correct, and
  the softmax's numerator and denominator (`exp(logits - max)`, its sum).

  Correct means the target's logit is the largest and no other logit
  equals it: argmax without its tie rule, read from the row's maximum and
  a count beside the softmax's sum, so no pass over the [.., W] logits
  of its own (an argmax is one: 3.4 of a v5e's 166 ms benchmark step).
  """
  top = jnp.max(logits, axis=-1, keepdims=True)
  e = jnp.exp(logits - top)
  s = jnp.sum(e, axis=-1, keepdims=True)
  # Counted in float32, as the sum: XLA then makes both in one reduction.
  at_top = jnp.sum((logits == top).astype(logits.dtype), axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)
  ce = (top + jnp.log(s) - picked)[..., 0]
  correct = ((picked[..., 0] == top[..., 0]) & (at_top == 1)).astype(
      jnp.float32)
  return ce, correct, e, s


def _ce_and_correct(logits, targets, mask):
  """The masked cross-entropy and correct-prediction sums of float32
  logits (`_token_terms`)."""
  ce, correct, _, _ = _token_terms(logits, targets)
  return jnp.stack([(ce * mask).sum(), (correct * mask).sum()])


def _pieces(x, chunks):
  """[B,T,...] -> [chunks, B,T/chunks,...]; piece j holds tokens j,
  j+chunks, ...: every piece spans the whole row, so a row split over
  `context` splits each piece the same way."""
  B, T = x.shape[:2]
  return jnp.moveaxis(x.reshape(B, T // chunks, chunks, *x.shape[2:]), 2, 0)


def _unpieces(x):
  """The inverse of `_pieces`: [chunks, B,T/chunks,...] -> [B,T,...]."""
  c, B, Tc = x.shape[:3]
  return jnp.moveaxis(x, 0, 2).reshape(B, Tc * c, *x.shape[3:])


def _piece_sums(y, w_DW, t, m):
  """[loss sum, correct sum] of one piece's logits `y @ w`, and their
  softmax (float32)."""
  logits = jnp.dot(y, w_DW, preferred_element_type=jnp.float32)
  ce, correct, e, s = _token_terms(logits, t)
  return jnp.stack([(ce * m).sum(), (correct * m).sum()]), e / s


def _piece_grads(y, w_DW, t, m):
  """`_piece_sums` and the loss sum's gradients wrt y and w (float32)."""
  sums, p = _piece_sums(y, w_DW, t, m)
  d = (p - jax.nn.one_hot(t, p.shape[-1], dtype=p.dtype)) * m[..., None]
  d = d.astype(y.dtype)
  dy = jnp.dot(d, w_DW.T, preferred_element_type=jnp.float32)
  dw = jnp.einsum("...d,...w->dw", y, d, preferred_element_type=jnp.float32)
  return sums, dy.astype(y.dtype), dw


def _check_chunks(T, chunks):
  if not isinstance(chunks, int) or chunks < 1 or T % chunks:
    raise ValueError(f"config.train.loss_chunks must be an int >= 1 that "
                     f"divides the row length {T}, got {chunks!r}.")


def _local_sums(y_BTD, targets, mask, w_DW, *, chunks):
  """(([loss sum, correct sum],), no per-token output) of `y @ w`, one
  piece (`_pieces`) at a time."""
  def piece(total, xs):
    return total + _piece_sums(xs[0], w_DW, xs[1], xs[2])[0], None

  sums, _ = jax.lax.scan(piece, jnp.zeros(2, jnp.float32),
                         (_pieces(y_BTD, chunks), _pieces(targets, chunks),
                          _pieces(mask, chunks)))
  return (sums,), ()


def _local_grads(y_BTD, targets, mask, w_DW, *, chunks):
  """((sums, the loss sum's gradient wrt w), its gradient wrt y)."""
  def piece(carry, xs):
    total, dw = carry
    sums, dy, dw_piece = _piece_grads(xs[0], w_DW, xs[1], xs[2])
    return (total + sums, (dw + dw_piece).astype(dw.dtype)), dy

  # The head's gradient adds up in the head's dtype (bfloat16 in training,
  # as autodiff would): a float32 sum moves twice the bytes, each piece
  # reading and writing all of it (19 ms of a v5e's 182 ms step).
  init = (jnp.zeros(2, jnp.float32), jnp.zeros(w_DW.shape, w_DW.dtype))
  (sums, dw), dy = jax.lax.scan(
      piece, init, (_pieces(y_BTD, chunks), _pieces(targets, chunks),
                    _pieces(mask, chunks)))
  return (sums, dw), _unpieces(dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _head_sums(y_BTD, w_DW, targets, mask, chunks):
  """[loss sum, correct sum] of `y @ w` one piece (`_pieces`) at a time,
  each device on its own rows (`parallel_maps.row_sum_map`).

  Its gradient is computed in the same pass as the loss (`_head_sums_fwd`):
  each piece's logits are made once and never stored, and the backward
  pass only scales the gradients by the loss's cotangent.
  """
  (sums,), _ = parallel_maps.row_sum_map(
      functools.partial(_local_sums, chunks=chunks),
      (y_BTD, targets, mask), (w_DW,))
  return sums


def _head_sums_fwd(y_BTD, w_DW, targets, mask, chunks):
  (sums, dw), dy = parallel_maps.row_sum_map(
      functools.partial(_local_grads, chunks=chunks),
      (y_BTD, targets, mask), (w_DW,))
  return sums, (dy, dw)


def _head_sums_bwd(chunks, residuals, g):
  del chunks
  dy, dw = residuals
  return ((g[0] * dy).astype(dy.dtype), (g[0] * dw).astype(dw.dtype),
          None, None)


_head_sums.defvjp(_head_sums_fwd, _head_sums_bwd)


def _chunked_sums(y_BTD, head_DW, targets, mask, chunks):
  """`_head_sums` with the head in the hidden states' dtype."""
  _check_chunks(y_BTD.shape[1], chunks)
  return _head_sums(y_BTD, head_DW.astype(y_BTD.dtype), targets, mask,
                    chunks)


def _sums(out, targets, mask, head_DW, chunks):
  """[loss sum, correct sum] of logits `out`, or of hidden states `out`
  through `head_DW` in `chunks` pieces."""
  mask = mask.astype(jnp.float32)
  if head_DW is None:
    return _ce_and_correct(out.astype(jnp.float32), targets, mask)
  return _chunked_sums(out, head_DW, targets, mask, chunks)


def loss_terms(logits: jax.Array, batch: Batch,
               head_DW: Optional[jax.Array] = None, chunks: int = 1
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Masked cross-entropy sums.

  Args:
    logits: [B,T,W] float32; or, with `head_DW`, the final hidden states
      [B,T,D] that the LM head maps to logits.
    batch: with `targets` [B,T] int and `loss_mask` [B,T] float.
    head_DW: the LM head's weight (`kda_lm.model.head_weight`), or None.
    chunks: with `head_DW`, the strided pieces of the rows that the head
      and the cross-entropy run in (must divide T).

  Returns:
    (sum of loss_mask-weighted cross-entropy, weighted count of correct
    argmax predictions, sum of loss_mask), float32 scalars.

  Raises:
    ValueError: `chunks` does not divide T.
  """
  with jax.named_scope("loss"):    # Names the ops in profiles.
    mask = batch["loss_mask"].astype(jnp.float32)
    sums = _sums(logits, batch["targets"], mask, head_DW, chunks)
  return sums[0], sums[1], mask.sum()


def mtp_weights(batch: Batch, num_layers: int) -> jax.Array:
  """[num_layers] float32: each MTP layer's scored-target count (the
  `loss_mask` sum of `kda_lm.layers.mtp.targets_and_mask`)."""
  return jnp.stack([
      mtp.targets_and_mask(batch["targets"], batch["loss_mask"],
                           batch["segment_ids"], k)[1].sum()
      for k in range(1, num_layers + 1)])


def mtp_loss(mtp_logits: jax.Array, batch: Batch,
             weights: Optional[jax.Array] = None,
             head_DW: Optional[jax.Array] = None, chunks: int = 1
             ) -> jax.Array:
  """Mean MTP cross-entropy over MTP layers, segment-aware.

  Args:
    mtp_logits: [num_mtp_layers, B,T,W]; layer k-1 predicts t_{i+k+1}.
      With `head_DW`, the MTP layers' final hidden states [.., B,T,D].
    batch: with `targets`, `loss_mask` and `segment_ids`.
    weights: [num_mtp_layers] each layer's denominator, default its count
      in `batch` (`mtp_weights`); gradient accumulation passes the full
      batch's, so that the micro-batches' losses add up to the batch's.
    head_DW: the LM head's weight, or None (see `loss_terms`).
    chunks: with `head_DW`, pieces per row (see `loss_terms`).

  Returns:
    The float32 mean over layers of each layer's masked mean cross-entropy
    (targets and weights from `kda_lm.layers.mtp.targets_and_mask`).
  """
  losses = []
  for k in range(1, mtp_logits.shape[0] + 1):
    targets, mask = mtp.targets_and_mask(batch["targets"], batch["loss_mask"],
                                         batch["segment_ids"], k)
    ce_sum = _sums(mtp_logits[k - 1], targets, mask, head_DW, chunks)[0]
    weight = mask.sum() if weights is None else weights[k - 1]
    losses.append(ce_sum / jnp.maximum(weight, 1.0))
  return jnp.mean(jnp.stack(losses))


def apply_batch(model: Any, params: Any, batch: Batch,
                return_aux: bool = False, logits: bool = True) -> Any:
  """The model (`kda_lm.model.build`) on a packed batch: its `inputs`,
  `segment_ids` and `positions` (`data.packing.FEATURES`); `logits=False`
  returns the final hidden states instead (`kda_lm.model.forward`)."""
  extra = {} if logits else {"logits": False}
  return model.apply(params, batch["inputs"],
                     segment_ids=batch["segment_ids"],
                     positions=batch["positions"], return_aux=return_aux,
                     **extra)


def make_eval_step(model: Any, token_bytes: Optional[Any] = None,
                   head_weight: Optional[Callable[[Any], jax.Array]] = None,
                   chunks: int = 1) -> Callable[[Any, Batch], jax.Array]:
  """`eval_step(params, batch) -> [loss_sum, correct, weight, bytes]`.

  The sums are over the batch's `loss_mask`-weighted targets; `bytes`
  counts the UTF-8 bytes the scored targets stand for, for bits per byte.

  Args:
    model: the `hk.Transformed` model.
    token_bytes: float `[W]` bytes per token id (`pipeline.token_bytes`);
      None counts one byte per scored token.
    head_weight: `params -> head_DW` (the LM head's weight,
      `kda_lm.model.head_weight`): the model then returns hidden states
      and the head runs inside the loss, each device on its own rows, in
      `chunks` pieces of each row, as the training loss does
      (`config.train.loss_chunks`). None: the loss reads the model's
      logits (`chunks` must be 1).
    chunks: pieces per row (must divide T).

  Raises:
    ValueError: `chunks` > 1 without `head_weight`.
  """
  nbytes_W = (None if token_bytes is None
              else jnp.asarray(token_bytes, jnp.float32))
  chunked = head_weight is not None
  if chunks > 1 and not chunked:
    raise ValueError("An eval step in loss_chunks > 1 pieces needs the "
                     "model's head_weight.")

  def eval_step(params, batch):
    loss_sum, correct, weight = loss_terms(
        apply_batch(model, params, batch, logits=not chunked), batch,
        head_weight(params) if chunked else None, chunks)
    mask = batch["loss_mask"].astype(jnp.float32)
    byte_count = weight if nbytes_W is None else (
        nbytes_W[batch["targets"]] * mask).sum()
    return jnp.stack([loss_sum, correct, weight, byte_count])

  return eval_step
