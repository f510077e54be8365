"""Tests of data/tfds_source.py: the text feature of a prepared TFDS
dataset, with its own validation split or a hash hold-out.

Two tiny datasets are built here, offline: one with train and validation
splits, one with a train split only.
"""

import helpers
import numpy as np
import pytest
import tensorflow_datasets as tfds

from data import builders, pipeline, records
from testbed import corpora

TEXTS = corpora.corpus_texts(80)


class TinyCorpusTest(builders.LocalBuilder):
  """Train (60) and validation (20) texts."""

  SPLITS = {"train": TEXTS[:60], "validation": TEXTS[60:]}

  def _features(self):
    return {"text": tfds.features.Text(), "n": np.int64}

  def _split_generators(self, dl_manager):
    del dl_manager
    return {name: self._generate_examples(texts)
            for name, texts in self.SPLITS.items()}

  def _generate_examples(self, texts):
    for i, text in enumerate(texts):
      yield i, {"text": text, "n": i}


class TinyTrainOnlyTest(TinyCorpusTest):
  """Train texts only."""

  SPLITS = {"train": TEXTS}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tfds"))
  for builder in (TinyCorpusTest, TinyTrainOnlyTest):
    builder(data_dir=path, file_format="tfrecord").download_and_prepare()
  return path


def _config(name, **overrides):
  config = pipeline.default_config()
  config.update(dict(name="tfds", tfds_name=name, seq_len=32, batch_size=4,
                     shuffle_buffer=16, piece_shuffle_buffer=16,
                     pack_window_rows=4, validation_percent=20))
  config.update(overrides)
  return config


def _texts(config, split, data_dir, **kwargs):
  documents, _ = pipeline.load_documents(config, split, data_dir=data_dir,
                                         **kwargs)
  return [bytes(d["tokens"].astype(np.uint8)).decode()
          for d in documents.as_numpy_iterator()]


def test_named_split_hold_out_and_process_shards(data_dir):
  config = _config("tiny_corpus_test")
  # (TFDS stores a split's examples in an order of its own.)
  assert sorted(_texts(config, "train", data_dir)) == sorted(TEXTS[:60])
  assert sorted(_texts(config, "validation", data_dir)) == sorted(TEXTS[60:])
  assert sorted(_texts(
      _config("tiny_corpus_test", tfds_validation_split="train"),
      "validation", data_dir)) == sorted(TEXTS[:60])
  only = _config("tiny_train_only_test")
  train = _texts(only, "train", data_dir)
  validation = _texts(only, "validation", data_dir)
  assert sorted(train + validation) == sorted(TEXTS)
  assert 4 <= len(validation) <= 30
  shards = [_texts(only, "train", data_dir, process_index=i,
                   process_count=2) for i in range(2)]
  assert not set(shards[0]) & set(shards[1])
  assert sorted(shards[0] + shards[1]) == sorted(train)


def test_resume_mid_epoch_is_exact(data_dir, tmp_path):
  config = _config("tiny_train_only_test")
  helpers.assert_resumes_exactly(config, data_dir,
                                       str(tmp_path / "ckpt"), 8, 3)


def test_errors(data_dir, tmp_path):
  kwargs = dict(process_index=0, process_count=1)
  cases = [
      (_config(""), data_dir, "tfds_name must name"),
      (_config("tiny_corpus_test"), str(tmp_path), "is not prepared under"),
      (_config("no_such_dataset_xyz"), data_dir, "no such TFDS dataset"),
      (_config("tiny_corpus_test", text_field="body"), data_dir,
       "has no feature 'body'"),
      (_config("tiny_corpus_test", text_field="n"), data_dir, "not text"),
      (_config("tiny_corpus_test", tfds_split="test"), data_dir,
       "no split 'test'"),
      (_config("tiny_corpus_test", tfds_validation_split="dev"), data_dir,
       "no split 'dev'"),
  ]
  for config, path, message in cases:
    with pytest.raises(ValueError, match=message):
      pipeline.make_train_iterator(config, data_dir=path, **kwargs)
  assert issubclass(records.BadRecordError, ValueError)
