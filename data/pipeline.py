"""Input pipeline: `config.data` -> iterator of packed numpy batches.

Interface used by the training code:

  from data import pipeline
  config.data = pipeline.default_config()          # in the config file
  vocab = pipeline.vocab_size(config.data)         # 256 for text bytes
  train_it = pipeline.make_train_iterator(config.data, workdir=workdir)
  batch = next(train_it)
  train_it.save(ckpt_dir)
  train_it.restore(ckpt_dir)   # the next batch is exactly the one after save
  for batch in pipeline.make_eval_iterator(config.data, workdir=workdir):
    ...                        # validation split, finite, deterministic

Every batch is a dict of numpy arrays of shape `[batch, seq_len]` where `batch`
is the per-process batch (`config.data.batch_size // jax.process_count()`):
int32 `inputs`, `targets`, `segment_ids` (1..n per document piece in a row,
0 on padding), `positions` (restart at 0 per segment) and float32
`loss_mask` (0 on padding and on unpredictable targets). See
`data/packing.py` for the exact row layout.

`config.data` is one flat section: the fields of `DataConfig` (dataset
`name`, `data_dir`, `seq_len`, global `batch_size`, shuffle `seed`,
`reset_at_document_boundaries`, the buffers) and those of every dataset's
`Settings` (`delayed_copy`, `text_files`, and `records.Settings` for
`jsonl`, `parquet`, `tfds`; `dataset_keys` gives one dataset's keys).
`DataConfig.from_config` reads it once, validated; a new dataset is a module
with a `Settings` class (and its `resolve(data_dir)`, which builds and
identifies what the dataset needs besides TFDS, such as a tokenizer) and an
entry in `DATASETS`.
Datasets are built on first use, offline, under `data_dir` (None:
`<workdir>/tfds`) (the corpus sources: read and tokenized in the pipeline).

Training stream: the process's shard of the train split (TFDS even split by
`jax.process_index()/process_count()`; the corpus sources: every
`process_count`-th record), shuffled with `seed` (a new order each
epoch, the same sequence for the same seed), repeated forever, cut into
row-sized pieces that are shuffled again (`piece_shuffle_buffer`, so that
consecutive rows come from different documents), packed, batched and
prefetched. Everything is a tf.data graph (no Python generators; only pure
functions, the corpus sources' tokenizer), so the iterator's position,
buffers included, is saved with `tf.train.Checkpoint`.
The eval stream is the process's shard of the validation split, in file
order, packed and batched; its last batch is padded with empty rows
(`loss_mask` 0), and `num_batches` pads or cuts it to a fixed number of
batches so that all processes run the same number of eval steps.
"""

import dataclasses
import os
from typing import Any, Iterator, Mapping, Optional

from absl import logging
import ml_collections
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from data import (
  delayed_copy,
  jsonl,
  packing,
  parquet,
  records,
  sections,
  text_files,
  tfds_source,
)
from data import tokenizer as tokenizer_lib

# The datasets by `config.data.name`: each module's `Settings` dataclass
# holds its `config.data` fields, defaults and validation, its vocabulary,
# features, mean document length and TFDS builder config.
DATASETS = {"delayed_copy": delayed_copy.Settings,
            "text_files": text_files.Settings,
            "jsonl": jsonl.Settings,
            "parquet": parquet.Settings,
            "tfds": tfds_source.Settings}
_PREFETCH_BATCHES = 2
_MAX_WINDOW_DOCS = 1 << 16


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """`config.data`, typed: the pipeline's fields and the named dataset's
  `Settings` (read from the same flat section)."""
  name: str = "delayed_copy"      # Dataset: a key of DATASETS.
  # TFDS build/cache dir; None = <workdir>/tfds.
  data_dir: Optional[str] = None
  seq_len: int = 1024             # Tokens per packed row.
  batch_size: int = 8             # Rows per step, global (all processes).
  seed: int = 0                   # Shuffle seed of the training stream.
  # Per-document segment ids/resets (True) or one segment per row (False).
  reset_at_document_boundaries: bool = True
  shuffle_buffer: int = 1024      # Documents in the shuffle buffer.
  # Training stream: documents are cut into row-sized pieces and the pieces
  # shuffled again in a buffer of this many, so that consecutive rows come
  # from different documents (0 = pieces in document order).
  piece_shuffle_buffer: int = 1024
  pack_window_rows: int = 64      # Rows' worth of documents packed together.
  # The named dataset's settings (not a config key; see `from_config`).
  dataset: Any = dataclasses.field(default=None, compare=False,
                                   metadata=sections.NOT_A_KEY)

  def __post_init__(self):
    if self.seq_len < 2:
      raise ValueError(f"config.data.seq_len must be >= 2 (an input and a "
                       f"target), got {self.seq_len}.")
    if self.batch_size < 1:
      raise ValueError(f"config.data.batch_size must be >= 1, got "
                       f"{self.batch_size}.")
    if self.name not in DATASETS:
      raise ValueError(f"Unknown dataset name {self.name!r}; known: "
                       f"{tuple(DATASETS)}.")
    for name in ("shuffle_buffer", "piece_shuffle_buffer"):
      if getattr(self, name) < 0:
        raise ValueError(f"config.data.{name} must be >= 0, got "
                         f"{getattr(self, name)}.")
    if self.dataset is None:
      object.__setattr__(self, "dataset", DATASETS[self.name]())

  @classmethod
  def from_config(cls, values: Any) -> "DataConfig":
    """Reads `config.data` (ConfigDict, mapping or DataConfig).

    Missing keys and None values take the defaults; the fields of datasets
    other than the named one are allowed and ignored.

    Raises:
      ValueError: an unknown key or dataset name, or a bad value.
    """
    if isinstance(values, cls):
      return values
    sections.check_keys("data", values, set(keys()))
    given = {k: values[k] for k in values.keys() if values[k] is not None}
    name = given.get("name", cls.name)
    if name not in DATASETS:
      raise ValueError(f"Unknown dataset name {name!r}; known: "
                       f"{tuple(DATASETS)}.")
    settings = DATASETS[name]
    dataset = settings(**{k: given[k] for k in sections.field_names(settings)
                          if k in given})
    return cls(dataset=dataset, **{k: given[k] for k in
                                   sections.field_names(cls) if k in given})

  def vocab_size(self) -> int:
    """The number of token ids of the named dataset."""
    return self.dataset.data_vocab_size()

  def resolve(self, data_dir: str) -> "DataConfig":
    """This config with the dataset's files (the BPE tokenizer) built and
    identified (see `text_files.Settings.resolve`)."""
    return dataclasses.replace(self, dataset=self.dataset.resolve(data_dir))


def keys() -> list[str]:
  """Every key of `config.data`: the pipeline's, then each dataset's."""
  out = list(sections.field_names(DataConfig))
  for settings in DATASETS.values():
    out += [k for k in sections.field_names(settings) if k not in out]
  return out


def dataset_keys(name: str) -> set[str]:
  """The keys of `config.data` a run on the dataset `name` reads (the
  pipeline's and the dataset's own); every key for an unknown name."""
  if name not in DATASETS:
    return set(keys())
  return set(sections.field_names(DataConfig)) | set(
      sections.field_names(DATASETS[name]))


def default_config() -> ml_collections.ConfigDict:
  """Returns the default `config.data` (every key of every dataset)."""
  config = sections.config_dict(DataConfig)
  for settings in DATASETS.values():
    config.update(sections.config_dict(settings))
  return config


def vocab_size(config: Any) -> int:
  """Returns the vocabulary size of the configured dataset.

  Args:
    config: `config.data`.

  Returns:
    `config.vocab_size` for delayed_copy, 256 (bytes) for text_files.

  Raises:
    ValueError: unknown dataset name.
  """
  return DataConfig.from_config(config).vocab_size()


def builder_config(config: Any) -> tfds.core.BuilderConfig:
  """Returns the TFDS builder config that `config.data` describes.

  Raises:
    ValueError: unknown dataset name, bad values, or an empty glob.
  """
  return DataConfig.from_config(config).dataset.builder_config()


def resolve_data_dir(config: Any, workdir: str | None = None,
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
  path = data_dir or DataConfig.from_config(config).data_dir or (
      os.path.join(workdir, "tfds") if workdir else None)
  if not path:
    raise ValueError("No data dir: set config.data.data_dir or pass workdir.")
  return os.path.abspath(os.path.expanduser(path))


def resolve_config(config: ml_collections.ConfigDict, workdir: str,
                   recorded: Mapping[str, Any] | None = None
                   ) -> ml_collections.ConfigDict:
  """`config` (the whole run config) with the data's tokenizer recorded.

  For BPE `text_files` runs, builds the tokenizer if needed (once per data
  dir) and sets `config.data.tokenizer_path` and `tokenizer_sha256`, so that
  the run's `config.json` names the exact tokenizer. When the path is unset,
  the one `recorded` by a run being resumed is used ("hf:PATH": the SHA-256).

  Args:
    config: the run config; not modified.
    workdir: the run directory.
    recorded: the config a resumed run recorded (its `config.json`), or
      None.

  Returns:
    A copy of `config` with the two keys filled in (unchanged otherwise).

  Raises:
    text_files.TokenizerChangedError: the tokenizer file's checksum differs
      from the one given.
  """
  cfg = DataConfig.from_config(config.data)
  hf = bool(cfg.dataset.hf_path)
  if not (hf or cfg.dataset.is_bpe):
    return config
  config = ml_collections.ConfigDict(config.to_dict())
  if hf:
    config.data.tokenizer_sha256 = cfg.resolve(
        resolve_data_dir(config.data, workdir)).dataset.tokenizer_sha256
    return config
  if not config.data.get("tokenizer_path"):
    config.data.tokenizer_path = (
        (recorded or {}).get("data", {}).get("tokenizer_path") or "")
  settings = DataConfig.from_config(config.data).resolve(
      resolve_data_dir(config.data, workdir)).dataset
  config.data.tokenizer_path = settings.tokenizer_path
  config.data.tokenizer_sha256 = settings.tokenizer_sha256
  return config


def token_bytes(config: Any, data_dir: str) -> np.ndarray:
  """UTF-8 bytes per token id `[vocab]` (1 for byte-level data, 0 for ids
  past the tokenizer's), for losses per byte. Delayed copy: all ones.

  Raises:
    As `text_files.Settings.resolve`.
  """
  cfg = DataConfig.from_config(config).resolve(data_dir)
  if cfg.dataset.hf_path:
    return tokenizer_lib.token_byte_lengths(
        tokenizer_lib.load_hf(cfg.dataset.hf_path))
  lengths = np.ones(cfg.vocab_size(), np.float32)
  if cfg.dataset.is_bpe:
    pieces = tokenizer_lib.token_bytes(
        tokenizer_lib.load(cfg.dataset.tokenizer_path))
    lengths[:] = 0
    lengths[:len(pieces)] = [len(p) for p in pieces]
  return lengths


def hide_gpus_from_tf() -> None:
  """Keeps TF (the input pipeline) off the accelerators, whose memory is
  JAX's. The only place that does; called before any TF dataset is built."""
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


def load_documents(config: Any, split: str, *, data_dir: str,
                   process_index: int = 0, process_count: int = 1
                   ) -> tuple[tf.data.Dataset, tfds.core.DatasetInfo]:
  """Builds the dataset if needed and loads this process's documents.

  Args:
    config: `config.data`.
    split: "train" or "validation".
    data_dir: TFDS data dir.
    process_index: this process's shard.
    process_count: number of shards.

  Returns:
    (documents, info): a dataset of dicts with the dataset's `FEATURES`
    (`tokens` int [L] and, for delayed_copy, `loss_mask` bool [L]), in file
    order; the TFDS info (the corpus sources: `records.DocumentsInfo`).

  Raises:
    ValueError: unknown dataset name or split, bad builder config values.
    records.BadRecordError: a bad file of a corpus source.
  """
  if split not in ("train", "validation"):
    raise ValueError(f"Unknown split {split!r}; use 'train' or 'validation'.")
  hide_gpus_from_tf()
  cfg = DataConfig.from_config(config).resolve(data_dir)
  if isinstance(cfg.dataset, records.Settings):
    return cfg.dataset.documents(split, data_dir=data_dir,
                                 process_index=process_index,
                                 process_count=process_count)
  sub_split = tfds.even_splits(split, n=process_count)[process_index]
  tfds.disable_progress_bar()
  documents, info = tfds.load(
      cfg.name,
      split=sub_split,
      data_dir=data_dir,
      download=True,
      shuffle_files=False,
      with_info=True,
      builder_kwargs={"config": cfg.dataset.builder_config(),
                      "file_format": "tfrecord"},
      # No in-memory cache: it would be written into iterator checkpoints.
      read_config=tfds.ReadConfig(try_autocache=False),
  )
  if cfg.dataset.hf_path:   # text_files, "hf:PATH".
    return records.tokenize_files(documents, cfg.dataset.tokenizer), info
  features = cfg.dataset.FEATURES
  return documents.map(lambda d: {k: d[k] for k in features}), info


def _options(cfg: DataConfig) -> tf.data.Options:
  options = tf.data.Options()
  options.deterministic = True
  if cfg.dataset.tokenizes_in_pipeline:
    options.experimental_external_state_policy = records.EXTERNAL_STATE
  return options


def _numpy(batch: dict[str, tf.Tensor]) -> dict[str, np.ndarray]:
  return {key: value.numpy() for key, value in batch.items()}


class DataIterator:
  """Iterator of numpy batches whose position can be saved and restored."""

  def __init__(self, dataset: tf.data.Dataset, *, vocab_size: int,
               process_index: int, process_count: int,
               skipped: records.Skipped | None = None):
    self.dataset = dataset
    self.vocab_size = vocab_size
    self.process_index = process_index
    self.process_count = process_count
    self.skipped = skipped
    self._iterator = iter(dataset)

  def __iter__(self) -> "DataIterator":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    with records.named_bad_records():
      return _numpy(next(self._iterator))

  def metrics(self) -> dict[str, float]:
    """`records.Skipped.metrics` (with `config.data.skip_bad_records`)."""
    return self.skipped.metrics() if self.skipped else {}

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


class EvalIterable:
  """Re-iterable finite eval stream; each `iter()` starts from the start."""

  def __init__(self, dataset: tf.data.Dataset, *, vocab_size: int):
    self.dataset = dataset
    self.vocab_size = vocab_size

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    with records.named_bad_records():
      for batch in self.dataset:
        yield _numpy(batch)


@dataclasses.dataclass(frozen=True)
class _Stream:
  """One process's packed rows of a split, before batching."""
  cfg: DataConfig
  rows: tf.data.Dataset
  seq_len: int
  local_batch: int
  process_index: int
  process_count: int
  skipped: records.Skipped | None   # The corpus sources' skipped records.


def _stream(config: Any, split: str, *, shuffle_seed: int | None = None,
            workdir: str | None = None, data_dir: str | None = None,
            batch_size: int | None = None, seq_len: int | None = None,
            process_index: int | None = None,
            process_count: int | None = None) -> _Stream:
  """Loads, (for training) shuffles and repeats, and packs one split.

  Args:
    config: `config.data`.
    split: "train" or "validation".
    shuffle_seed: shuffle (a new order each epoch) and repeat forever with
      this seed; None = file order, once.
    workdir: run workdir (the default data dir is `<workdir>/tfds`).
    data_dir: overrides `config.data_dir`.
    batch_size: global batch size; default `config.batch_size`.
    seq_len: row length; default `config.seq_len`.
    process_index: default `jax.process_index()`.
    process_count: default `jax.process_count()`.
  """
  cfg = DataConfig.from_config(config)
  seq_len = int(cfg.seq_len if seq_len is None else seq_len)
  batch_size = int(cfg.batch_size if batch_size is None else batch_size)
  if seq_len < 2:
    raise ValueError(f"seq_len must be >= 2, got {seq_len}.")
  process_index, process_count = _process(process_index, process_count)
  if batch_size < 1 or batch_size % process_count:
    raise ValueError(f"The global batch_size {batch_size} must be a positive "
                     f"multiple of the process count {process_count}.")
  documents, info = load_documents(
      cfg, split, data_dir=resolve_data_dir(cfg, workdir, data_dir),
      process_index=process_index, process_count=process_count)
  mean_length = cfg.dataset.mean_length(info, split)
  if shuffle_seed is not None:
    if cfg.shuffle_buffer > 0:
      documents = documents.shuffle(cfg.shuffle_buffer, seed=shuffle_seed,
                                    reshuffle_each_iteration=True)
    documents = documents.repeat()
    if cfg.piece_shuffle_buffer > 0:
      # Pieces of long documents go to random places in the stream.
      documents = packing.split_documents(documents, seq_len).shuffle(
          cfg.piece_shuffle_buffer, seed=shuffle_seed + 1)
      mean_length = min(mean_length, seq_len + 1.0)
  # Documents (pieces) per packing window: about `pack_window_rows` rows.
  window = cfg.pack_window_rows * seq_len / max(mean_length, 1.0)
  rows = packing.pack_documents(
      documents, seq_len,
      reset_at_document_boundaries=bool(cfg.reset_at_document_boundaries),
      window_size=int(np.clip(int(round(window)), 1, _MAX_WINDOW_DOCS)),
      num_parallel_calls=(tf.data.AUTOTUNE if shuffle_seed is not None
                          else None))
  return _Stream(cfg, rows, seq_len, batch_size // process_count,
                 process_index, process_count,
                 getattr(info, "skipped", None))


def make_train_iterator(config: Any, *, seed: int | None = None,
                        **kwargs) -> DataIterator:
  """Returns the infinite, shuffled, packed training stream of this process.

  Args:
    config: `config.data`.
    seed: shuffle seed; default `config.seed`.
    **kwargs: `workdir`, `data_dir`, `batch_size`, `seq_len`,
      `process_index`, `process_count` (see `_stream`).

  Returns:
    A `DataIterator` of `[batch_size // process_count, seq_len]` batches.

  Raises:
    ValueError: unknown dataset, empty glob, `seq_len < 2`, a batch size that
      the process count does not divide, or no data dir.
  """
  cfg = DataConfig.from_config(config)
  s = _stream(cfg, "train", shuffle_seed=int(cfg.seed if seed is None
                                             else seed), **kwargs)
  dataset = s.rows.batch(s.local_batch, drop_remainder=True).prefetch(
      _PREFETCH_BATCHES).with_options(_options(cfg))
  logging.info("Train data: %s, seq_len %d, %d rows per process batch, "
               "process %d of %d.", cfg.name, s.seq_len, s.local_batch,
               s.process_index, s.process_count)
  return DataIterator(
      dataset, vocab_size=cfg.vocab_size(), process_index=s.process_index,
      process_count=s.process_count,
      skipped=s.skipped if cfg.dataset.skip_bad_records else None)


def _pad_batch(batch: dict[str, tf.Tensor], size: int
               ) -> dict[str, tf.Tensor]:
  pad = size - tf.shape(batch["inputs"])[0]
  return {key: tf.pad(value, [[0, pad], [0, 0]])
          for key, value in batch.items()}


def _cap_eval_batches(dataset: tf.data.Dataset, num_batches: int,
                      process_count: int) -> int:
  """`num_batches`, or fewer when the split has fewer (one process)."""
  available = int(dataset.take(num_batches).reduce(
      np.int64(0), lambda count, _: count + 1))
  if available >= num_batches:
    return num_batches
  if process_count > 1:
    logging.warning(
        "config.eval.num_batches is %d but this process's validation shard "
        "has %d batches: padding with empty batches so that every process "
        "runs the same number of eval steps.", num_batches, available)
    return num_batches
  logging.warning("config.eval.num_batches is %d but the validation split "
                  "has only %d batches: evaluating those.", num_batches,
                  available)
  return available


def make_eval_iterator(config: Any, *, num_batches: int | None = None,
                       **kwargs) -> EvalIterable:
  """Returns the finite, deterministic, packed validation stream.

  Args:
    config: `config.data`.
    num_batches: if set, at most this many batches. When the validation
      split has fewer, a one-process run evaluates the batches that exist
      (and says so once); with several processes the shorter streams are
      padded with empty batches (all zeros, `loss_mask` 0), so that every
      process runs the same number of eval steps.
    **kwargs: as for `make_train_iterator`.

  Returns:
    An `EvalIterable` of `[batch_size // process_count, seq_len]` batches.

  Raises:
    ValueError: as `make_train_iterator`, or `num_batches < 0`.
  """
  if num_batches is not None and num_batches < 0:
    raise ValueError(f"num_batches must be >= 0, got {num_batches}.")
  s = _stream(config, "validation", **kwargs)
  size = s.local_batch
  dataset = s.rows.batch(size).map(lambda b: _pad_batch(b, size))
  if num_batches is not None:
    num_batches = _cap_eval_batches(dataset, num_batches, s.process_count)
    empty = {key: tf.zeros([size, s.seq_len], dtype)
             for key, dtype in packing.FEATURES.items()}
    dataset = dataset.concatenate(
        tf.data.Dataset.from_tensors(empty).repeat()).take(num_batches)
  dataset = dataset.prefetch(_PREFETCH_BATCHES).with_options(
      _options(s.cfg))
  return EvalIterable(dataset, vocab_size=s.cfg.vocab_size())
