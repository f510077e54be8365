"""Tests of data/pipeline.py: config -> packed numpy batches, checkpoints."""

import logging
import os
import time

import helpers
import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from data import corpus, delayed_copy, packing, pipeline, text_files
from data import tokenizer as tokenizer_lib
from kda_lm.checkpoint import workdir as workdir_lib
from testbed import corpora

SEQ_LEN = 32
BATCH = 4
_train, _take = helpers.train_iterator, helpers.take
_assert_same = helpers.assert_same_batches


def _config(**overrides):
  config = pipeline.default_config()
  config.update(dict(seq_len=SEQ_LEN, batch_size=BATCH, vocab_size=40,
                     delay=3, min_len=2, max_len=70, num_train_docs=150,
                     num_eval_docs=25, shuffle_buffer=32, pack_window_rows=4))
  config.update(overrides)
  return config


def _eval(config, data_dir, **kwargs):
  kwargs.setdefault("process_index", 0)
  kwargs.setdefault("process_count", 1)
  return pipeline.make_eval_iterator(config, data_dir=data_dir, **kwargs)


def test_train_batches(data_dir):
  it = _train(_config(), data_dir)
  assert it.vocab_size == 40
  for batch in _take(it, 3):
    assert sorted(batch) == sorted(packing.FEATURES)
    for key, dtype in packing.FEATURES.items():
      assert batch[key].shape == (BATCH, SEQ_LEN), key
      assert batch[key].dtype == dtype.as_numpy_dtype, key
    real = batch["segment_ids"] > 0
    assert not batch["loss_mask"][~real].any()
    assert (batch["inputs"][real] < 40).all()
    assert real.mean() > 0.5


def test_train_determinism_and_seed(data_dir):
  config = _config()
  first = _take(_train(config, data_dir), 4)
  _assert_same(first, _take(_train(config, data_dir), 4))
  other = _take(_train(config, data_dir, seed=1), 4)
  assert not all(np.array_equal(a["inputs"], b["inputs"])
                 for a, b in zip(first, other, strict=True))


def test_save_restore_resumes_on_next_batch(data_dir, tmp_path):
  config = _config()
  it = _train(config, data_dir)
  # Past the end of the first epoch (about 10 batches), so the shuffle and
  # repeat state matter too.
  _take(it, 12)
  it.save(str(tmp_path / "ckpt"))
  expected = _take(it, 5)

  resumed = _train(config, data_dir)
  _take(resumed, 2)  # Its own position is overwritten by the restore.
  resumed.restore(str(tmp_path / "ckpt"))
  _assert_same(_take(resumed, 5), expected)

  # Restoring again rewinds the original iterator as well.
  it.restore(str(tmp_path / "ckpt"))
  _assert_same(_take(it, 5), expected)
  with pytest.raises(FileNotFoundError):
    it.restore(str(tmp_path / "missing"))


def _expected_loss_tokens(config, split):
  """Sum of the pair loss masks over the split: nothing lost or duplicated."""
  bconfig = pipeline.builder_config(config)
  return sum(int(d["loss_mask"][1:].sum())
             for _, d in delayed_copy.generate(bconfig, split))


def test_eval_is_finite_deterministic_and_complete(data_dir, caplog):
  config = _config()
  stream = _eval(config, data_dir)
  batches = list(stream)
  _assert_same(batches, list(stream))  # Re-iterable, same every time.
  assert batches[-1]["inputs"].shape == (BATCH, SEQ_LEN)  # Padded batch.
  total = sum(b["loss_mask"].sum() for b in batches)
  assert total == _expected_loss_tokens(config, "validation")

  # More batches than the split has: the ones that exist, said once.
  with caplog.at_level(logging.WARNING):
    capped = list(_eval(config, data_dir, num_batches=10**9))
  _assert_same(capped, batches)
  assert f"has only {len(batches)} batches" in caplog.text
  _assert_same(list(_eval(config, data_dir, num_batches=1)), batches[:1])
  # With several processes, shorter shards are padded with empty batches so
  # that every process runs the same number of eval steps.
  shard = list(_eval(config, data_dir, process_count=2))
  padded = list(_eval(config, data_dir, process_count=2,
                      num_batches=len(shard) + 2))
  _assert_same(padded[:len(shard)], shard)
  assert not any(b[k].any() for b in padded[len(shard):] for k in b)


def test_process_sharding(data_dir):
  config = _config()
  shards = [list(_eval(config, data_dir, process_index=i, process_count=2))
            for i in range(2)]
  for shard in shards:
    assert shard[0]["inputs"].shape == (BATCH // 2, SEQ_LEN)
  # The two shards hold disjoint documents that together make the split.
  total = sum(b["loss_mask"].sum() for shard in shards for b in shard)
  assert total == _expected_loss_tokens(config, "validation")
  a, b = (_take(_train(config, data_dir, process_index=i, process_count=2),
                2) for i in range(2))
  assert not np.array_equal(a[0]["inputs"], b[0]["inputs"])
  with pytest.raises(ValueError, match="multiple of the process count"):
    _train(_config(batch_size=3), data_dir, process_count=2)


def test_reset_at_document_boundaries_false(data_dir):
  batch = next(_train(_config(reset_at_document_boundaries=False), data_dir))
  real = batch["segment_ids"] > 0
  np.testing.assert_array_equal(batch["segment_ids"][real], 1)
  n = real.sum(axis=1)
  for row, length in enumerate(n):
    np.testing.assert_array_equal(batch["positions"][row, :length],
                                  np.arange(length))


def test_text_files(tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(6):
    (corpus / f"f{i}.txt").write_bytes(bytes(range(i, 256)) * (i + 1))
  config = _config(name="text_files", glob=str(corpus / "*.txt"),
                   validation_percent=40, vocab_size=7)
  assert pipeline.vocab_size(config) == 256
  it = _train(config, None, workdir=str(tmp_path))
  assert it.vocab_size == 256
  batch = next(it)
  real = batch["segment_ids"] > 0
  np.testing.assert_array_equal(batch["loss_mask"], real)
  assert (tmp_path / "tfds" / "text_files").is_dir()  # Under the workdir.
  assert list(_eval(config, None, workdir=str(tmp_path)))


def test_errors(data_dir, tmp_path):
  with pytest.raises(ValueError, match="Unknown dataset name 'nope'"):
    _train(_config(name="nope"), data_dir)
  with pytest.raises(ValueError, match="Unknown dataset name"):
    pipeline.vocab_size(_config(name="nope"))
  with pytest.raises(ValueError, match="matched no files"):
    _train(_config(name="text_files", glob=str(tmp_path / "*.none")),
           data_dir)
  for seq_len in (0, 1):
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
      _train(_config(seq_len=seq_len), data_dir)
  with pytest.raises(ValueError, match="batch_size must be >= 1"):
    _train(_config(batch_size=0), data_dir)
  with pytest.raises(ValueError, match="data dir"):
    _train(_config(), None)
  with pytest.raises(ValueError, match="Unknown split"):
    pipeline.load_documents(_config(), "test", data_dir=data_dir)
  with pytest.raises(ValueError, match="num_batches"):
    _eval(_config(), data_dir, num_batches=-1)


def test_glob_of_empty_files_fails_fast(tmp_path):
  corpus = tmp_path / "empty"
  corpus.mkdir()
  for i in range(4):
    (corpus / f"f{i}.txt").write_bytes(b"")
  config = _config(name="text_files", glob=str(corpus / "*.txt"))
  start = time.time()
  with pytest.raises(ValueError, match="every matched file is empty"):
    _train(config, None, workdir=str(tmp_path))
  assert time.time() - start < 30


def _long_files(corpus, num_files=8):
  corpus.mkdir()
  rng = np.random.default_rng(0)
  for i in range(num_files):  # 12..19 pieces of 32 pairs each.
    (corpus / f"f{i}.txt").write_bytes(
        rng.integers(0, 256, 32 * (12 + i) + 5, dtype=np.uint8).tobytes())
  return str(corpus / "*.txt")


def _rows_of(batches):
  return [{k: v[i] for k, v in b.items()} for b in batches
          for i in range(len(b["inputs"]))]


def test_piece_shuffle_gives_an_iid_stream_that_resumes(tmp_path):
  config = _config(name="text_files", glob=_long_files(tmp_path / "c"),
                   validation_percent=20, shuffle_buffer=8,
                   piece_shuffle_buffer=64)
  documents, _ = pipeline.load_documents(config, "train",
                                         data_dir=str(tmp_path / "tfds"))
  index = corpora.piece_index(
      (d["tokens"] for d in documents.as_numpy_iterator()), SEQ_LEN)
  data_dir = str(tmp_path / "tfds")
  it = _train(config, data_dir)
  rows = _rows_of(_take(it, 10))
  stream = corpora.row_continuity(rows, index)
  assert stream["continuing"] <= 0.1, stream
  # Without the piece shuffle, rows walk through one file at a time.
  ordered = corpora.row_continuity(_rows_of(_take(
      _train(_config(**{**config, "piece_shuffle_buffer": 0}), data_dir),
      10)), index)
  assert ordered["continuing"] >= 0.5, ordered
  fill = np.mean([(r["segment_ids"] > 0).mean() for r in rows])
  assert fill >= 0.9
  # The piece buffer is part of the saved position.
  it.save(str(tmp_path / "ckpt"))
  expected = _take(it, 3)
  resumed = _train(config, data_dir)
  resumed.restore(str(tmp_path / "ckpt"))
  _assert_same(_take(resumed, 3), expected)


def test_bpe_documents_and_rows_exactly(tmp_path):
  texts = helpers.write_text_corpus(str(tmp_path / "c"))
  config = _config(name="text_files", glob=str(tmp_path / "c" / "*.txt"),
                   validation_percent=30, tokenizer="bpe",
                   bpe_vocab_size=300, pack_window_rows=64)
  data_dir = str(tmp_path / "tfds")
  assert pipeline.vocab_size(config) == 300
  docs, _ = pipeline.load_documents(config, "validation", data_dir=data_dir)
  docs = list(docs.as_numpy_iterator())
  cfg = pipeline.DataConfig.from_config(config).resolve(data_dir)
  tok = tokenizer_lib.load(cfg.dataset.tokenizer_path)
  names = [n for _, n in text_files.split_files(
      [(n, n) for n in texts], 30)["validation"]]
  # One file = one document, tokenized exactly (in the split's stored
  # order), and it decodes back to the file.
  ids = [d["tokens"].tolist() for d in docs]
  assert sorted(ids) == sorted(tok.encode(texts[n]).ids for n in names)
  assert sorted(tok.decode(i) for i in ids) == sorted(texts[n] for n in names)
  # Rows: as the packer makes them of those token lists (one window).
  expected = packing.pack_documents(
      tf.data.Dataset.from_generator(
          lambda: ({"tokens": np.asarray(i, np.int32)} for i in ids),
          output_signature={"tokens": tf.TensorSpec([None], tf.int32)}),
      SEQ_LEN, window_size=1000)
  rows = _rows_of(list(_eval(config, data_dir)))
  expected = list(expected.as_numpy_iterator())
  expected += [{k: np.zeros_like(v) for k, v in expected[0].items()}] * (
      len(rows) - len(expected))
  _assert_same(rows, expected)
  real = np.stack([r["segment_ids"] for r in rows]) > 0
  assert (np.stack([r["inputs"] for r in rows])[real] < 300).all()


def test_resume_reloads_the_recorded_tokenizer_and_refuses_another(
    tmp_path):
  helpers.write_text_corpus(str(tmp_path / "c"))
  run = ml_collections.ConfigDict({"data": _config(
      name="text_files", glob=str(tmp_path / "c" / "*.txt"),
      validation_percent=30, tokenizer="bpe", bpe_vocab_size=300)})
  workdir = str(tmp_path / "run")
  first = pipeline.resolve_config(run, workdir)
  path = first.data.tokenizer_path
  assert path.startswith(os.path.join(workdir, "tfds", "tokenizers"))
  assert first.data.tokenizer_sha256 == tokenizer_lib.sha256(path)
  assert not run.data.tokenizer_path     # The given config is not changed.
  os.makedirs(workdir, exist_ok=True)
  workdir_lib.write_config(workdir, first.to_dict(), step=0)

  # A resume given no tokenizer path reloads the recorded one, unchanged,
  # also when the data dir (and with it the default path) moves.
  moved = ml_collections.ConfigDict(run.to_dict())
  moved.data.data_dir = str(tmp_path / "elsewhere")
  again = pipeline.resolve_config(moved, workdir,
                                  workdir_lib.read_config(workdir))
  assert again.data.tokenizer_path == path
  assert not workdir_lib.check_resume(first.to_dict(), again.to_dict(),
                                      step=5, allow_change=False)

  # Another tokenizer in its place: refused as a change of the data.
  tokenizer_lib.train_for_files(
      [str(tmp_path / "c" / "f0.txt")], vocab_size=280, seed=0, path=path)
  changed = pipeline.resolve_config(run, workdir,
                                    workdir_lib.read_config(workdir))
  with pytest.raises(workdir_lib.ConfigChangedError,
                     match="data.tokenizer_sha256"):
    workdir_lib.check_resume(first.to_dict(), changed.to_dict(), step=5,
                             allow_change=False)
  # A config that names the checksum refuses the file before anything runs.
  with pytest.raises(text_files.TokenizerChangedError):
    pipeline.resolve_config(first, workdir)


def test_text_files_with_a_released_tokenizer(tmp_path):
  texts = helpers.write_text_corpus(str(tmp_path / "c"))
  (tmp_path / "c" / "latin1.txt").write_bytes(b"caf\xe9 " * 20)
  path = helpers.write_hf_tokenizer(str(tmp_path / "tokenizer.json"),
                                    list(texts.values()))
  config = _config(name="text_files", glob=str(tmp_path / "c" / "*.txt"),
                   validation_percent=30, tokenizer=f"hf:{path}")
  data_dir = str(tmp_path / "tfds")
  tok = tokenizer_lib.load_hf(path)
  assert pipeline.vocab_size(config) == tokenizer_lib.vocab_size(tok)
  ids = []
  for split in ("train", "validation"):
    docs, _ = pipeline.load_documents(config, split, data_dir=data_dir)
    ids += [d["tokens"].tolist() for d in docs.as_numpy_iterator()]
  # Every UTF-8 file, tokenized as the library does (its <s> in front);
  # the Latin-1 file is left out, as from the BPE dataset.
  assert sorted(ids) == sorted(tok.encode(t).ids for t in texts.values())
  batch = next(_train(config, data_dir))
  assert batch["inputs"].max() < tokenizer_lib.vocab_size(tok)
  run = ml_collections.ConfigDict({"data": config})
  resolved = pipeline.resolve_config(run, str(tmp_path / "run"))
  assert resolved.data.tokenizer_sha256 == tokenizer_lib.sha256(path)
  lengths = pipeline.token_bytes(config, data_dir)
  assert lengths[0] == 0 and lengths.sum() > 256


def test_every_dataset_has_the_corpus_interface():
  """The pipeline reads `hf_path`, `is_bpe`, `tokenizes_in_pipeline` and
  `skip_bad_records` of any dataset's settings, unprobed: each dataset's
  Settings derives from `corpus.CorpusSettings`."""
  for name, settings in pipeline.DATASETS.items():
    assert issubclass(settings, corpus.CorpusSettings), name
  plain = delayed_copy.Settings()
  assert (plain.hf_path, plain.is_bpe, plain.tokenizes_in_pipeline,
          plain.skip_bad_records) == ("", False, False, False)
