"""Tests of the TFDS builders delayed_copy and text_files (offline, tmp dir)."""

import os
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

from data import delayed_copy, text_files


def _load(name, config, split, data_dir):
  return list(tfds.load(name, split=split, data_dir=data_dir,
                        builder_kwargs={"config": config},
                        shuffle_files=False).as_numpy_iterator())


def test_delayed_copy_builds_offline(tmp_path, capsys, caplog):
  config = delayed_copy.make_config(vocab_size=50, delay=5, min_len=3,
                                    max_len=40, num_train_docs=120,
                                    num_eval_docs=30, seed=7)
  start = time.time()
  builder = tfds.builder("delayed_copy", config=config,
                         data_dir=str(tmp_path), file_format="tfrecord")
  with caplog.at_level("INFO"):
    builder.download_and_prepare()
  # Nothing is downloaded, and the build says so (TFDS's own line claims
  # a download).
  out = capsys.readouterr()
  assert "Download" not in out.out + out.err
  assert "nothing is downloaded" in caplog.text
  assert time.time() - start < 30
  assert builder.info.splits["train"].num_examples == 120
  assert builder.info.splits["validation"].num_examples == 30
  assert builder.info.file_format.value == "tfrecord"
  assert config.name in builder.data_dir

  train = _load("delayed_copy", config, "train", str(tmp_path))
  for doc in train:
    tokens, mask = doc["tokens"], doc["loss_mask"]
    assert tokens.dtype == np.int32 and mask.dtype == np.bool_
    assert 3 <= len(tokens) <= 40 and len(mask) == len(tokens)
    assert ((0 <= tokens) & (tokens < 50)).all()
    np.testing.assert_array_equal(tokens[5:], tokens[:-5])
    np.testing.assert_array_equal(mask, np.arange(len(tokens)) >= 5)

  # The stored split is the generator's output, which is a pure function of
  # (seed, split): same seed -> same documents, other seed or split -> not.
  generated = {tuple(d["tokens"]) for _, d in delayed_copy.generate(
      config, "train")}
  assert {tuple(d["tokens"]) for d in train} == generated
  again = [d["tokens"] for _, d in delayed_copy.generate(config, "train")]
  first = [d["tokens"] for _, d in delayed_copy.generate(config, "train")]
  assert all(np.array_equal(a, b) for a, b in zip(again, first, strict=True))
  other = delayed_copy.make_config(vocab_size=50, delay=5, min_len=3,
                                   max_len=40, num_train_docs=120,
                                   num_eval_docs=30, seed=8)
  assert other.name != config.name
  assert [d["tokens"].tolist() for _, d in delayed_copy.generate(
      other, "train")] != [a.tolist() for a in first]
  val = [d["tokens"].tolist() for _, d in delayed_copy.generate(
      config, "validation")]
  assert val[:5] != [a.tolist() for a in first[:5]]


@pytest.mark.parametrize("kwargs,match", [
    (dict(delay=0), "delay"),
    (dict(min_len=1), "min_len"),
    (dict(min_len=10, max_len=9), "min_len"),
    (dict(vocab_size=1), "vocab_size"),
    (dict(num_eval_docs=0), "num_eval_docs"),
    (dict(delay=2.5), "delay"),
])
def test_delayed_copy_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    delayed_copy.make_config(**kwargs)


def _write_corpus(root, num_files=12):
  contents = {}
  for i in range(num_files):
    relpath = os.path.join(f"dir{i % 3}", f"file{i}.txt")
    data = (f"file {i}: " + "abc\n" * i).encode() + bytes([0, 255, i])
    os.makedirs(os.path.join(root, os.path.dirname(relpath)), exist_ok=True)
    with open(os.path.join(root, relpath), "wb") as f:
      f.write(data)
    contents[relpath] = data
  with open(os.path.join(root, "skipped.md"), "w") as f:
    f.write("not matched")
  return contents


def test_text_files_builds_offline(tmp_path):
  corpus = tmp_path / "corpus"
  contents = _write_corpus(str(corpus))
  config = text_files.make_config(glob=str(corpus / "**" / "*.txt"),
                                  validation_percent=30)
  data_dir = str(tmp_path / "tfds")
  start = time.time()
  splits = {split: _load("text_files", config, split, data_dir)
            for split in ("train", "validation")}
  assert time.time() - start < 30
  seen = {}
  for split, docs in splits.items():
    assert docs, split
    for doc in docs:
      path = doc["path"].decode()
      assert path not in seen  # Train and validation are disjoint.
      seen[path] = split
      assert doc["tokens"].dtype == np.uint8
      assert doc["tokens"].tobytes() == contents[path]
  assert sorted(seen) == sorted(contents)
  # The split of a file is a function of its relative path only.
  expected = text_files.split_files(
      [(p, p) for p in contents], validation_percent=30)
  assert sorted(p for p, s in seen.items() if s == "validation") == sorted(
      r for _, r in expected["validation"])

  # A changed file gets a new config name (no stale dataset).
  path = corpus / "dir0" / "file0.txt"
  path.write_bytes(b"changed contents")
  changed = text_files.make_config(glob=str(corpus / "**" / "*.txt"),
                                   validation_percent=30)
  assert changed.name != config.name


def test_text_files_errors(tmp_path):
  with pytest.raises(ValueError, match="matched no files"):
    text_files.make_config(glob=str(tmp_path / "*.nothing"))
  (tmp_path / "one.txt").write_text("only one")
  with pytest.raises(ValueError, match="at least 2 files"):
    text_files.make_config(glob=str(tmp_path / "*.txt"))
  with pytest.raises(ValueError, match="validation_percent"):
    text_files.make_config(glob=str(tmp_path / "*.txt"), validation_percent=0)


def test_text_files_default_is_stdlib():
  config = text_files.make_config()
  assert config.glob == text_files.default_glob()
  files = text_files.list_files(config.glob, exclude_installed=True)
  assert any(rel == "os.py" for _, rel in files)
  assert not any("site-packages" in rel for _, rel in files)
  splits = text_files.split_files(files, config.validation_percent)
  assert 0 < len(splits["validation"]) < len(splits["train"])


def test_default_settings_use_the_registered_config(tmp_path):
  # TFDS refuses a custom config named like a registered one unless it is the
  # same object.
  config = delayed_copy.make_config()
  assert config is delayed_copy.DelayedCopy.BUILDER_CONFIGS[0]
  builder = tfds.builder("delayed_copy", config=config, data_dir=str(tmp_path))
  assert builder.builder_config is config
