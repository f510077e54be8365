"""Text records tokenized in the input pipeline: what the corpus sources
(`data/jsonl.py`, `data/parquet.py`, `data/tfds_source.py`) share.

A source lists its records, in a fixed order, as a `tf.data.Dataset` of
dicts: `source` (a file path or a TFDS split's name), `index` (1-based line,
0-based row or record number there), `record` (the raw JSON line, or the
text) and `present` (False: the record has no text field). This module
turns them into documents:

1. Validation hold-out (sources without a named validation split): a record
   goes to `validation` when a hash of its raw bytes falls below
   `validation_percent` (of 100 buckets), else to `train`; the split of a
   record depends on nothing else (identical records share a split).
2. Process sharding: record `k` of the split goes to process
   `k % process_count` (`tfds`: its own even split), so processes see
   disjoint documents that together cover the split.
3. Tokenization, in batches of `ENCODE_BATCH` records (a Python function in
   the tf.data graph, parallel and deterministic): the text of each record
   (`Settings.text`) becomes its UTF-8 bytes (`tokenizer="bytes"`) or the
   ids of a released model's `tokenizer.json` (`tokenizer="hf:PATH"`, with
   the tokenizer's special-token template per document). One record = one
   document of int32 `tokens`.

Bad records (malformed JSON, no text field, a text that is not UTF-8) and
bad files (empty, a glob that matches nothing) raise `BadRecordError`
naming the file and line (row); with `skip_bad_records=True` they are
skipped, logged and counted per stream (`Skipped`; the training
iterator's `metrics()`, which the training loop reports as
`data/skipped_*`).

The tokenizing function is pure (the same records give the same tokens), so
the iterator's position is saved with `tf.train.Checkpoint` as for the
TFDS sources; the pipeline tells tf.data to ignore the function's Python
state (`EXTERNAL_STATE`).
"""

import collections
import contextlib
import dataclasses
import glob as glob_lib
import hashlib
import os
import re
import threading
from typing import Any, Callable

from absl import logging
import numpy as np
import tensorflow as tf

from data import corpus, text_files
from data import tokenizer as tokenizer_lib

ENCODE_BATCH = 64        # Records tokenized per call of the Python function.
HASH_BUCKETS = 100
_SAMPLE_RECORDS = 256    # Records read to estimate the mean document length.
_DEFAULT_MEAN_LENGTH = 512.0
_LOGGED_PER_KIND = 10    # Skipped records logged one by one, per kind.
# Options of a dataset that runs the tokenizing function: its Python state
# (the loaded tokenizer) is not part of the iterator's position.
EXTERNAL_STATE = tf.data.experimental.ExternalStatePolicy.IGNORE



class BadRecordError(ValueError):
  """A record or file of a corpus cannot be read; names the file and
  line (or row)."""


class Skipped:
  """The bad records and files one stream skipped, by kind
  (`malformed_json`, `missing_field`, `not_utf8`, `empty_file`,
  `bad_file`, `glob_matches_nothing`); thread-safe."""

  def __init__(self):
    self._counts = collections.Counter()
    self._places = set()
    self._lock = threading.Lock()

  def add(self, kind: str, where: str, message: str, count: int = 1,
          once: bool = False) -> None:
    """Counts (and logs) a skipped record (each time it is read: once per
    epoch); `once`: a file or glob (its place and message), counted once."""
    with self._lock:
      if once and (kind, where, message) in self._places:
        return
      self._places.add((kind, where, message))
      self._counts[kind] += count
      seen = self._counts[kind]
    if seen <= _LOGGED_PER_KIND:
      logging.warning("Skipping a bad record (%s): %s: %s.", kind, where,
                      message)
      if seen == _LOGGED_PER_KIND:
        logging.warning("Further skipped records (%s) are only counted.",
                        kind)

  def counts(self) -> dict[str, int]:
    with self._lock:
      return dict(self._counts)

  def metrics(self) -> dict[str, float]:
    """`data/skipped_<kind>` and `data/skipped_records` (their sum), for
    the training loop's metrics (read ahead included)."""
    counts = self.counts()
    out = {f"data/skipped_{k}": float(v) for k, v in sorted(counts.items())}
    out["data/skipped_records"] = float(sum(counts.values()))
    return out


def bad(kind: str, where: str, message: str, skipped: Skipped | None, *,
        count: int = 1, once: bool = False) -> None:
  """Raises `BadRecordError("<where>: <message>")`, or counts it.

  Args:
    kind: the kind of problem (see `Skipped`).
    where: the file and line (row), e.g. "/corpus/a.jsonl, line 7".
    message: what is wrong.
    skipped: where to count it (`config.data.skip_bad_records`); None:
      raise.
    count: records this stands for (a skipped file's).
    once: see `Skipped.add`.
  """
  if skipped is None:
    raise BadRecordError(
        f"{where}: {message} (set config.data.skip_bad_records=True to "
        "skip bad records).")
  skipped.add(kind, where, message, count=count, once=once)


# A bad record in the pipeline's error: `_MARK`, the key of its message in
# `_messages` (kept as raised: the graph's error escapes quotes), `_MARK`,
# the message (for readers of the documents without `named_bad_records`).
_MARK = "<<bad record>>"
_messages = {}
_lock = threading.Lock()


@contextlib.contextmanager
def named_bad_records():
  """Re-raises a bad record found inside a tf.data pipeline (which raises
  a `tf.errors.OpError`) as `BadRecordError`."""
  try:
    yield
  except tf.errors.OpError as e:
    match = re.search(f"{_MARK}([0-9]+){_MARK}", str(e.message))
    if not match:
      raise
    with _lock:
      message = _messages[int(match.group(1))]
    raise BadRecordError(message) from None


class Problem(Exception):
  """What is wrong with one record: a kind (see `Skipped`) and a message
  (raised by `Settings.text`; the tokenizing function names the place)."""

  def __init__(self, kind: str, message: str):
    super().__init__(message)
    self.kind = kind


def utf8(data: bytes) -> str:
  """`data` as text.

  Raises:
    Problem: not UTF-8.
  """
  text = tokenizer_lib.decode_utf8(data)
  if text is None:
    raise Problem("not_utf8", "the text is not valid UTF-8")
  return text


@dataclasses.dataclass(frozen=True)
class DocumentsInfo:
  """What the pipeline needs to know of a split besides its documents."""
  mean_length: float   # Mean tokens per document (an estimate).
  skipped: Skipped     # What the stream skipped so far.


@dataclasses.dataclass(frozen=True)
class Settings(corpus.TokenizedSettings):
  """The `config.data` fields every record source has
  (`corpus.TokenizedSettings`'s and these; the one home of their
  defaults); a source subclasses it with its own."""
  text_field: str = "text"        # The record's field holding the text.
  # Skip (and count) bad records and files instead of stopping.
  skip_bad_records: bool = False

  FEATURES = ("tokens",)
  # The name of a record's place in its source: "line", "row", "record".
  UNIT = "record"

  def __post_init__(self):
    super().__post_init__()
    if not self.text_field:
      raise ValueError("config.data.text_field must name the field (column) "
                       "of the text, e.g. 'text'.")

  def mean_length(self, info: DocumentsInfo, split: str) -> float:
    del split
    return info.mean_length

  @property
  def tokenizes_in_pipeline(self) -> bool:
    return True

  def resolve(self, data_dir: str) -> "Settings":
    """These settings with the tokenizer's checksum filled in (hf; see
    `text_files.check_hf`), or the BPE's path and checksum (built from the
    training split if `tokenizer_path` is unset and it does not exist yet;
    see `text_files.check_bpe`)."""
    if self.hf_path:
      return dataclasses.replace(self, tokenizer_sha256=text_files.check_hf(
          self.hf_path, self.tokenizer_sha256))
    if not self.is_bpe:
      return self
    path = os.path.abspath(os.path.expanduser(
        self.tokenizer_path or self.default_tokenizer_path(data_dir)))
    if not self.tokenizer_path and not os.path.exists(path):
      texts = self._training_texts(data_dir, tokenizer_lib.SAMPLE_BYTES)
      logging.info("Training a %d-token byte-level BPE on the first %d "
                   "training records of this %s corpus (%d bytes).",
                   self.bpe_vocab_size, len(texts), type(self).__module__,
                   sum(len(t.encode()) for t in texts))
      tokenizer_lib.write(tokenizer_lib.train(texts, self.bpe_vocab_size),
                          path)
    digest = text_files.check_bpe(path, self.tokenizer_sha256,
                                  self.bpe_vocab_size)
    return dataclasses.replace(self, tokenizer_path=path,
                               tokenizer_sha256=digest)

  def default_tokenizer_path(self, data_dir: str) -> str:
    """Where this corpus's BPE of this size is built: named after a hash
    of the settings that choose the records and their texts."""
    fields = {k: v for k, v in dataclasses.asdict(self).items()
              if not k.startswith(("tokenizer", "bpe_", "skip_"))}
    key = hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()
    return os.path.join(
        data_dir, "tokenizers",
        f"{type(self).__module__.split('.')[-1]}_{key[:16]}_bpe"
        f"{self.bpe_vocab_size}", "tokenizer.json")

  def _training_texts(self, data_dir: str, max_bytes: int) -> list[str]:
    """The training split's texts, in order, up to `max_bytes` (bad
    records left out)."""
    texts, total = [], 0
    records = self._split_records("train", data_dir, 0, 1, Skipped())
    for r in records.as_numpy_iterator():
      if total >= max_bytes:
        break
      try:
        text = self.text(r["record"]) if r["present"] else ""
      except Problem:
        continue
      if text:
        texts.append(text)
        total += len(text.encode("utf-8", "replace"))
    return texts

  def text(self, record: bytes) -> str:
    """The text of a raw record.

    Raises:
      Problem: a bad record.
    """
    return utf8(record)

  def skipped(self, counter: Skipped) -> Skipped | None:
    """Where bad records are counted: `counter`, or None (raise) unless
    `skip_bad_records`."""
    return counter if self.skip_bad_records else None

  def records(self, split: str, data_dir: str, process_index: int,
              process_count: int, skipped: Skipped
              ) -> tuple[tf.data.Dataset, bool, bool]:
    """The split's records, in a fixed order (see the module docstring);
    bad files are raised or counted in `skipped` (see `skipped`).

    Returns:
      (records, hold_out, sharded): the records; whether the validation
      hold-out applies (the source has no validation split of its own);
      whether they are already this process's share only.
    """
    raise NotImplementedError

  def _split_records(self, split: str, data_dir: str, process_index: int,
                     process_count: int, skipped: Skipped
                     ) -> tf.data.Dataset:
    """This process's records of a split: the hold-out and the sharding."""
    records, hold_out, sharded = self.records(split, data_dir, process_index,
                                              process_count, skipped)
    if hold_out:
      validation = tf.constant(split == "validation")
      percent = self.validation_percent
      records = records.filter(lambda r: tf.equal(
          tf.strings.to_hash_bucket_fast(r["record"], HASH_BUCKETS) < percent,
          validation))
    if not sharded:
      records = records.shard(process_count, process_index)
    return records

  def documents(self, split: str, *, data_dir: str, process_index: int,
                process_count: int
                ) -> tuple[tf.data.Dataset, DocumentsInfo]:
    """This process's documents of a split, in order, and their info.

    Returns:
      (documents, info): dicts with int32 `tokens` [L]; the mean length.

    Raises:
      BadRecordError: a bad file (without `skip_bad_records`); bad records
        are raised when the iterator reaches them.
      ValueError: no files, or no training document among the first
        records (those read to estimate the mean document length).
    """
    skipped = Skipped()
    records = self._split_records(split, data_dir, process_index,
                                  process_count, skipped)
    documents = encode(records, self, skipped)
    sample = [len(d["tokens"]) for d in encode(
        records.take(_SAMPLE_RECORDS), self, None).as_numpy_iterator()]
    if not sample and split == "train":
      raise ValueError(
          f"The training split of this {type(self).__module__} corpus has "
          f"no document among its first {_SAMPLE_RECORDS} records for "
          f"process {process_index} of {process_count}: check "
          "config.data.text_field and the files (and "
          "config.data.validation_percent).")
    if not sample:
      logging.warning(
          "The validation split of this %s corpus has no document among "
          "its first %d records for process %d of %d (a small corpus? "
          "config.data.validation_percent, validation_files).",
          type(self).__module__, _SAMPLE_RECORDS, process_index,
          process_count)
    mean = float(np.mean(sample)) if sample else _DEFAULT_MEAN_LENGTH
    return documents, DocumentsInfo(mean_length=max(mean, 1.0),
                                    skipped=skipped)


class _Encoder:
  """The tokenizing function: a batch of records -> flat ids and lengths."""

  def __init__(self, settings: Settings, skipped: Skipped | None):
    self.settings = settings
    self.count = skipped is not None
    self.skipped = settings.skipped(skipped) if self.count else None
    self.tokenizer = (
        tokenizer_lib.load_hf(settings.hf_path) if settings.hf_path else
        tokenizer_lib.load(settings.tokenizer_path) if settings.is_bpe else
        None)

  def _text(self, record: bytes, present: bool) -> str:
    if not present:
      raise Problem("missing_field",
                    f"no text field {self.settings.text_field!r}")
    text = self.settings.text(record)
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as e:   # A lone surrogate escaped in JSON.
      raise Problem("not_utf8", f"the text is not valid UTF-8 ({e})") from e
    return text

  def texts(self, sources, indices, records, present) -> list[str]:
    out = []
    for source, index, data, has_text in zip(
        sources, indices, records, present, strict=True):
      try:
        out.append(self._text(bytes(data), bool(has_text)))
      except Problem as e:
        if self.count:
          where = (f"{source.decode('utf-8', 'replace')}, "
                   f"{self.settings.UNIT} {int(index)}")
          bad(e.kind, where, str(e), self.skipped)
    return out

  def __call__(self, sources, indices, records, present):
    """(flat ids, lengths, error): a bad record is returned as the error
    message (raised by the graph, without a Python traceback to log)."""
    try:
      texts = self.texts(sources.numpy(), indices.numpy(), records.numpy(),
                         present.numpy())
    except BadRecordError as e:
      empty = np.zeros([0], np.int32)
      with _lock:
        key = len(_messages)
        _messages[key] = str(e)
      return empty, empty, f"{_MARK}{key}{_MARK} {e}"
    if self.tokenizer is None:
      ids = [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
    else:
      ids = tokenizer_lib.encode_documents(self.tokenizer, texts)
    lengths = np.asarray([len(i) for i in ids], np.int32)
    flat = (np.concatenate([np.asarray(i, np.int32) for i in ids])
            if ids else np.zeros([0], np.int32))
    return flat, lengths, ""


def encode(records: tf.data.Dataset, settings: Settings,
           skipped: Skipped | None) -> tf.data.Dataset:
  """Tokenizes records: one document (`tokens` int32 [L]) per good record.

  Args:
    records: dicts `source`, `index`, `record`, `present` (see the module
      docstring).
    settings: the source's settings (tokenizer, bad-record handling).
    skipped: the stream's count of bad records (raised instead without
      `skip_bad_records`); None for a look-ahead that neither raises nor
      counts (bad records dropped).
  """
  encoder = _Encoder(settings, skipped)

  def tokenize(batch):
    flat, lengths, error = tf.py_function(
        encoder, [batch["source"], batch["index"], batch["record"],
                  batch["present"]], [tf.int32, tf.int32, tf.string])
    with tf.control_dependencies([tf.debugging.Assert(
        tf.equal(error, ""), [error], name="bad_record")]):
      flat = tf.identity(flat)
    tokens = tf.RaggedTensor.from_row_lengths(
        tf.ensure_shape(flat, [None]), tf.ensure_shape(lengths, [None]))
    return {"tokens": tokens}

  return records.batch(ENCODE_BATCH).map(
      tokenize, num_parallel_calls=tf.data.AUTOTUNE,
      deterministic=True).unbatch()


def record(source: Any, index: Any, data: Any, present: Any = True
           ) -> dict[str, tf.Tensor]:
  """One record of a source's dataset (see the module docstring)."""
  return {"source": tf.convert_to_tensor(source, tf.string),
          "index": tf.cast(index, tf.int64),
          "record": tf.convert_to_tensor(data, tf.string),
          "present": tf.convert_to_tensor(present, tf.bool)}


def interleave(items: tf.data.Dataset, read: Callable[..., tf.data.Dataset],
               num_items: int) -> tf.data.Dataset:
  """Reads several files (or row groups) at once, in a fixed order."""
  return items.interleave(read, cycle_length=max(1, min(num_items, 8)),
                          block_length=16,
                          num_parallel_calls=tf.data.AUTOTUNE,
                          deterministic=True)


def match_files(globs: str, key: str, skipped: Skipped | None
                ) -> list[str]:
  """The files of a comma-separated list of globs (`**` recurses).

  Args:
    globs: e.g. "/corpus/*.jsonl,/more/**/*.jsonl.gz".
    key: the config key, for messages ("files").
    skipped: a glob that matches nothing is counted there when others
      match; None: raised.

  Returns:
    The matching files: each glob's sorted, in the order of the globs,
    without repeats.

  Raises:
    ValueError: no glob, or no file at all.
    BadRecordError: a glob matches no file (without `skip`).
  """
  patterns = [g.strip() for g in globs.split(",") if g.strip()]
  if not patterns:
    raise ValueError(f"config.data.{key} is empty: give the corpus's files, "
                     f"e.g. --config.data.{key}='/corpus/*.jsonl'.")
  matches = {}
  for pattern in patterns:
    pattern = os.path.abspath(os.path.expanduser(pattern))
    matches[pattern] = sorted(p for p in glob_lib.glob(pattern,
                                                       recursive=True)
                              if os.path.isfile(p))
  if not any(matches.values()):   # Skipping cannot help: nothing to read.
    raise ValueError(f"config.data.{key}={globs!r} matches no file: check "
                     f"the path{'s' if len(patterns) > 1 else ''}.")
  out, seen = [], set()
  for pattern, paths in matches.items():
    if not paths:
      bad("glob_matches_nothing", f"config.data.{key}",
          f"the glob {pattern!r} matches no file", skipped, once=True)
    out += [p for p in paths if p not in seen]
    seen.update(paths)
  return out


@dataclasses.dataclass(frozen=True)
class FilesSettings(Settings):
  """The fields of the file sources (`jsonl`, `parquet`)."""
  # Comma-separated globs of the corpus's files ("**" recurses).
  files: str = ""
  # Comma-separated globs of a validation split's files; "" = hold out
  # `validation_percent` of the records of `files` by hash.
  validation_files: str = ""

  def split_files(self, split: str, skipped: Skipped
                  ) -> tuple[list[str], bool]:
    """The files of a split and whether the hash hold-out applies.

    Raises:
      ValueError, BadRecordError: as `match_files`.
    """
    counter = self.skipped(skipped)
    if self.validation_files and split == "validation":
      return match_files(self.validation_files, "validation_files",
                         counter), False
    return (match_files(self.files, "files", counter),
            not self.validation_files)


@dataclasses.dataclass(frozen=True)
class _Files(Settings):
  """A text_files corpus tokenized with "hf:PATH" in the pipeline; a file
  that is not UTF-8 is left out (logged), as from the BPE dataset."""
  UNIT = "file"


_BYTES = [bytes([b]) for b in range(256)]


def tokenize_files(documents: tf.data.Dataset, tokenizer: str
                   ) -> tf.data.Dataset:
  """The `text_files` byte documents (`tokens` uint8, `path`) tokenized
  with a released model's tokenizer ("hf:PATH"): `tokens` int32 [L]."""
  table = tf.constant(_BYTES)
  files = documents.map(lambda d: record(d["path"], 0, tf.strings.reduce_join(
      tf.gather(table, tf.cast(d["tokens"], tf.int32)))))
  return encode(files, _Files(tokenizer=tokenizer, skip_bad_records=True),
                Skipped())
