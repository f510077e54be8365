"""Corpus source `parquet`: Parquet files, one document per row.

The column `text_field` (default "text", a string or binary column) of the
files matched by `config.data.files` (comma-separated globs), the layout of
FineWeb and of Hugging Face dataset exports. Files are read with pyarrow
one row group at a time (never a whole file), several files at once
(`records.interleave`), in a fixed order; rows are tokenized in the
pipeline (`data/records.py`) and named `<file>, row <n>` (0-based, in the
file) in errors. A null text is a record without its field; a file without
the column, or without rows, is a bad file.

Usage (config.data):

  name="parquet", files="/fineweb/sample/*.parquet", text_field="text"
"""

import dataclasses

import numpy as np
import pyarrow as pa
from pyarrow import parquet as pq
import tensorflow as tf

from data import records

_TEXT_TYPES = (pa.string(), pa.large_string(), pa.binary(),
               pa.large_binary())


def row_groups(path: str, text_field: str,
               skipped: records.Skipped | None) -> list[tuple[int, int]]:
  """The `(row group, first row)` pairs of a file with rows.

  Raises:
    records.BadRecordError: not a Parquet file, no (text) column, no rows
      (with `skipped`, the file is counted there and left out).
  """
  try:
    metadata = pq.ParquetFile(path)
  except (pa.ArrowException, OSError) as e:
    records.bad("bad_file", path, f"not a readable Parquet file ({e})",
                skipped, once=True)
    return []
  schema = metadata.schema_arrow
  num_rows = metadata.metadata.num_rows
  if num_rows == 0:
    records.bad("empty_file", path, "the file has no rows", skipped, once=True)
    return []
  if text_field not in schema.names:
    records.bad("missing_field", path,
                f"no column {text_field!r} (columns: {schema.names[:8]})",
                skipped, count=num_rows, once=True)
    return []
  if schema.field(text_field).type not in _TEXT_TYPES:
    records.bad("missing_field", path,
                f"the column {text_field!r} is "
                f"{schema.field(text_field).type}, not a string", skipped,
                count=num_rows, once=True)
    return []
  out, first = [], 0
  for group in range(metadata.num_row_groups):
    out.append((group, first))
    first += metadata.metadata.row_group(group).num_rows
  return out


class _RowGroupReader:
  """The text column of one row group: (texts, present)."""

  def __init__(self, text_field: str):
    self.text_field = text_field

  def __call__(self, path, group):
    table = pq.ParquetFile(path.numpy().decode()).read_row_group(
        int(group.numpy()), columns=[self.text_field])
    column = table.column(0)
    values = column.to_pylist()
    present = np.asarray([v is not None for v in values], bool)
    texts = [b"" if v is None else v.encode("utf-8") if isinstance(v, str)
             else v for v in values]
    return np.asarray(texts, object), present


@dataclasses.dataclass(frozen=True)
class Settings(records.FilesSettings):
  """The `config.data` fields of the parquet source."""

  UNIT = "row"

  def records(self, split: str, data_dir: str, process_index: int,
              process_count: int, skipped: records.Skipped
              ) -> tuple[tf.data.Dataset, bool, bool]:
    del data_dir, process_index, process_count  # Sharded by record.
    paths, hold_out = self.split_files(split, skipped)
    items = [(path, group, first) for path in paths
             for group, first in row_groups(path, self.text_field,
                                            self.skipped(skipped))]
    if not items:
      raise ValueError(f"parquet: no file of the {split} split has rows "
                       f"with a text column {self.text_field!r}.")
    reader = _RowGroupReader(self.text_field)

    def rows(path, group, first):
      texts, present = tf.py_function(reader, [path, group],
                                      [tf.string, tf.bool])
      texts = tf.ensure_shape(texts, [None])
      present = tf.ensure_shape(present, [None])
      index = first + tf.range(tf.size(texts, out_type=tf.int64))
      return tf.data.Dataset.from_tensor_slices(
          records.record(tf.fill(tf.shape(texts), path), index, texts,
                         present))

    dataset = tf.data.Dataset.from_tensor_slices((
        [i[0] for i in items], np.asarray([i[1] for i in items], np.int64),
        np.asarray([i[2] for i in items], np.int64)))
    return records.interleave(dataset, rows, len(items)), hold_out, False
