"""Input pipeline: `config.data` -> iterator of packed numpy batches.

Interface used by the training code:

  from data import pipeline
  config.data = pipeline.default_config()          # in the config file
  vocab = pipeline.vocab_size(config.data)         # 256 for text_files
  train_it = pipeline.make_train_iterator(config.data, workdir=workdir)
  batch = next(train_it)
  train_it.save(ckpt_dir)      # or pipeline.save_iterator(train_it, ckpt_dir)
  train_it.restore(ckpt_dir)   # the next batch is exactly the one after save
  for batch in pipeline.make_eval_iterator(config.data, workdir=workdir):
    ...                        # validation split, finite, deterministic

Every batch is a dict of numpy arrays of shape `[batch, seq_len]` where `batch`
is the per-process batch (`config.data.batch_size // jax.process_count()`):
int32 `inputs`, `targets`, `segment_ids` (1..n per document piece in a row,
0 on padding), `positions` (restart at 0 per segment) and float32
`loss_mask` (0 on padding and on unpredictable targets). See
`data/packing.py` for the exact row layout.

`config.data` fields (see `default_config`):

* `name`: "delayed_copy" or "text_files".
* `data_dir`: where TFDS builds and finds the datasets; None means
  `<workdir>/tfds`. Datasets are built on first use, offline.
* `seq_len`, `batch_size` (global, over all processes).
* `seed`: shuffling seed of the training stream.
* `reset_at_document_boundaries`: per-document segment ids/positions (True)
  or one running segment per row (False).
* `shuffle_buffer`: documents in the shuffle buffer (0: no shuffling).
* `pack_window_rows`: rows' worth of tokens packed together (fill vs memory).
* delayed_copy: `vocab_size`, `delay`, `min_len`, `max_len`,
  `num_train_docs`, `num_eval_docs`, `dataset_seed` (the data itself).
* text_files: `glob` ("" = the standard library's .py files),
  `validation_percent`. The vocabulary is the 256 byte values.

Training stream: the process's shard of the train split (TFDS even split by
`jax.process_index()/process_count()`), shuffled with `seed` (a new order each
epoch, the same sequence for the same seed), repeated forever, packed, batched
and prefetched. Everything is a tf.data graph (no Python generators), so the
iterator's position, buffers included, is saved with `tf.train.Checkpoint`.
The eval stream is the process's shard of the validation split, in file
order, packed and batched; its last batch is padded with empty rows
(`loss_mask` 0), and `num_batches` pads or cuts it to a fixed number of
batches so that all processes run the same number of eval steps.
"""

import os
from typing import Any, Iterator

from absl import logging
import ml_collections
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from data import delayed_copy, packing, text_files

DATASETS = ("delayed_copy", "text_files")
_PREFETCH_BATCHES = 2
_MAX_WINDOW_DOCS = 1 << 16


def default_config() -> ml_collections.ConfigDict:
  """Returns the default `config.data`."""
  config = ml_collections.ConfigDict()
  config.name = "delayed_copy"
  config.data_dir = ml_collections.FieldReference(None, field_type=str)
  config.seq_len = 1024
  config.batch_size = 8
  config.seed = 0
  config.reset_at_document_boundaries = True
  config.shuffle_buffer = 1024
  config.pack_window_rows = 64
  # delayed_copy.
  config.vocab_size = 256
  config.delay = 8
  config.min_len = 16
  config.max_len = 512
  config.num_train_docs = 10_000
  config.num_eval_docs = 500
  config.dataset_seed = 0
  # text_files.
  config.glob = ""
  config.validation_percent = 5
  return config


def _get(config: Any, key: str, default: Any = None) -> Any:
  value = config.get(key, default) if hasattr(config, "get") else getattr(
      config, key, default)
  return default if value is None else value


def _check_name(config: Any) -> str:
  name = _get(config, "name")
  if name not in DATASETS:
    raise ValueError(f"Unknown dataset name {name!r}; known: {DATASETS}.")
  return name


def vocab_size(config: ml_collections.ConfigDict) -> int:
  """Returns the vocabulary size of the configured dataset.

  Args:
    config: `config.data`.

  Returns:
    `config.vocab_size` for delayed_copy, 256 (bytes) for text_files.

  Raises:
    ValueError: unknown dataset name.
  """
  if _check_name(config) == "text_files":
    return text_files.VOCAB_SIZE
  return int(config.vocab_size)


def builder_config(config: ml_collections.ConfigDict
                   ) -> tfds.core.BuilderConfig:
  """Returns the TFDS builder config that `config.data` describes.

  Args:
    config: `config.data`.

  Returns:
    A `DelayedCopyConfig` or `TextFilesConfig`.

  Raises:
    ValueError: unknown dataset name, bad values, or an empty glob.
  """
  name = _check_name(config)
  if name == "delayed_copy":
    return delayed_copy.make_config(
        vocab_size=config.vocab_size, delay=config.delay,
        min_len=config.min_len, max_len=config.max_len,
        num_train_docs=config.num_train_docs,
        num_eval_docs=config.num_eval_docs,
        seed=_get(config, "dataset_seed", 0))
  return text_files.make_config(
      glob=_get(config, "glob", ""),
      validation_percent=_get(config, "validation_percent", 5))


def resolve_data_dir(config: ml_collections.ConfigDict,
                     workdir: str | None = None,
                     data_dir: str | None = None) -> str:
  """Returns the absolute TFDS data dir.

  Args:
    config: `config.data`.
    workdir: the run's workdir; the default data dir is `<workdir>/tfds`.
    data_dir: explicit data dir, overrides everything.

  Returns:
    `data_dir`, else `config.data_dir`, else `<workdir>/tfds`.

  Raises:
    ValueError: none of the three is given.
  """
  path = data_dir or _get(config, "data_dir") or (
      os.path.join(workdir, "tfds") if workdir else None)
  if not path:
    raise ValueError("No data dir: set config.data.data_dir or pass workdir.")
  return os.path.abspath(os.path.expanduser(path))


def _hide_gpus_from_tf() -> None:
  try:
    tf.config.set_visible_devices([], "GPU")
  except RuntimeError:  # TF devices already initialised; nothing to change.
    pass


def _process(process_index: int | None, process_count: int | None
             ) -> tuple[int, int]:
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top
    process_index = jax.process_index() if process_index is None else (
        process_index)
    process_count = jax.process_count() if process_count is None else (
        process_count)
  if not 0 <= process_index < process_count:
    raise ValueError(f"Bad process index {process_index} of {process_count}.")
  return process_index, process_count


def load_documents(config: ml_collections.ConfigDict,
                   split: str,
                   *,
                   data_dir: str,
                   process_index: int = 0,
                   process_count: int = 1
                   ) -> tuple[tf.data.Dataset, tfds.core.DatasetInfo]:
  """Builds the dataset if needed and loads this process's documents.

  Args:
    config: `config.data`.
    split: "train" or "validation".
    data_dir: TFDS data dir.
    process_index: this process's shard.
    process_count: number of shards.

  Returns:
    (documents, info): a dataset of dicts with `tokens` (int [L]) and, for
    delayed_copy, `loss_mask` (bool [L]), in file order; the TFDS info.

  Raises:
    ValueError: unknown dataset name or split, bad builder config values.
  """
  if split not in ("train", "validation"):
    raise ValueError(f"Unknown split {split!r}; use 'train' or 'validation'.")
  _hide_gpus_from_tf()
  name = _check_name(config)
  bconfig = builder_config(config)
  sub_split = tfds.even_splits(split, n=process_count)[process_index]
  tfds.disable_progress_bar()
  documents, info = tfds.load(
      name,
      split=sub_split,
      data_dir=data_dir,
      download=True,
      shuffle_files=False,
      with_info=True,
      builder_kwargs={"config": bconfig, "file_format": "tfrecord"},
      # No in-memory cache: it would be written into iterator checkpoints.
      read_config=tfds.ReadConfig(try_autocache=False),
  )
  keys = ("tokens", "loss_mask") if name == "delayed_copy" else ("tokens",)
  documents = documents.map(lambda d: {k: d[k] for k in keys})
  return documents, info


def _window_size(config: ml_collections.ConfigDict, info: Any, split: str,
                 seq_len: int) -> int:
  """Documents per packing window: about `pack_window_rows` rows of tokens."""
  if config.name == "delayed_copy":
    mean_len = (config.min_len + config.max_len) / 2
  else:
    split_info = info.splits[split]
    mean_len = split_info.num_bytes / max(split_info.num_examples, 1)
  rows = _get(config, "pack_window_rows", 64)
  window = int(round(rows * seq_len / max(mean_len, 1.0)))
  return int(np.clip(window, 1, _MAX_WINDOW_DOCS))


def _options() -> tf.data.Options:
  options = tf.data.Options()
  options.deterministic = True
  return options


def _numpy(batch: dict[str, tf.Tensor]) -> dict[str, np.ndarray]:
  return {key: value.numpy() for key, value in batch.items()}


class DataIterator:
  """Iterator of numpy batches whose position can be saved and restored."""

  def __init__(self, dataset: tf.data.Dataset, *, vocab_size: int,
               process_index: int, process_count: int):
    self.dataset = dataset
    self.vocab_size = vocab_size
    self.process_index = process_index
    self.process_count = process_count
    self._iterator = iter(dataset)

  def __iter__(self) -> "DataIterator":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return _numpy(next(self._iterator))

  @property
  def element_spec(self) -> dict[str, tf.TensorSpec]:
    return self.dataset.element_spec

  def _prefix(self, directory: str) -> str:
    return os.path.join(
        directory,
        f"iterator-{self.process_index:05d}-of-{self.process_count:05d}")

  def save(self, directory: str) -> str:
    """Saves the iterator position (buffers included) under `directory`.

    Args:
      directory: a directory (created if needed); each process writes its own
        files into it.

    Returns:
      The checkpoint prefix written.
    """
    os.makedirs(directory, exist_ok=True)
    return tf.train.Checkpoint(iterator=self._iterator).write(
        self._prefix(directory))

  def restore(self, directory: str) -> None:
    """Restores a position saved by `save` from the same pipeline config.

    Args:
      directory: the directory given to `save`.

    Raises:
      FileNotFoundError: no iterator checkpoint for this process there.
    """
    prefix = self._prefix(directory)
    if not tf.io.gfile.exists(prefix + ".index"):
      raise FileNotFoundError(f"No data iterator checkpoint at {prefix}.")
    tf.train.Checkpoint(iterator=self._iterator).read(
        prefix).assert_consumed()


def save_iterator(iterator: DataIterator, directory: str) -> str:
  """Saves a train iterator's position; see `DataIterator.save`."""
  return iterator.save(directory)


def restore_iterator(iterator: DataIterator, directory: str) -> None:
  """Restores a train iterator's position; see `DataIterator.restore`."""
  iterator.restore(directory)


class EvalIterable:
  """Re-iterable finite eval stream; each `iter()` starts from the start."""

  def __init__(self, dataset: tf.data.Dataset, *, vocab_size: int):
    self.dataset = dataset
    self.vocab_size = vocab_size

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    for batch in self.dataset:
      yield _numpy(batch)


def _resolve(config, batch_size, seq_len, process_index, process_count):
  """Returns (seq_len, per-process batch, process_index, process_count)."""
  seq_len = int(_get(config, "seq_len") if seq_len is None else seq_len)
  batch_size = int(
      _get(config, "batch_size") if batch_size is None else batch_size)
  if seq_len < 2:
    raise ValueError(f"seq_len must be >= 2, got {seq_len}.")
  process_index, process_count = _process(process_index, process_count)
  if batch_size < 1 or batch_size % process_count:
    raise ValueError(f"The global batch_size {batch_size} must be a positive "
                     f"multiple of the process count {process_count}.")
  return seq_len, batch_size // process_count, process_index, process_count


def make_train_iterator(config: ml_collections.ConfigDict,
                        *,
                        workdir: str | None = None,
                        data_dir: str | None = None,
                        batch_size: int | None = None,
                        seq_len: int | None = None,
                        seed: int | None = None,
                        process_index: int | None = None,
                        process_count: int | None = None) -> DataIterator:
  """Returns the infinite, shuffled, packed training stream of this process.

  Args:
    config: `config.data`.
    workdir: run workdir (the default data dir is `<workdir>/tfds`).
    data_dir: overrides `config.data_dir`.
    batch_size: global batch size; default `config.batch_size`.
    seq_len: row length; default `config.seq_len`.
    seed: shuffle seed; default `config.seed`.
    process_index: default `jax.process_index()`.
    process_count: default `jax.process_count()`.

  Returns:
    A `DataIterator` of `[batch_size // process_count, seq_len]` batches.

  Raises:
    ValueError: unknown dataset, empty glob, `seq_len < 2`, a batch size that
      the process count does not divide, or no data dir.
  """
  _check_name(config)
  seq_len, local_batch, process_index, process_count = _resolve(
      config, batch_size, seq_len, process_index, process_count)
  seed = int(_get(config, "seed", 0) if seed is None else seed)
  documents, info = load_documents(
      config, "train", data_dir=resolve_data_dir(config, workdir, data_dir),
      process_index=process_index, process_count=process_count)
  shuffle_buffer = int(_get(config, "shuffle_buffer", 0))
  if shuffle_buffer > 0:
    documents = documents.shuffle(shuffle_buffer, seed=seed,
                                  reshuffle_each_iteration=True)
  documents = documents.repeat()
  rows = packing.pack_documents(
      documents, seq_len,
      reset_at_document_boundaries=bool(
          _get(config, "reset_at_document_boundaries", True)),
      window_size=_window_size(config, info, "train", seq_len),
      num_parallel_calls=tf.data.AUTOTUNE)
  dataset = rows.batch(local_batch, drop_remainder=True).prefetch(
      _PREFETCH_BATCHES).with_options(_options())
  logging.info("Train data: %s, seq_len %d, %d rows per process batch, "
               "process %d of %d.", config.name, seq_len, local_batch,
               process_index, process_count)
  return DataIterator(dataset, vocab_size=vocab_size(config),
                      process_index=process_index,
                      process_count=process_count)


def _pad_batch(batch: dict[str, tf.Tensor], size: int
               ) -> dict[str, tf.Tensor]:
  pad = size - tf.shape(batch["inputs"])[0]
  return {key: tf.pad(value, [[0, pad], [0, 0]])
          for key, value in batch.items()}


def make_eval_iterator(config: ml_collections.ConfigDict,
                       *,
                       workdir: str | None = None,
                       data_dir: str | None = None,
                       batch_size: int | None = None,
                       seq_len: int | None = None,
                       num_batches: int | None = None,
                       process_index: int | None = None,
                       process_count: int | None = None) -> EvalIterable:
  """Returns the finite, deterministic, packed validation stream.

  Args:
    config: `config.data`.
    workdir: run workdir (the default data dir is `<workdir>/tfds`).
    data_dir: overrides `config.data_dir`.
    batch_size: global batch size; default `config.batch_size`.
    seq_len: row length; default `config.seq_len`.
    num_batches: if set, exactly this many batches: the stream is cut, or
      padded with empty batches (all zeros, `loss_mask` 0).
    process_index: default `jax.process_index()`.
    process_count: default `jax.process_count()`.

  Returns:
    An `EvalIterable` of `[batch_size // process_count, seq_len]` batches.

  Raises:
    ValueError: as `make_train_iterator`, or `num_batches < 0`.
  """
  _check_name(config)
  seq_len, local_batch, process_index, process_count = _resolve(
      config, batch_size, seq_len, process_index, process_count)
  if num_batches is not None and num_batches < 0:
    raise ValueError(f"num_batches must be >= 0, got {num_batches}.")
  documents, info = load_documents(
      config, "validation",
      data_dir=resolve_data_dir(config, workdir, data_dir),
      process_index=process_index, process_count=process_count)
  rows = packing.pack_documents(
      documents, seq_len,
      reset_at_document_boundaries=bool(
          _get(config, "reset_at_document_boundaries", True)),
      window_size=_window_size(config, info, "validation", seq_len))
  dataset = rows.batch(local_batch).map(lambda b: _pad_batch(b, local_batch))
  if num_batches is not None:
    empty = {
        key: tf.zeros([local_batch, seq_len], dtype)
        for key, dtype in packing.FEATURES.items()
    }
    dataset = dataset.concatenate(
        tf.data.Dataset.from_tensors(empty).repeat()).take(num_batches)
  dataset = dataset.prefetch(_PREFETCH_BATCHES).with_options(_options())
  return EvalIterable(dataset, vocab_size=vocab_size(config))


def make_iterator(config: ml_collections.ConfigDict,
                  *,
                  split: str = "train",
                  **kwargs) -> DataIterator | EvalIterable:
  """Dispatches to `make_train_iterator` or `make_eval_iterator`.

  Args:
    config: `config.data`.
    split: "train" (infinite, shuffled) or "validation" (finite).
    **kwargs: passed on.

  Returns:
    The iterator.

  Raises:
    ValueError: unknown split, or as the functions dispatched to.
  """
  if split == "train":
    return make_train_iterator(config, **kwargs)
  if split == "validation":
    return make_eval_iterator(config, **kwargs)
  raise ValueError(f"Unknown split {split!r}; use 'train' or 'validation'.")
