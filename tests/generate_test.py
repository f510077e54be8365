"""Tests of kda_lm/generate.py's text codec: prompts and continuations go
through the run's tokenizer (bytes or BPE)."""

import pytest

from data import tokenizer as tokenizer_lib
from kda_lm import generate, testing


def test_text_codec_bpe_and_bytes(tmp_path):
  texts = testing.write_text_corpus(str(tmp_path / "c"))
  path = str(tmp_path / "tokenizer.json")
  tokenizer_lib.train_for_files(
      [str(tmp_path / "c" / n) for n in sorted(texts)], vocab_size=300,
      seed=0, path=path)
  bpe, raw = generate.TextCodec(path), generate.TextCodec()
  text = texts["f1.txt"]
  ids = generate.parse_prompt(text, bpe)
  assert len(ids) < len(text.encode()) and max(ids) < 300
  assert generate.format_tokens(ids, bpe) == text
  assert generate.parse_prompt("é", raw) == [0xC3, 0xA9]
  assert generate.format_tokens([0xC3, 0xA9, 0xC3], raw) == "é\ufffd"
  # A cut inside a character decodes what is complete.
  cut = bpe.encode("☕")[:1]
  assert bpe.decode(cut).endswith("\ufffd") or len(bpe.encode("☕")) == 1
  assert generate.parse_prompt("3, 1 4", None) == [3, 1, 4]
  with pytest.raises(ValueError, match="empty"):
    generate.parse_prompt("", bpe)
