"""Tests of data/tokenizer.py and the text_files BPE settings: exact round
trips, a deterministic tokenizer file, and the checksum guard."""

import os

import helpers
import pytest
import tokenizers

from data import text_files
from data import tokenizer as tokenizer_lib
from testbed import corpora

VOCAB = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("corpus"))
  return root, helpers.write_text_corpus(root)


def _paths(root, texts):
  return [os.path.join(root, name) for name in sorted(texts)]


def test_round_trip_is_exact_on_every_file(corpus, tmp_path):
  root, texts = corpus
  path = str(tmp_path / "tok" / "tokenizer.json")
  tokenizer_lib.train_for_files(_paths(root, texts), vocab_size=VOCAB,
                                seed=0, path=path)
  tok = tokenizer_lib.load(path)
  assert 256 < tok.get_vocab_size() <= VOCAB
  for name, text in texts.items():
    ids = tok.encode(text).ids
    assert len(ids) < len(text.encode("utf-8")), name  # Merges were learnt.
    assert max(ids) < tok.get_vocab_size()
    assert tok.decode(ids) == text, name
    assert tokenizer_lib.decode_bytes(tok, ids) == text.encode("utf-8"), name


def test_same_inputs_give_the_same_file(corpus, tmp_path):
  root, texts = corpus
  paths = _paths(root, texts)
  digests = [tokenizer_lib.train_for_files(
      paths, vocab_size=VOCAB, seed=0, path=str(tmp_path / f"{i}.json"))
             for i in range(2)]
  assert digests[0] == digests[1]
  assert (tmp_path / "0.json").read_bytes() == (
      tmp_path / "1.json").read_bytes()
  other = tokenizer_lib.train_for_files(
      paths, vocab_size=VOCAB + 20, seed=0, path=str(tmp_path / "2.json"))
  assert other != digests[0]
  # The seed picks the files when they hold more than `max_bytes`.
  assert tokenizer_lib.sample_files(paths, 0, 1) != (
      tokenizer_lib.sample_files(paths, 1, 1))


def test_settings_build_once_and_check_the_checksum(corpus, tmp_path):
  root, texts = corpus
  settings = text_files.Settings(glob=os.path.join(root, "*.txt"),
                                 validation_percent=30, tokenizer="bpe",
                                 bpe_vocab_size=VOCAB)
  data_dir = str(tmp_path / "tfds")
  resolved = settings.resolve(data_dir)
  assert resolved.tokenizer_path.startswith(
      os.path.join(data_dir, "tokenizers"))
  assert resolved.tokenizer_sha256 == tokenizer_lib.sha256(
      resolved.tokenizer_path)
  assert resolved.resolve(data_dir) == resolved       # Not rebuilt.
  assert resolved.builder_config().name.endswith(
      "_bpe" + resolved.tokenizer_sha256[:16])
  # A given tokenizer.json is used as it is; nothing is built.
  given = str(tmp_path / "given.json")
  digest = tokenizer_lib.train_for_files(
      _paths(root, texts)[:2], vocab_size=280, seed=0, path=given)
  other_dir = str(tmp_path / "other")
  used = text_files.Settings(tokenizer="bpe", bpe_vocab_size=VOCAB,
                             tokenizer_path=given).resolve(other_dir)
  assert (used.tokenizer_path, used.tokenizer_sha256) == (given, digest)
  assert not os.path.exists(other_dir)
  with pytest.raises(FileNotFoundError):
    text_files.Settings(tokenizer="bpe", tokenizer_path=given + ".no"
                        ).resolve(other_dir)
  with pytest.raises(ValueError, match="resolved first"):
    settings.builder_config()
  with pytest.raises(text_files.TokenizerChangedError, match="SHA-256"):
    settings.__class__(**{**resolved.__dict__,
                          "tokenizer_sha256": "0" * 64}).resolve(data_dir)
  with pytest.raises(ValueError, match="more than config.data.bpe_vocab"):
    text_files.Settings(tokenizer="bpe", bpe_vocab_size=257,
                        tokenizer_path=resolved.tokenizer_path
                        ).resolve(data_dir)
  with pytest.raises(ValueError, match="vocabulary size"):
    text_files.Settings(tokenizer="bpe", bpe_vocab_size=256)
  with pytest.raises(ValueError, match="tokenizer must be one of"):
    text_files.Settings(tokenizer="words")


def test_text_codec_bpe_and_bytes(corpus, tmp_path):
  root, texts = corpus
  path = str(tmp_path / "tokenizer.json")
  tokenizer_lib.train_for_files(_paths(root, texts), vocab_size=VOCAB,
                                seed=0, path=path)
  bpe, raw = tokenizer_lib.TextCodec(path), tokenizer_lib.TextCodec()
  text = texts["f1.txt"]
  ids = bpe.encode(text)
  assert len(ids) < len(text.encode()) and max(ids) < VOCAB
  assert bpe.decode(ids) == text
  assert raw.encode("é") == [0xC3, 0xA9]
  assert raw.decode([0xC3, 0xA9, 0xC3]) == "é\ufffd"   # A cut character.


def test_hf_tokenizer_json_round_trips_with_the_library_ids(tmp_path):
  texts = corpora.corpus_texts(60)
  path = helpers.write_hf_tokenizer(str(tmp_path / "m" / "tokenizer.json"),
                                    texts)
  assert tokenizer_lib.hf_path(f"hf:{path}") == path
  assert tokenizer_lib.hf_path("bytes") == ""
  with pytest.raises(ValueError, match="needs the path"):
    tokenizer_lib.hf_path("hf:")
  tok = tokenizer_lib.load_hf(path)
  assert tokenizer_lib.load_hf(str(tmp_path / "m")) is tok   # Its dir.
  library = tokenizers.Tokenizer.from_file(path)
  ids = tokenizer_lib.encode_documents(tok, texts)
  assert ids == [library.encode(t).ids for t in texts]
  assert all(i[0] == 0 and 0 not in i[1:] for i in ids)   # <s> in front.
  assert [tok.decode(i) for i in ids] == texts
  assert tokenizer_lib.vocab_size(tok) == library.get_vocab_size()
  # Bytes per token: 0 for the special tokens, the exact bytes otherwise.
  lengths = tokenizer_lib.token_byte_lengths(tok)
  assert lengths[0] == lengths[1] == 0
  for text, row in zip(texts, ids, strict=True):
    assert lengths[row].sum() == len(text.encode("utf-8"))
  codec = tokenizer_lib.TextCodec(hf_tokenizer_path=path)
  assert codec.encode(texts[3]) == ids[3]
  assert codec.decode(ids[3]) == "<s>" + texts[3]


def test_hf_tokenizer_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="No tokenizer file"):
    tokenizer_lib.load_hf(str(tmp_path / "none.json"))
  (tmp_path / "bad.json").write_text("{}")
  with pytest.raises(ValueError, match="bad.json is not a tokenizer.json"):
    tokenizer_lib.load_hf(str(tmp_path / "bad.json"))
