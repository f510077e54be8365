"""Tests of kda_lm.infer.evaluate (per document vs packed) and of loading
a run (kda_lm.train.state.load_run)."""

import json
import os

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import ling3_tiny
from data import tokenizer as tokenizer_lib
from kda_lm import config as config_lib
from kda_lm import model as model_lib
from kda_lm.infer import evaluate
from kda_lm.train import state as state_lib

pytestmark = pytest.mark.usefixtures("fast_compile")


def tiny_run_config(tmp_path):
  config = ling3_tiny.get_config()
  helpers.tiny_model_config(config.model)
  d = config.data
  d.vocab_size, d.delay, d.min_len, d.max_len = 16, 4, 8, 40
  d.num_train_docs, d.num_eval_docs = 8, 12
  d.seq_len, d.batch_size = 32, 4   # Documents up to 40 tokens: split.
  d.data_dir = str(tmp_path / "tfds")
  return config


def test_per_document_equals_packed_with_resets(tmp_path):
  config = tiny_run_config(tmp_path)
  model_config = config_lib.ModelConfig.from_config(config.model)
  params = model_lib.build(model_config).init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  results = evaluate.evaluate_run(model_config, config.data, params,
                                  str(tmp_path))
  per_doc = results["per document"]
  packed = results["packed, resets on"]
  off = results["packed, resets off"]
  assert per_doc["tokens"] == packed["tokens"] == off["tokens"] > 0
  for key in ("loss", "accuracy", "perplexity"):
    assert abs(per_doc[key] - packed[key]) <= 1e-5 * abs(per_doc[key]), key
  assert abs(off["loss"] - per_doc["loss"]) > 1e-4 * per_doc["loss"]
  table = evaluate.format_table(results)
  assert "packed, resets off" in table and "per document" in table


def test_document_rows_split_like_the_packer():
  rows = evaluate.document_rows(list(range(10)), None, seq_len=4)
  assert len(rows) == 3   # 9 pairs: 4 + 4 + 1.
  assert rows[0]["inputs"].tolist() == [0, 1, 2, 3]
  assert rows[0]["targets"].tolist() == [1, 2, 3, 4]
  assert rows[2]["segment_ids"].tolist() == [1, 0, 0, 0]
  assert rows[2]["targets"][0] == 9


def test_load_run_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    state_lib.load_run(str(tmp_path))
  config = tiny_run_config(tmp_path)
  with open(tmp_path / "config.json", "w") as f:
    f.write(config.to_json_best_effort())
  with pytest.raises(FileNotFoundError, match="No checkpoint"):
    state_lib.load_run(str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints")
  assert json.loads((tmp_path / "config.json").read_text())["model"]


# Multi-byte characters (2, 3 and 4 bytes in UTF-8), so that BPE tokens
# stand for 1 to several bytes.
TEXTS = ("héllo wörld, héllo wörld! 👋 naïve café",
         "€3 for ☕ and €4 for 🍰, ça va?",
         "plain ascii, plain ascii: the end")


def test_bits_per_byte_count_the_bytes_of_the_scored_targets(tmp_path):
  """A BPE vocabulary: bits per byte divide the masked cross-entropy by the
  bytes of the scored targets (not of the inputs, not of masked targets
  or padding), checked against a float64 numpy computation."""
  tok = tokenizer_lib.train(list(TEXTS) * 4, vocab_size=300)
  pieces = tokenizer_lib.token_bytes(tok)
  vocab = 320   # The model's vocabulary: ids past the tokenizer's are 0.
  token_bytes = np.zeros(vocab, np.float32)
  token_bytes[:len(pieces)] = [len(p) for p in pieces]
  docs = [np.asarray(tok.encode(t).ids, np.int32) for t in TEXTS]
  for doc, text in zip(docs, TEXTS, strict=True):
    assert b"".join(pieces[i] for i in doc) == text.encode("utf-8")
  # Document 1's first 5 targets are not scored.
  masks = [None, np.r_[np.zeros(6), np.ones(len(docs[1]) - 6)], None]
  assert len(set(token_bytes[np.concatenate(docs)])) >= 3

  config = tiny_run_config(tmp_path)
  config.model.vocab_size = vocab
  model_config = config_lib.ModelConfig.from_config(config.model)
  params = model_lib.build(model_config).init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  # seq_len 16 splits the documents; batches of 3 rows end with padding.
  batches = list(evaluate.per_document_batches(
      iter([{"tokens": d} if m is None else {"tokens": d, "loss_mask": m}
            for d, m in zip(docs, masks, strict=True)]), 16, 3))
  assert np.sum(batches[-1]["segment_ids"][-1]) == 0   # A padding row.
  got = evaluate.score(evaluate.make_eval_step(model_config, token_bytes),
                       params, iter(batches), vocab)

  # float64 numpy: each piece of 16 (input, target) pairs alone in a row,
  # as the rows split the documents (a short piece padded at the end, which
  # a causal model does not read).
  apply = jax.jit(model_lib.build(model_config).apply)
  nats = nbytes = count = 0.0
  for doc, mask in zip(docs, masks, strict=True):
    mask = np.ones(len(doc)) if mask is None else mask
    for start in range(0, len(doc) - 1, 16):
      inputs = doc[start:start + 16]
      targets = doc[start + 1:start + 17]
      weights = mask[start + 1:start + 17]
      row = np.zeros((1, 16), np.int32)
      row[0, :len(targets)] = inputs[:len(targets)]
      logits = np.asarray(apply(params, row), np.float64)[0, :len(targets)]
      top = logits.max(-1, keepdims=True)
      logp = logits - top - np.log(np.exp(logits - top).sum(-1,
                                                             keepdims=True))
      nats -= np.sum(logp[np.arange(len(targets)), targets] * weights)
      nbytes += sum(len(pieces[t]) for t, w in zip(targets, weights,
                                                   strict=True) if w)
      count += weights.sum()
  # The bytes of the scored targets, from the texts: all but the first
  # token's, less document 1's first 5 targets.
  want_bytes = sum(len(t.encode("utf-8")) - len(pieces[d[0]])
                   for t, d in zip(TEXTS, docs, strict=True)) - sum(
                       len(pieces[i]) for i in docs[1][1:6])
  assert nbytes == want_bytes
  # Counting the inputs' bytes instead would give another total.
  input_bytes = sum(len(t.encode("utf-8")) - len(pieces[d[-1]])
                    for t, d in zip(TEXTS, docs, strict=True)) - sum(
                        len(pieces[i]) for i in docs[1][:5])
  assert input_bytes != want_bytes
  assert got["tokens"] == count
  assert got["loss"] == pytest.approx(nats / count, rel=1e-5)
  assert got["bits_per_byte"] == pytest.approx(
      nats / want_bytes / np.log(2), rel=1e-5)
  # Bits per byte and per token differ by the mean bytes per token.
  assert got["bits_per_byte"] == pytest.approx(
      got["loss"] / np.log(2) * count / want_bytes, rel=1e-6)
