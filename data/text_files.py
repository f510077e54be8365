"""TFDS builder `text_files`: a byte-level corpus of local files.

One document per file whose path matches a glob (`**` recurses); its tokens
are the file's raw bytes (vocabulary 256, no tokenizer). The default glob is
the `.py` files of the running Python's standard library (excluding
`site-packages`/`dist-packages`), which exist on every machine, so the project
has a real language-modelling task offline.

Each file goes to `validation` when a hash of its path relative to the glob's
fixed prefix falls below `validation_percent`, else to `train`: the split of a
file does not depend on the other files or on where the tree is installed.

The config name carries a hash of the glob and of the matched files' relative
paths, sizes and modification times, so changed files build a new dataset
instead of reading a stale one.

Usage:

  import tensorflow_datasets as tfds
  from data import text_files
  config = text_files.make_config(glob="/path/to/corpus/**/*.txt")
  ds = tfds.load("text_files", split="train", data_dir=data_dir,
                 builder_kwargs={"config": config})
"""

import dataclasses
import fnmatch
import glob as glob_lib
import hashlib
import os
import sysconfig
from typing import Any

from absl import logging
import numpy as np
import tensorflow_datasets as tfds

from data import builders

SPLITS = ("train", "validation")
VOCAB_SIZE = 256
_EXCLUDED_DIRS = ("site-packages", "dist-packages")


def default_glob() -> str:
  """Returns the glob of the standard library's `.py` files."""
  return os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")


def _root(pattern: str) -> str:
  """Returns the longest leading directory of `pattern` without wildcards."""
  parts = []
  for part in pattern.split(os.sep):
    if glob_lib.has_magic(part):
      break
    parts.append(part)
  root = os.sep.join(parts)
  return root if os.path.isdir(root) else os.path.dirname(root)


def _bucket(relpath: str) -> int:
  """Returns a stable hash bucket in [0, 100) of a relative path."""
  digest = hashlib.sha256(relpath.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") % 100


def list_files(pattern: str, *, exclude_installed: bool = False
               ) -> list[tuple[str, str]]:
  """Lists the files matching a glob.

  Args:
    pattern: glob; `**` matches any number of directories.
    exclude_installed: skip (and do not descend into) `site-packages` and
      `dist-packages`; the pattern must then be of the form `ROOT/**/NAME`.

  Returns:
    Sorted `(path, path relative to the glob's fixed prefix)` pairs.
  """
  root = _root(pattern)
  if exclude_installed:
    name = os.path.basename(pattern)
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
      paths.extend(os.path.join(dirpath, f)
                   for f in fnmatch.filter(filenames, name))
  else:
    paths = glob_lib.glob(pattern, recursive=True)
  files = [(path, os.path.relpath(path, root) if root else path)
           for path in paths if os.path.isfile(path)]
  return sorted(files, key=lambda f: f[1])


def document_files(pattern: str, *, exclude_installed: bool = False
                   ) -> list[tuple[str, str]]:
  """The non-empty files matching a glob, one document each.

  Args:
    pattern: glob, as for `list_files`.
    exclude_installed: as for `list_files`.

  Returns:
    Sorted `(path, relpath)` pairs of the files with at least one byte.

  Raises:
    ValueError: the glob matches no file, or only empty files.
  """
  files = list_files(pattern, exclude_installed=exclude_installed)
  if not files:
    raise ValueError(f"text_files: the glob {pattern!r} matched no files.")
  documents = [f for f in files if os.path.getsize(f[0]) > 0]
  if not documents:
    raise ValueError(
        f"text_files: every matched file is empty ({len(files)} files match "
        f"{pattern!r}): there is no text to train on.")
  if len(documents) < len(files):
    logging.info("text_files: skipping %d empty files of %d matching %r.",
                 len(files) - len(documents), len(files), pattern)
  return documents


def split_files(files: list[tuple[str, str]], validation_percent: int
                ) -> dict[str, list[tuple[str, str]]]:
  """Splits files into train/validation by the hash of their relative path.

  Args:
    files: `(path, relpath)` pairs, as from `list_files`.
    validation_percent: share of files in validation, in [1, 99].

  Returns:
    `{"train": [...], "validation": [...]}`, both non-empty: when the hash
    leaves one side empty, the file with the lowest (for validation) or highest
    (for train) bucket moves over.

  Raises:
    ValueError: fewer than 2 files.
  """
  if len(files) < 2:
    raise ValueError(
        f"text_files needs at least 2 files (one per split), got {len(files)}.")
  ranked = sorted(files, key=lambda f: (_bucket(f[1]), f[1]))
  num_val = sum(_bucket(f[1]) < validation_percent for f in ranked)
  num_val = min(max(num_val, 1), len(ranked) - 1)
  by_name = lambda fs: sorted(fs, key=lambda f: f[1])
  return {"train": by_name(ranked[num_val:]),
          "validation": by_name(ranked[:num_val])}


@dataclasses.dataclass(frozen=True)
class Settings:
  """The `config.data` fields of the text_files dataset, validated (the one
  home of its defaults)."""
  glob: str = ""                  # Files ("" = the stdlib's .py files).
  validation_percent: int = 5     # % of files for validation, in [1, 99].

  # Features each document carries into the pipeline.
  FEATURES = ("tokens",)

  def __post_init__(self):
    if not isinstance(self.validation_percent, int) or not (
        1 <= self.validation_percent <= 99):
      raise ValueError(f"text_files validation_percent must be an int in "
                       f"[1, 99], got {self.validation_percent!r}.")

  def data_vocab_size(self) -> int:
    return VOCAB_SIZE

  def mean_length(self, info: Any, split: str) -> float:
    """Mean document length (bytes) of a split, for the packing window."""
    split_info = info.splits[split]
    return split_info.num_bytes / max(split_info.num_examples, 1)

  def builder_config(self) -> "TextFilesConfig":
    """The TFDS builder config for the files matching `glob`, named after
    them (see `make_config`)."""
    return make_config(glob=self.glob,
                       validation_percent=self.validation_percent)


@dataclasses.dataclass(eq=False)
class TextFilesConfig(tfds.core.BuilderConfig):
  """TFDS config of the `text_files` dataset; build it with `make_config`."""
  glob: str = Settings.glob
  validation_percent: int = Settings.validation_percent
  exclude_installed: bool = True


def make_config(*, glob: str | None = None,
                validation_percent: int = Settings.validation_percent
                ) -> TextFilesConfig:
  """Returns a config for the files matching `glob`, named after them.

  Args:
    glob: files to read, one document each; None or "" means the standard
      library's `.py` files (without installed packages).
    validation_percent: share of files in the validation split, in [1, 99].

  Returns:
    A `TextFilesConfig`.

  Raises:
    ValueError: the glob matches fewer than 2 non-empty files, or a bad
      percentage.
  """
  Settings(glob=glob or "", validation_percent=validation_percent)
  exclude_installed = not glob
  pattern = os.path.expanduser(glob) if glob else default_glob()
  files = document_files(pattern, exclude_installed=exclude_installed)
  split_files(files, validation_percent)  # Fails early on a single file.
  digest = hashlib.sha256(f"{pattern}\0{exclude_installed}".encode("utf-8"))
  for path, relpath in files:
    stat = os.stat(path)
    digest.update(f"\0{relpath}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
  name = f"{digest.hexdigest()[:16]}_p{validation_percent}"
  return TextFilesConfig(
      name=name,
      description=f"{len(files)} files matching {pattern}",
      glob=pattern,
      validation_percent=validation_percent,
      exclude_installed=exclude_installed)


class TextFiles(builders.LocalBuilder):
  """Byte-level documents, one per local file matched by a glob."""

  BUILDER_CONFIGS = [TextFilesConfig(name="stdlib",
                                     description="standard library .py")]

  def _features(self) -> dict[str, Any]:
    return {"tokens": builders.tensor(np.uint8),
            "path": tfds.features.Text()}

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing is downloaded.
    config = self.builder_config
    pattern = config.glob or default_glob()
    files = document_files(pattern,
                           exclude_installed=config.exclude_installed)
    splits = split_files(files, config.validation_percent)
    return {split: self._generate_examples(splits[split]) for split in SPLITS}

  def _generate_examples(self, files: list[tuple[str, str]]):
    for path, relpath in files:
      with open(path, "rb") as f:
        data = f.read()
      yield relpath, {"tokens": np.frombuffer(data, np.uint8),
                      "path": relpath}
