"""Tests of kda_lm.evaluate (per document vs packed) and kda_lm.runs."""

import json
import os

import jax
import jax.numpy as jnp
import pytest

from configs import ling3_tiny
from kda_lm import evaluate, runs
from kda_lm import model as model_lib

pytestmark = pytest.mark.usefixtures("fast_compile")


def tiny_run_config(tmp_path):
  config = ling3_tiny.get_config()
  m = config.model
  m.d_model, m.num_heads, m.head_dim = 32, 2, 8
  m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim = 16, 8, 4
  m.v_head_dim, m.mlp_hidden_dim = 8, 32
  m.attention_pattern, m.num_experts = "KM", 0
  m.kda_chunk_size = 16
  d = config.data
  d.vocab_size, d.delay, d.min_len, d.max_len = 16, 4, 8, 40
  d.num_train_docs, d.num_eval_docs = 8, 12
  d.seq_len, d.batch_size = 32, 4   # Documents up to 40 tokens: split.
  d.data_dir = str(tmp_path / "tfds")
  return config


def test_per_document_equals_packed_with_resets(tmp_path):
  config = tiny_run_config(tmp_path)
  params = model_lib.build(config.model).init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  results = evaluate.evaluate_run(config, params, str(tmp_path))
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
    runs.load_run(str(tmp_path))
  config = tiny_run_config(tmp_path)
  with open(tmp_path / "config.json", "w") as f:
    f.write(config.to_json_best_effort())
  with pytest.raises(FileNotFoundError, match="No checkpoint"):
    runs.load_run(str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints")
  assert json.loads((tmp_path / "config.json").read_text())["model"]
