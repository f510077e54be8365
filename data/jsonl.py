"""Corpus source `jsonl`: JSON Lines files, one document per line.

Each line of the files matched by `config.data.files` (comma-separated
globs) is a JSON object whose `text_field` (default "text") is the
document, the layout of Dolma, RedPajama and most fine-tuning sets. Files
ending in `.gz` are read through gzip; files ending in `.zst` or `.zstd`
are decompressed once (streaming, with pyarrow's zstd codec) into
`<data_dir>/decompressed/`, so that tf.data reads them as plain lines.
Blank lines are ignored. Lines are read in a fixed order, several files at
a time (`records.interleave`), tokenized in the pipeline
(`data/records.py`), and named `<file>, line <n>` in errors.

Usage (config.data):

  name="jsonl", files="/corpus/*.jsonl.gz", text_field="text",
  tokenizer="bytes" or "hf:/models/m/tokenizer.json"
"""

import dataclasses
import hashlib
import json
import os
import tempfile

import pyarrow as pa
import tensorflow as tf

from data import records

_GZIP = (".gz",)
_ZSTD = (".zst", ".zstd")
_CHUNK_BYTES = 1 << 20


def decompressed(path: str, data_dir: str) -> str:
  """A zstd file's plain copy under `<data_dir>/decompressed` (made once,
  named after the file's path, size and modification time)."""
  stat = os.stat(path)
  key = hashlib.sha256(
      f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
  name = os.path.basename(path).rsplit(".", 1)[0]
  out = os.path.join(data_dir, "decompressed", f"{key[:16]}_{name}")
  if os.path.exists(out):
    return out
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with tempfile.NamedTemporaryFile("wb", dir=os.path.dirname(out),
                                   delete=False) as f:
    with pa.CompressedInputStream(pa.OSFile(path), "zstd") as source:
      while chunk := source.read(_CHUNK_BYTES):
        f.write(chunk)
  os.replace(f.name, out)
  return out


def _readable(path: str, data_dir: str) -> tuple[str, str]:
  """(the path tf.data reads, its compression type)."""
  if path.endswith(_GZIP):
    return path, "GZIP"
  if path.endswith(_ZSTD):
    return decompressed(path, data_dir), ""
  return path, ""


@dataclasses.dataclass(frozen=True)
class Settings(records.FilesSettings):
  """The `config.data` fields of the jsonl source."""

  UNIT = "line"

  def text(self, record: bytes) -> str:
    """The text field of one JSON line.

    Raises:
      records.Problem: not UTF-8, not JSON, not an object with a string
        `text_field`.
    """
    line = records.utf8(record)
    try:
      value = json.loads(line)
    except json.JSONDecodeError as e:
      raise records.Problem("malformed_json", f"malformed JSON ({e})") from e
    if not isinstance(value, dict):
      raise records.Problem(
          "missing_field", f"the line is a JSON {type(value).__name__}, not "
          f"an object with a text field {self.text_field!r}")
    if self.text_field not in value:
      raise records.Problem(
          "missing_field", f"no text field {self.text_field!r} (keys: "
          f"{sorted(value)[:8]})")
    text = value[self.text_field]
    if not isinstance(text, str):
      raise records.Problem(
          "missing_field", f"the field {self.text_field!r} is a JSON "
          f"{type(text).__name__}, not a string")
    return text

  def records(self, split: str, data_dir: str, process_index: int,
              process_count: int, skipped: records.Skipped
              ) -> tuple[tf.data.Dataset, bool, bool]:
    del process_index, process_count  # Sharded by record.
    paths, hold_out = self.split_files(split, skipped)
    good = []
    for path in paths:
      if os.path.getsize(path) == 0:
        records.bad("empty_file", path, "the file is empty",
                    self.skipped(skipped), once=True)
      else:
        good.append(path)
    if not good:
      raise ValueError(f"jsonl: every file of the {split} split is empty.")
    readable = [_readable(p, data_dir) for p in good]
    items = tf.data.Dataset.from_tensor_slices(
        ([r[0] for r in readable], good, [r[1] for r in readable]))

    def lines(read_path, path, compression):
      numbered = tf.data.TextLineDataset(
          read_path, compression_type=compression).enumerate(start=1)
      return numbered.filter(
          lambda i, line: tf.strings.length(tf.strings.strip(line)) > 0
      ).map(lambda i, line: records.record(path, i, line))

    return records.interleave(items, lines, len(good)), hold_out, False
