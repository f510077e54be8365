"""Tests of kda_lm.infer.generate: copy accuracy, prompts and their formatting.

`copy_accuracy` runs the real `Decoder` and greedy `decoding.generate` on a
tiny model whose parameters make it a known predictor: every block's output
projection is zero, so the residual stream is the token's embedding, and the
head is the embedding's transpose, so the greedy next token is always the
current token (the model repeats its last token forever). On delayed-copy
documents of delay 1 (one repeated token) that is a perfect copier; on delay
3 it is right exactly where a document repeats its last prompt token.
"""

import functools
import os

import helpers
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import tokenizers

from configs import ling3_tiny
from data import tokenizer as tokenizer_lib
from kda_lm import config as config_lib
from kda_lm import model as model_lib
from kda_lm.infer import generate
from kda_lm.train import state as state_lib

pytestmark = pytest.mark.usefixtures("fast_compile")

VOCAB = 16


def tiny_config(delay):
  config = ling3_tiny.get_config()
  m = helpers.tiny_model_config(config.model)
  m.num_mtp_layers, m.vocab_size = 0, VOCAB
  config.data.delay = delay
  return config


def typed_model(config):
  return config_lib.ModelConfig.from_config(config.model)


@functools.cache
def repeater_params():
  """Parameters of a model whose greedy next token is the current token."""
  model_config = typed_model(tiny_config(1))
  params = model_lib.build(model_config).init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  params = {
      scope: {name: (jnp.zeros_like(value)
                     if scope.endswith(("o_proj", "down_proj")) else value)
              for name, value in leaves.items()}
      for scope, leaves in params.items()}
  D = model_config.d_model
  embeddings = np.zeros((VOCAB, D), np.float32)
  embeddings[:, :VOCAB] = np.eye(VOCAB)
  params["embed"] = {"embeddings": jnp.asarray(embeddings)}
  params["lm_head"] = {"w": jnp.asarray(embeddings.T)}
  return params


def periodic(prefix, length):
  """A delayed-copy document: `prefix` (the first `delay` tokens) repeated
  (t[i] = t[i - delay])."""
  return np.resize(np.asarray(prefix, np.int32), length)


def run_with_documents(monkeypatch, tmp_path, delay, docs):
  config = tiny_config(delay)
  monkeypatch.setattr(generate, "validation_documents",
                      lambda run, num_docs: docs[:num_docs])
  return state_lib.Run(str(tmp_path), config, repeater_params(), 0,
                       typed_model(config))


def test_repeater_is_what_the_docstring_says():
  config = tiny_config(1)
  params = repeater_params()
  tokens = jnp.asarray([[3, 9, 9, 0, 15, 4]], jnp.int32)
  logits = jax.jit(model_lib.build(typed_model(config)).apply)(params,
                                                               tokens)
  np.testing.assert_array_equal(np.argmax(logits, -1), tokens)


def test_perfect_copier_scores_one(monkeypatch, tmp_path):
  # Delay 1: every token repeats the previous one. The 1-token document is
  # not longer than the delay and is left out.
  docs = [periodic([3], 5), periodic([8], 2), periodic([1], 1),
          periodic([6], 9)]
  run = run_with_documents(monkeypatch, tmp_path, 1, docs)
  accuracy, tokens, num_docs = generate.copy_accuracy(run, num_docs=4,
                                                      batch_size=2)
  assert (accuracy, tokens, num_docs) == (1.0, 4 + 1 + 8, 3)


def test_copy_accuracy_counts_exactly_the_wrong_tokens(monkeypatch, tmp_path):
  """Delay 3: the prompt is the first 3 tokens, the answer the rest; the
  repeater continues with the prompt's last token, so it is right exactly
  where the document holds that token."""
  docs = [
      periodic([5, 7, 7], 10),  # answer 5 7 7 5 7 7 5: 4 of 7 right.
      periodic([1, 2, 3], 3),   # no answer: left out.
      periodic([4, 4, 4], 8),   # answer 4 4 4 4 4: 5 of 5.
      periodic([2, 9, 1], 4),   # answer 2: 0 of 1 (the 8 generated tokens
      #                           past the end are not scored).
      periodic([0, 3, 3], 12),  # answer 0 3 3 0 3 3 0 3 3: 6 of 9.
  ]
  run = run_with_documents(monkeypatch, tmp_path, 3, docs)
  # Batches of 3 (the last one holds one document): every batch generates
  # 12 - 3 = 9 tokens per row, beyond the shorter documents' ends.
  accuracy, tokens, num_docs = generate.copy_accuracy(run, num_docs=5,
                                                      batch_size=3)
  assert (tokens, num_docs) == (7 + 5 + 1 + 9, 4)
  assert accuracy == pytest.approx((4 + 5 + 0 + 6) / 22, abs=1e-12)
  # The same from a numpy count of the answer tokens equal to the prompt's
  # last token.
  kept = [d for d in docs if len(d) > 3]
  want = sum(int(np.sum(d[3:] == d[2])) for d in kept) / sum(
      len(d) - 3 for d in kept)
  assert accuracy == pytest.approx(want, abs=1e-12)


def test_copy_accuracy_needs_a_document_longer_than_the_delay(
    monkeypatch, tmp_path):
  run = run_with_documents(monkeypatch, tmp_path, 3,
                           [periodic([1, 2, 3], 3)])
  with pytest.raises(ValueError, match="longer than the delay"):
    generate.copy_accuracy(run, num_docs=1, batch_size=1)


def test_validation_documents_are_the_delayed_copy_split(tmp_path):
  config = tiny_config(3)
  d = config.data
  d.vocab_size, d.min_len, d.max_len = VOCAB, 4, 12
  d.num_train_docs, d.num_eval_docs = 2, 5
  d.data_dir = str(tmp_path / "tfds")
  run = state_lib.Run(str(tmp_path), ml_collections.ConfigDict(config), None, 0)
  docs = generate.validation_documents(run, 3)
  assert len(docs) == 3
  for doc in docs:
    assert 4 <= len(doc) <= 12 and doc.min() >= 0 and doc.max() < VOCAB
    np.testing.assert_array_equal(doc[3:], doc[:-3])
  all_docs = generate.validation_documents(run, 10)
  assert len(all_docs) == 5
  for a, b in zip(docs, all_docs, strict=False):
    np.testing.assert_array_equal(a, b)


def test_parse_prompt_ids_and_text():
  assert generate.parse_prompt("1, 2 3,4", None) == [1, 2, 3, 4]
  assert generate.parse_prompt(" 7 ", None) == [7]
  with pytest.raises(ValueError, match="token ids separated by spaces or "
                     "commas.*'1 x'"):
    generate.parse_prompt("1 x", None)
  with pytest.raises(ValueError, match="empty"):
    generate.parse_prompt(" , ", None)
  codec = tokenizer_lib.TextCodec()   # bytes
  assert generate.parse_prompt("hé", codec) == [104, 0xC3, 0xA9]
  with pytest.raises(ValueError, match="empty"):
    generate.parse_prompt("", codec)


def test_format_tokens():
  assert generate.format_tokens([5, 0, 12], None) == "5 0 12"
  assert generate.format_tokens([], None) == ""
  codec = tokenizer_lib.TextCodec()
  assert generate.format_tokens([104, 0xC3, 0xA9], codec) == "hé"
  # A character cut by the end of the continuation shows as U+FFFD.
  assert generate.format_tokens([104, 0xC3], codec) == "h\ufffd"


def test_text_codec_of_a_run_on_a_released_tokenizer(tmp_path):
  texts = ["def f(x):\n  return x", "naïve café"]
  # Not in the run directory, where it would be an imported model's.
  os.makedirs(tmp_path / "tokenizer")
  path = helpers.write_hf_tokenizer(
      str(tmp_path / "tokenizer" / "tokenizer.json"), texts * 20,
      vocab_size=280)
  config = tiny_config(4)
  config.data.update(name="jsonl", files=str(tmp_path / "*.jsonl"),
                     tokenizer=f"hf:{path}")
  run = state_lib.Run(str(tmp_path), config, repeater_params(), 0)
  codec = generate.text_codec(run)
  library = tokenizers.Tokenizer.from_file(path)
  assert generate.parse_prompt(texts[1], codec) == library.encode(
      texts[1]).ids
  config.data.name = "delayed_copy"
  assert generate.text_codec(run) is None
