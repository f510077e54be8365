r"""Validation loss, accuracy and perplexity, per document and packed.

`python -m kda_lm.infer.evaluate --workdir=runs/ling3_tiny` loads the run's
config and newest checkpoint and evaluates the whole validation split three ways
(per token and per byte):

* per document: every document alone in its row (no packing; the row's tail
  is padding, segment id 0), split into `seq_len`-pair pieces exactly as
  the packer splits long documents;
* packed, resets on: the training pipeline's packed rows with per-document
  segment ids (`reset_at_document_boundaries=True`);
* packed, resets off: the same rows as one sequence each
  (`reset_at_document_boundaries=False`: state, convolutions and attention
  run across document boundaries).

The first two must agree (to float32 summation order, ~1e-6 relative): that
is what segment ids are for. The third shows how far packing without resets
drifts. Loss is the mean cross-entropy over `loss_mask` targets (nats per
token), accuracy the argmax hit rate, perplexity `exp(loss)`; bits per byte
divide the same cross-entropy by the UTF-8 bytes the targets stand for (a
BPE token's bytes; 1 per byte-level token), so that runs with different
tokenizers compare.
"""

import functools
import math
from typing import Any, Iterator, Mapping

from absl import app, flags
import haiku as hk
import jax
import ml_collections
import numpy as np

import kda_lm  # noqa: F401  # isort: skip  (first: XLA:CPU flags)
from data import packing, pipeline
from kda_lm import config as config_lib
from kda_lm import logs, losses
from kda_lm import model as model_lib
from kda_lm.train import state as state_lib

Batch = Mapping[str, np.ndarray]


def document_rows(tokens: np.ndarray, loss_mask: Any, seq_len: int
                  ) -> list[dict[str, np.ndarray]]:
  """One document as rows of its own: `[seq_len]` features per piece.

  Pairs `(t[j], t[j+1])` with the mask of the target; pieces of `seq_len`
  pairs, each its own segment (as `data.packing`).
  """
  tokens = np.asarray(tokens, np.int32)
  mask = (np.ones(len(tokens), np.float32) if loss_mask is None
          else np.asarray(loss_mask, np.float32))
  inputs, targets, mask = tokens[:-1], tokens[1:], mask[1:]
  rows = []
  for start in range(0, len(inputs), seq_len):
    n = min(seq_len, len(inputs) - start)
    row = {k: np.zeros(seq_len, dtype.as_numpy_dtype)
           for k, dtype in packing.FEATURES.items()}
    row["inputs"][:n] = inputs[start:start + n]
    row["targets"][:n] = targets[start:start + n]
    row["loss_mask"][:n] = mask[start:start + n]
    row["segment_ids"][:n] = 1
    row["positions"][:n] = np.arange(n)
    rows.append(row)
  return rows


def per_document_batches(documents: Iterator[Mapping[str, np.ndarray]],
                         seq_len: int, batch_size: int) -> Iterator[Batch]:
  """Batches of `batch_size` rows, one document (piece) per row."""
  rows = []
  for doc in documents:
    rows += document_rows(doc["tokens"], doc.get("loss_mask"), seq_len)
    while len(rows) >= batch_size:
      yield _stack(rows[:batch_size])
      rows = rows[batch_size:]
  if rows:
    empty = {k: np.zeros_like(v) for k, v in rows[0].items()}
    yield _stack(rows + [empty] * (batch_size - len(rows)))


def _stack(rows: list[dict[str, np.ndarray]]) -> Batch:
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def make_eval_step(model_config: config_lib.ModelConfig,
                   token_bytes: Any = None):
  """The jitted shared eval step (`losses.make_eval_step`) of a model.

  Args:
    model_config: the model's settings, typed.
    token_bytes: UTF-8 bytes per token id (`pipeline.token_bytes`), for
      bits per byte; None counts one byte per scored token.
  """
  head = functools.partial(model_lib.head_weight, model_config)
  return jax.jit(losses.make_eval_step(model_lib.build(model_config),
                                       token_bytes, head_weight=head))


def score(eval_step, params: hk.Params, batches: Iterator[Batch],
          vocab_size: int) -> dict[str, float]:
  """Mean loss, accuracy, perplexity and bits per byte over the batches'
  masked targets."""
  total = np.zeros(4, np.float64)
  for batch in batches:
    model_lib.check_tokens(batch["inputs"], vocab_size, "An eval batch")
    total += np.asarray(jax.device_get(eval_step(params, batch)), np.float64)
  loss_sum, correct, weight, nbytes = total
  if weight == 0:
    raise ValueError("The validation split has no scored tokens.")
  loss = loss_sum / weight
  return {"loss": loss, "accuracy": correct / weight,
          "perplexity": math.exp(loss), "tokens": weight,
          "bits_per_byte": loss_sum / max(nbytes, 1.0) / math.log(2)}


def _documents(data_config, workdir, num_docs):
  docs, _ = pipeline.load_documents(
      data_config, "validation",
      data_dir=pipeline.resolve_data_dir(data_config, workdir))
  if num_docs is not None:
    docs = docs.take(num_docs)
  return docs


def _packed_batches(data_config, workdir, num_docs, batch_size):
  """The validation split packed as the training pipeline packs it."""
  cfg = pipeline.DataConfig.from_config(data_config)
  if num_docs is None:
    yield from pipeline.make_eval_iterator(data_config, workdir=workdir)
    return
  rows = packing.pack_documents(
      _documents(data_config, workdir, num_docs), cfg.seq_len,
      reset_at_document_boundaries=cfg.reset_at_document_boundaries)
  for batch in rows.batch(batch_size).as_numpy_iterator():
    if len(batch["inputs"]) < batch_size:
      pad = batch_size - len(batch["inputs"])
      batch = {k: np.pad(v, ((0, pad), (0, 0))) for k, v in batch.items()}
    yield batch


def evaluate_run(model_config: config_lib.ModelConfig,
                 data: ml_collections.ConfigDict, params: hk.Params,
                 workdir: str, num_docs: int | None = None
                 ) -> dict[str, dict[str, float]]:
  """Scores the validation split per document and packed (resets on/off).

  Args:
    model_config: the model's settings, typed (`Run.model`).
    data: the training config's `data` section.
    params: the parameters.
    workdir: the run directory (the default TFDS data dir lives there).
    num_docs: only the first N validation documents; None = all.

  Returns:
    {"per document": ..., "packed, resets on": ...,
    "packed, resets off": ...}, each `score`'s dict.
  """
  seq_len, batch_size = int(data.seq_len), int(data.batch_size)
  vocab = model_config.vocab_size
  eval_step = make_eval_step(model_config, pipeline.token_bytes(
      data, pipeline.resolve_data_dir(data, workdir)))
  docs = _documents(data, workdir, num_docs).as_numpy_iterator()
  results = {"per document": score(
      eval_step, params, per_document_batches(docs, seq_len, batch_size),
      vocab)}
  for resets in (True, False):
    data_config = ml_collections.ConfigDict(data.to_dict())
    data_config.reset_at_document_boundaries = resets
    results[f"packed, resets {'on' if resets else 'off'}"] = score(
        eval_step, params,
        _packed_batches(data_config, workdir, num_docs, batch_size), vocab)
  return results


def format_table(results: dict[str, dict[str, float]]) -> str:
  """The results as a table, with the relative loss difference to the
  per-document row."""
  base = results["per document"]["loss"]
  lines = [f"{'evaluation':<20} {'loss':>10} {'bits/byte':>9} "
           f"{'accuracy':>9} {'perplexity':>11} {'tokens':>8} "
           f"{'loss vs per-doc':>16}", "-" * 89]
  for name, r in results.items():
    rel = (r["loss"] - base) / abs(base) if base else float("nan")
    lines.append(f"{name:<20} {r['loss']:>10.6f} {r['bits_per_byte']:>9.4f} "
                 f"{100 * r['accuracy']:>8.2f}% {r['perplexity']:>11.4f} "
                 f"{int(r['tokens']):>8d} {rel:>+16.2e}")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}.")
  logs.quiet_library_logs()
  run = state_lib.load_run(_WORKDIR.value)
  print(f"{run.workdir}, checkpoint of step {run.step}; validation split"
        + (f", first {_NUM_DOCS.value} documents" if _NUM_DOCS.value
           else ""))
  print(format_table(evaluate_run(run.model, run.config.data, run.params,
                                  run.workdir, _NUM_DOCS.value)))


if __name__ == "__main__":
  # Flags exist only in the program, so that importing the module (tests,
  # other tools with flags of the same names) defines none.
  _WORKDIR = flags.DEFINE_string("workdir", None,
                                 "The training run directory.")
  _NUM_DOCS = flags.DEFINE_integer(
      "num_docs", None, "Evaluate only the first N validation documents "
      "(all three ways); default the whole split.")
  flags.mark_flags_as_required(["workdir"])
  app.run(main)
