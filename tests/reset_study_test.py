"""Tests of experiments/reset_study.py: end to end on a tiny setting."""

import math
import os

import helpers
import numpy as np
import pytest

from experiments import reset_study

pytestmark = pytest.mark.usefixtures("fast_compile")


def _tiny_config(corpus):
  config = reset_study.study_config(seq_len=32, batch_size=2)
  config.model.update(dict(d_model=32, attention_pattern="KM", num_heads=2,
                           head_dim=16, kv_lora_rank=16, qk_nope_head_dim=16,
                           qk_rope_head_dim=8, v_head_dim=16,
                           mlp_hidden_dim=64, num_experts=0))
  config.data.update(dict(glob=os.path.join(corpus, "*.txt"),
                          validation_percent=30, bpe_vocab_size=300,
                          shuffle_buffer=4, piece_shuffle_buffer=16))
  return config


def test_study_runs_end_to_end_and_writes_its_table(tmp_path):
  corpus = str(tmp_path / "corpus")
  helpers.write_text_corpus(corpus)
  config = _tiny_config(corpus)
  assert config.model.vocab_size == 300     # Linked to the BPE size.
  # eval_len = seq_len: one compiled eval shape for both evaluations.
  setting = reset_study.Setting(
      config=config, steps=2, seeds=(0,), eval_docs=3, eval_len=32,
      data_dir=str(tmp_path / "tfds"))
  rows, curves = reset_study.run_study(setting)
  assert [(r["reset"], r["seed"]) for r in rows] == [(True, 0), (False, 0)]
  assert curves.shape == (2, 32)
  for row in rows:
    # Near ln(300) = 5.7 nats per token after 2 steps.
    for key in ("train nats/token", "doc nats/token", "packed nats/token",
                "pos 0-63"):
      assert 4 < row[key] < 7, (key, row[key])
    # A token of this tiny BPE is 1-2 bytes.
    assert 0.5 < row["doc nats/token"] / (
        row["doc bits/byte"] * math.log(2)) < 2.5
    assert math.isnan(row["pos 64-511"])    # No document reaches it.
  table = reset_study.write_outputs(setting, rows, curves, str(tmp_path))
  assert (tmp_path / "reset_study.md").read_text().strip() == table.strip()
  assert "| doc nats/token |" in table and "on - off (paired)" in table
  assert "2 steps x 2 rows x 32 tokens = 128 training tokens" in table
  assert (tmp_path / "reset_study.png").stat().st_size > 0


def test_table_statistics():
  rows = [{"reset": r, "seed": s, **{m: v + s for m in reset_study.METRICS}}
          for s in (0, 1, 2) for r, v in ((True, 1.0), (False, 3.0))]
  table = reset_study.format_table(rows)
  # Means 2 and 4 (std 1), paired differences all -2 (std 0).
  assert "| doc nats/token | 2.0000 ± 1.0000 | 4.0000 ± 1.0000 | " \
         "-2.0000 ± 0.0000 |" in table
  assert np.isfinite(len(table))
