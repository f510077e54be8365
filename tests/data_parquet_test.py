"""Tests of data/parquet.py: exact documents from row groups of several
files, resume, process shards, and bad files and rows."""

import helpers
import numpy as np
import pyarrow as pa
from pyarrow import parquet as pq
import pytest

from data import parquet, pipeline, records
from testbed import corpora

SEQ_LEN = 32
BATCH = 4


def _write(path, texts, column="text", row_group_size=7, type_=None):
  table = pa.table({"id": list(range(len(texts))),
                    column: pa.array(texts, type=type_)})
  pq.write_table(table, path, row_group_size=row_group_size)
  return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Three files of several row groups (one with a large_string column)."""
  root = tmp_path_factory.mktemp("parquet")
  texts = corpora.corpus_texts(100)
  _write(root / "a.parquet", texts[:40])
  _write(root / "b.parquet", texts[40:75], type_=pa.large_string())
  _write(root / "c.parquet", texts[75:], row_group_size=100)
  return root, texts


def _config(files, **overrides):
  config = pipeline.default_config()
  config.update(dict(name="parquet", files=files, seq_len=SEQ_LEN,
                     batch_size=BATCH, shuffle_buffer=16,
                     piece_shuffle_buffer=16, pack_window_rows=4,
                     validation_percent=20))
  config.update(overrides)
  return config


def _texts(config, split, data_dir, **kwargs):
  documents, _ = pipeline.load_documents(config, split, data_dir=data_dir,
                                         **kwargs)
  return [bytes(d["tokens"].astype(np.uint8)).decode()
          for d in documents.as_numpy_iterator()]


def test_documents_resume_and_process_shards(corpus, tmp_path):
  root, texts = corpus
  config = _config(f"{root}/*.parquet")
  data_dir = str(tmp_path)
  train = _texts(config, "train", data_dir)
  validation = _texts(config, "validation", data_dir)
  assert sorted(train + validation) == sorted(texts)
  assert 5 <= len(validation) <= 35
  shards = [_texts(config, "train", data_dir, process_index=i,
                   process_count=2) for i in range(2)]
  assert not set(shards[0]) & set(shards[1])
  assert sorted(shards[0] + shards[1]) == sorted(train)

  helpers.assert_resumes_exactly(config, data_dir,
                                       str(tmp_path / "ckpt"), 9, 4)


def _documents(config, data_dir):
  documents, info = pipeline.load_documents(config, "train",
                                            data_dir=data_dir)
  with records.named_bad_records():   # As the pipeline's iterators do.
    return [bytes(d["tokens"].astype(np.uint8)).decode()
            for d in documents.as_numpy_iterator()], info.skipped


def test_bad_rows_and_files(tmp_path):
  good = [f"document {i} " * 3 for i in range(30)]
  data_dir = str(tmp_path)
  rows = [
      (_write(tmp_path / "null.parquet", good[:3] + [None] + good[3:]),
       "null.parquet, row 3: no text field 'text'", "missing_field"),
      (_write(tmp_path / "bytes.parquet", [g.encode() for g in good[:5]]
              + [b"caf\xe9"] + [g.encode() for g in good[5:]]),
       "bytes.parquet, row 5: the text is not valid UTF-8", "not_utf8"),
      # Row groups of 7 rows: row 17 is row 3 of the third group, so a
      # number counted from the group's start would read "row 3".
      (_write(tmp_path / "late.parquet", good[:17] + [None] + good[17:]),
       "late.parquet, row 17: no text field 'text'", "missing_field"),
  ]
  for path, message, kind in rows:
    config = _config(path, validation_percent=1)
    with pytest.raises(records.BadRecordError, match=message):
      _documents(config, data_dir)
    config.skip_bad_records = True
    documents, skipped = _documents(config, data_dir)
    assert len(documents) == 30 and set(documents) <= set(good)
    assert skipped.counts() == {kind: 1}
  ok = _write(tmp_path / "ok.parquet", good)
  (tmp_path / "junk.parquet").write_bytes(b"not parquet")
  files = [
      (_write(tmp_path / "empty.parquet", [], type_=pa.string()),
       "the file has no rows", "empty_file", 1),
      (_write(tmp_path / "body.parquet", good[:4], column="body"),
       "no column 'text'", "missing_field", 4),
      (str(tmp_path / "junk.parquet"), "not a readable Parquet file",
       "bad_file", 1),
      (str(tmp_path / "nothing" / "*.parquet"), "matches no file",
       "glob_matches_nothing", 1),
  ]
  for path, message, kind, count in files:
    with pytest.raises(records.BadRecordError, match=message):
      _documents(_config(f"{ok},{path}"), data_dir)
    _, skipped = _documents(_config(f"{ok},{path}", skip_bad_records=True),
                            data_dir)
    assert skipped.counts() == {kind: count}


def test_a_missing_column_names_the_first_eight_columns(tmp_path):
  path = str(tmp_path / "wide.parquet")
  pq.write_table(pa.table({f"c{i}": ["x"] for i in range(10)}), path)
  with pytest.raises(records.BadRecordError) as error:
    parquet.row_groups(path, "text", None)
  assert ("no column 'text' (columns: ['c0', 'c1', 'c2', 'c3', 'c4', 'c5', "
          "'c6', 'c7'])") in str(error.value)
