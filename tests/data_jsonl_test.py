"""Tests of data/jsonl.py (and data/records.py through it): exact documents
from plain, gzip and zstd JSON Lines, rows, resume in a new process,
process shards, a released model's tokenizer, and every kind of bad
input."""

import gzip
import hashlib
import json
import os
import subprocess
import sys

import helpers
import ml_collections
import numpy as np
import process_support
import pyarrow as pa
import pytest
import tensorflow as tf
import tokenizers

from data import jsonl, packing, pipeline, records
from data import tokenizer as data_tokenizer
from testbed import corpora

SEQ_LEN = 32
BATCH = 4
NUM_DOCS = 120


def _line(text, field="text"):
  return json.dumps({"id": 1, field: text, "meta": {"a": [1]}}) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Documents in three files: plain, gzip and zstd (with blank lines)."""
  root = tmp_path_factory.mktemp("jsonl")
  texts = corpora.corpus_texts(NUM_DOCS)
  parts = [texts[i::3] for i in range(3)]
  (root / "a.jsonl").write_text("".join(map(_line, parts[0])) + "\n  \n")
  with gzip.open(root / "b.jsonl.gz", "wt") as f:
    f.write("".join(map(_line, parts[1])))
  with pa.CompressedOutputStream(str(root / "c.jsonl.zst"), "zstd") as f:
    f.write("".join(map(_line, parts[2])).encode())
  return root, texts


def _config(files, **overrides):
  config = pipeline.default_config()
  config.update(dict(name="jsonl", files=files, seq_len=SEQ_LEN,
                     batch_size=BATCH, shuffle_buffer=16,
                     piece_shuffle_buffer=16, pack_window_rows=4,
                     validation_percent=20))
  config.update(overrides)
  return config


def _files(root):
  return f"{root}/*.jsonl,{root}/*.jsonl.gz,{root}/*.zst"


def _texts(config, split, data_dir, **kwargs):
  documents, _ = pipeline.load_documents(config, split, data_dir=data_dir,
                                         **kwargs)
  return [bytes(d["tokens"].astype(np.uint8)).decode()
          for d in documents.as_numpy_iterator()]


def _held_out(text, percent=20):
  return _held_out_line(_line(text).encode(), percent)


def _held_out_line(line, percent=1):
  return int(tf.strings.to_hash_bucket_fast(line.rstrip(b"\n"), 100)) < (
      percent)


def test_documents_are_the_records_exactly_and_split_by_hash(corpus,
                                                             tmp_path):
  root, texts = corpus
  config = _config(_files(root))
  data_dir = str(tmp_path)
  train = _texts(config, "train", data_dir)
  validation = _texts(config, "validation", data_dir)
  assert sorted(train + validation) == sorted(texts)
  assert sorted(validation) == sorted(t for t in texts if _held_out(t))
  assert 5 <= len(validation) <= 40
  assert pipeline.vocab_size(config) == 256
  # A named validation split: its files, and all of `files` for training.
  named = _config(f"{root}/*.jsonl,{root}/*.gz",
                  validation_files=f"{root}/*.zst")
  assert _texts(named, "validation", data_dir) == texts[2::3]
  assert sorted(_texts(named, "train", data_dir)) == sorted(
      texts[0::3] + texts[1::3])


def test_eval_rows_are_the_packed_documents(corpus, tmp_path):
  root, _ = corpus
  config = _config(_files(root), pack_window_rows=64)
  data_dir = str(tmp_path)
  documents, _ = pipeline.load_documents(config, "validation",
                                         data_dir=data_dir)
  expected = list(packing.pack_documents(
      documents, SEQ_LEN, window_size=1000).as_numpy_iterator())
  rows = [{k: v[i] for k, v in b.items()}
          for b in pipeline.make_eval_iterator(
              config, data_dir=data_dir, process_index=0, process_count=1)
          for i in range(BATCH)]
  rows = [r for r in rows if r["segment_ids"].any()]
  assert len(rows) == len(expected)
  for got, want in zip(rows, expected, strict=True):
    for key in want:
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)


_SAVE_IN_A_NEW_PROCESS = """
import sys
import numpy as np
from data import pipeline
config = pipeline.default_config()
config.update(dict(name="jsonl", files=sys.argv[1], tokenizer=sys.argv[2],
                   seq_len=32, batch_size=4, shuffle_buffer=16,
                   piece_shuffle_buffer=16, pack_window_rows=4,
                   validation_percent=20))
it = pipeline.make_train_iterator(config, data_dir=sys.argv[3],
                                  process_index=0, process_count=1)
for _ in range(5):
  next(it)
it.save(sys.argv[4])
np.savez(sys.argv[5], **next(it))
"""


def test_a_new_process_resumes_a_released_tokenizer_stream(corpus,
                                                          tmp_path):
  """Mid-epoch, exactly: the tokenizing function is rebuilt, not saved."""
  root, texts = corpus
  path = helpers.write_hf_tokenizer(str(tmp_path / "tokenizer.json"),
                                    texts)
  args = [_files(root), f"hf:{path}", str(tmp_path), str(tmp_path / "ckpt"),
          str(tmp_path / "next.npz")]
  subprocess.run([sys.executable, "-c", _SAVE_IN_A_NEW_PROCESS, *args],
                 env=process_support.subprocess_env(), check=True, timeout=300)
  it = pipeline.make_train_iterator(
      _config(_files(root), tokenizer=f"hf:{path}"), data_dir=str(tmp_path),
      process_index=0, process_count=1)
  it.restore(str(tmp_path / "ckpt"))
  got, want = next(it), np.load(tmp_path / "next.npz")
  assert got["inputs"].max() >= 256   # BPE ids, not bytes.
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_two_processes_see_disjoint_documents_covering_the_split(
    corpus, tmp_path):
  root, _ = corpus
  config = _config(_files(root))
  shards = [_texts(config, "train", str(tmp_path), process_index=i,
                   process_count=2) for i in range(2)]
  assert not set(shards[0]) & set(shards[1])
  assert abs(len(shards[0]) - len(shards[1])) <= 1
  assert sorted(shards[0] + shards[1]) == sorted(
      _texts(config, "train", str(tmp_path)))


def test_hf_tokenizer_gives_the_library_ids(corpus, tmp_path):
  root, texts = corpus
  path = helpers.write_hf_tokenizer(str(tmp_path / "tokenizer.json"),
                                    texts)
  config = _config(_files(root), tokenizer=f"hf:{path}")
  tok = tokenizers.Tokenizer.from_file(path)
  assert pipeline.vocab_size(config) == tok.get_vocab_size()
  documents, _ = pipeline.load_documents(config, "validation",
                                         data_dir=str(tmp_path))
  ids = [d["tokens"].tolist() for d in documents.as_numpy_iterator()]
  held_out = [t for t in texts if _held_out(t)]
  assert sorted(ids) == sorted(tok.encode(t).ids for t in held_out)
  assert all(i[0] == 0 for i in ids)      # The template's BOS per document.
  assert sorted(tok.decode(i) for i in ids) == sorted(held_out)
  resolved = pipeline.resolve_config(
      ml_collections.ConfigDict({"data": config}),
      str(tmp_path / "run"))
  assert len(resolved.data.tokenizer_sha256) == 64


def test_a_bpe_is_learnt_from_the_training_records(corpus, tmp_path,
                                                   monkeypatch):
  """`tokenizer="bpe"`, as for text files: a byte-level BPE learnt once per
  data dir from the training split's texts (no validation record), named
  by path and SHA-256 in the run's config; its ids decode back to each
  validation record."""
  root, texts = corpus
  config = _config(_files(root), tokenizer="bpe", bpe_vocab_size=300)
  assert pipeline.vocab_size(config) == 300
  learnt_from = []
  train = data_tokenizer.train
  monkeypatch.setattr(data_tokenizer, "train", lambda t, v: (
      learnt_from.extend(t), train(t, v))[1])
  run = ml_collections.ConfigDict({"data": config})
  resolved = pipeline.resolve_config(run, str(tmp_path / "run"))
  held_out = [t for t in texts if _held_out(t)]
  assert held_out and sorted(learnt_from) == sorted(
      t for t in texts if not _held_out(t))
  path = resolved.data.tokenizer_path
  assert os.path.isfile(path) and len(resolved.data.tokenizer_sha256) == 64
  tok = tokenizers.Tokenizer.from_file(path)
  assert 256 < tok.get_vocab_size() <= 300
  documents, _ = pipeline.load_documents(resolved.data, "validation",
                                         data_dir=str(tmp_path))
  ids = [d["tokens"].tolist() for d in documents.as_numpy_iterator()]
  assert max(max(i) for i in ids) < 300
  assert sum(map(len, ids)) < sum(len(t.encode()) for t in held_out)
  assert sorted(tok.decode(i) for i in ids) == sorted(held_out)
  # Built once: a second run of the same corpus reuses the file.
  learnt_from.clear()
  again = pipeline.resolve_config(run, str(tmp_path / "run"))
  assert not learnt_from and again.data.tokenizer_path == path
  assert again.data.tokenizer_sha256 == resolved.data.tokenizer_sha256


def _write(path, lines):
  path.write_bytes(b"".join(lines))
  return str(path)


_BAD = [
    (b"{not json\n", "malformed_json", "line 2: malformed JSON"),
    # One character: not a blank line to leave out.
    (b"x\n", "malformed_json", "line 2: malformed JSON"),
    (b'{"title": "x"}\n', "missing_field", "line 2: no text field 'text'"),
    (b'{"text": 3}\n', "missing_field", "line 2: the field 'text' is a JSON"),
    (b'{"text": "caf\xe9 au lait"}\n', "not_utf8", "line 2: the text is not"),
    (b'{"text": "\\udc80"}\n', "not_utf8", "line 2: the text is not"),
]


def _documents(config, data_dir):
  documents, info = pipeline.load_documents(config, "train",
                                            data_dir=data_dir)
  with records.named_bad_records():   # As the pipeline's iterators do.
    return [bytes(d["tokens"].astype(np.uint8)).decode()
            for d in documents.as_numpy_iterator()], info.skipped


@pytest.mark.parametrize("line,kind,message", _BAD)
def test_a_bad_record_is_named_or_skipped_and_counted(tmp_path, line, kind,
                                                      message):
  assert not _held_out_line(line)   # In the training split.
  texts = [f"document {i} " * 3 for i in range(40)]
  good = [_line(t).encode() for t in texts]
  path = _write(tmp_path / "bad.jsonl", good[:1] + [line] + good[1:])
  config = _config(path, validation_percent=1)
  with pytest.raises(records.BadRecordError, match=message) as error:
    _documents(config, str(tmp_path))
  assert path in str(error.value)
  config.skip_bad_records = True
  documents, skipped = _documents(config, str(tmp_path))
  assert documents == [t for t in texts if not _held_out(t, 1)]
  assert skipped.counts() == {kind: 1}


def test_bad_files_and_globs(tmp_path):
  texts = [f"document {i}" for i in range(20)]
  good = _write(tmp_path / "good.jsonl", [_line(t).encode() for t in texts])
  empty = _write(tmp_path / "empty.jsonl", [])
  data_dir = str(tmp_path)
  none = str(tmp_path / "none" / "*.jsonl")
  cases = [(f"{good},{empty}", "empty.jsonl: the file is empty",
            "empty_file"),
           (f"{good},{none}", "matches no file", "glob_matches_nothing")]
  for files, message, kind in cases:
    with pytest.raises(records.BadRecordError, match=message):
      _documents(_config(files), data_dir)
    documents, skipped = _documents(_config(files, skip_bad_records=True),
                                    data_dir)
    assert sorted(documents) == sorted(
        t for t in texts if not _held_out(t))
    assert skipped.counts() == {kind: 1}
  # The training iterator reports its stream's count as metrics, a file
  # once however many epochs are read.
  it = pipeline.make_train_iterator(
      _config(f"{good},{empty}", skip_bad_records=True), data_dir=data_dir,
      process_index=0, process_count=1)
  for _ in range(6):
    next(it)
  assert it.metrics() == {"data/skipped_empty_file": 1.0,
                          "data/skipped_records": 1.0}
  # A glob that matches nothing when no other glob matches anything is a
  # wrong path: the error does not suggest skip_bad_records (which could
  # not help), with or without it.
  cases = [(_config(none), "matches no file: check the path\\.$"),
           (_config(none, skip_bad_records=True), "matches no file"),
           (_config(empty, skip_bad_records=True),
            "every file of the train split"),
           (_config(""), "config.data.files is empty"),
           (_config(good, text_field="body", skip_bad_records=True),
            "no document among"),
           (_config(good, tokenizer="spm"),
            r"one of \('bytes', 'bpe'\) or 'hf:PATH'")]
  for config, message in cases:
    with pytest.raises(ValueError, match=message):
      _documents(config, data_dir)


def test_double_star_globs_recurse_into_nested_folders(tmp_path):
  """`**` matches the folder itself and every folder below it (Python's
  recursive glob); each glob's files sorted, globs in order, no repeats."""
  for rel in ("a.jsonl", "x/b.jsonl", "x/y/c.jsonl", "x/y/z/d.jsonl",
              "x/y/skip.txt"):
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"text": "t"}\n')
  got = records.match_files(f"{tmp_path}/**/*.jsonl,{tmp_path}/x/b.jsonl",
                            "files", None)
  assert [p[len(str(tmp_path)) + 1:] for p in got] == [
      "a.jsonl", "x/b.jsonl", "x/y/c.jsonl", "x/y/z/d.jsonl"]
  got = records.match_files(f"{tmp_path}/x/**/c.jsonl", "files", None)
  assert [p[len(str(tmp_path)) + 1:] for p in got] == ["x/y/c.jsonl"]


def test_a_missing_field_names_the_first_eight_keys():
  settings = pipeline.DataConfig.from_config(_config("/x/*.jsonl")).dataset
  record = json.dumps({f"k{i}": i for i in range(10)}).encode()
  with pytest.raises(records.Problem) as error:
    settings.text(record)
  assert str(error.value) == (
      "no text field 'text' (keys: ['k0', 'k1', 'k2', 'k3', 'k4', 'k5', "
      "'k6', 'k7'])")


def test_a_zstd_file_is_decompressed_once_into_a_named_copy(corpus,
                                                            tmp_path):
  root, _ = corpus
  path = str(root / "c.jsonl.zst")
  out = jsonl.decompressed(path, str(tmp_path))
  # <data_dir>/decompressed/<16 hex digits of the file's key>_<its name>.
  stat = os.stat(path)
  key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}"
                       .encode()).hexdigest()
  assert out == os.path.join(str(tmp_path), "decompressed",
                             f"{key[:16]}_c.jsonl")
  with pa.CompressedInputStream(pa.OSFile(path), "zstd") as f:
    with open(out, "rb") as copy:
      assert copy.read() == f.read()
  written = os.stat(out).st_mtime_ns
  assert jsonl.decompressed(path, str(tmp_path)) == out
  assert os.stat(out).st_mtime_ns == written
  # A second file's copy beside the first one's.
  other = str(tmp_path / "d.jsonl.zst")
  with pa.CompressedOutputStream(other, "zstd") as f:
    f.write(b'{"text": "d"}\n')
  with open(jsonl.decompressed(other, str(tmp_path)), "rb") as copy:
    assert copy.read() == b'{"text": "d"}\n'
