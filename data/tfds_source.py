"""Corpus source `tfds`: the text feature of any prepared TFDS dataset.

`config.data.tfds_name` (e.g. "c4/en", "wikipedia/20230601.en", "lm1b"),
already prepared under the data dir (`tfds build NAME --data_dir=DIR`, or
a copy of a TFDS data dir): nothing is downloaded or built here. Its
`text_field` feature (default "text") is one document per example. The
training documents are `tfds_split` (default "train"); validation is
`tfds_validation_split` when given, else the dataset's "validation" split
when it has one, else `validation_percent` of `tfds_split` held out by hash
(`data/records.py`). Each process reads its own even part of the split
(`tfds.even_splits`); examples are named `tfds:<name>/<split>, record <n>`
(0-based in the process's part) in errors.

Usage (config.data):

  name="tfds", tfds_name="lm1b", data_dir="~/tensorflow_datasets"
"""

import dataclasses

import tensorflow as tf
import tensorflow_datasets as tfds

from data import records


@dataclasses.dataclass(frozen=True)
class Settings(records.Settings):
  """The `config.data` fields of the tfds source."""
  tfds_name: str = ""             # A prepared TFDS dataset, e.g. "lm1b".
  tfds_split: str = "train"       # The training split.
  # The validation split; "" = "validation" if the dataset has one, else
  # `validation_percent` of `tfds_split` held out by hash.
  tfds_validation_split: str = ""

  def __post_init__(self):
    super().__post_init__()
    if not self.tfds_split:
      raise ValueError("config.data.tfds_split must name a split.")

  def builder(self, data_dir: str) -> tfds.core.DatasetBuilder:
    """The prepared dataset's builder.

    Raises:
      ValueError: no name, not prepared under `data_dir`, no such text
        feature.
    """
    if not self.tfds_name:
      raise ValueError("config.data.tfds_name must name a prepared TFDS "
                       "dataset, e.g. 'lm1b'.")
    try:
      builder = tfds.builder(self.tfds_name, data_dir=data_dir)
    except Exception as e:  # TFDS raises several kinds (not found, ...).
      raise ValueError(
          f"config.data.tfds_name={self.tfds_name!r}: no such TFDS dataset "
          f"under {data_dir} ({e}).") from e
    if not builder.is_prepared():
      raise ValueError(
          f"The TFDS dataset {self.tfds_name!r} is not prepared under "
          f"{data_dir}: run `tfds build {self.tfds_name} --data_dir="
          f"{data_dir}` first, or set config.data.data_dir to a directory "
          "that holds it.")
    features = builder.info.features
    if self.text_field not in features.keys():
      raise ValueError(
          f"The TFDS dataset {self.tfds_name!r} has no feature "
          f"{self.text_field!r} (config.data.text_field); it has "
          f"{sorted(features.keys())}.")
    if features[self.text_field].tf_dtype != tf.string:
      raise ValueError(
          f"The feature {self.text_field!r} of {self.tfds_name!r} is "
          f"{features[self.text_field].tf_dtype.name}, not text.")
    return builder

  def _split(self, split: str, builder: tfds.core.DatasetBuilder
             ) -> tuple[str, bool]:
    """The TFDS split to read and whether the hold-out applies."""
    named = self.tfds_validation_split or (
        "validation" if "validation" in builder.info.splits else "")
    if named and named not in builder.info.splits and "[" not in named:
      raise ValueError(
          f"The TFDS dataset {self.tfds_name!r} has no split {named!r} "
          f"(config.data.tfds_validation_split); it has "
          f"{sorted(builder.info.splits)}.")
    if split == "validation" and named:
      return named, False
    if self.tfds_split not in builder.info.splits and (
        "[" not in self.tfds_split):
      raise ValueError(
          f"The TFDS dataset {self.tfds_name!r} has no split "
          f"{self.tfds_split!r} (config.data.tfds_split); it has "
          f"{sorted(builder.info.splits)}.")
    return self.tfds_split, not named

  def records(self, split: str, data_dir: str, process_index: int,
              process_count: int, skipped: records.Skipped
              ) -> tuple[tf.data.Dataset, bool, bool]:
    del skipped  # Bad records only; counted by the tokenizing function.
    builder = self.builder(data_dir)
    name, hold_out = self._split(split, builder)
    part = tfds.even_splits(name, n=process_count)[process_index]
    examples = builder.as_dataset(
        split=part, shuffle_files=False,
        # No in-memory cache: it would be written into iterator checkpoints.
        read_config=tfds.ReadConfig(try_autocache=False))
    source = f"tfds:{self.tfds_name}/{name}"
    field = self.text_field
    return examples.enumerate().map(
        lambda i, ex: records.record(source, i, ex[field])), hold_out, True
