"""TFDS builder `text_files`: a corpus of local files, bytes or BPE tokens.

One document per file whose path matches a glob (`**` recurses). With
`tokenizer="bytes"` its tokens are the file's raw bytes (vocabulary 256);
with `tokenizer="bpe"` they are the ids of a byte-level BPE
(`data/tokenizer.py`, at most `bpe_vocab_size` ids) trained on this corpus's
training split, built once per data dir under
`<data_dir>/tokenizers/<corpus>_bpe<V>_seed<S>/tokenizer.json` (or any
byte-level `tokenizer.json` given as `tokenizer_path`); with
`tokenizer="hf:PATH"` they are the ids of a released model's
`tokenizer.json`, applied in the input pipeline to the byte dataset
(`records.tokenize_files`). No end-of-document token is added (hf: only
what its template adds): a document is its file's tokens, and the packer
keeps targets inside it. BPE takes text, so files that are not valid UTF-8
are left out of the BPE dataset (logged; 4 of the standard library's 1790
files), and of the hf documents. The default glob is the `.py` files of
the running Python's standard library (excluding
`site-packages`/`dist-packages`), which exist on every machine, so the
project has a real language-modelling task offline.

Each file goes to `validation` when a hash of its path relative to the glob's
fixed prefix falls below `validation_percent`, else to `train`: the split of a
file does not depend on the other files or on where the tree is installed.

The config name carries a hash of the glob and of the matched files' relative
paths, sizes and modification times (and the tokenizer's SHA-256), so changed
files or another tokenizer build a new dataset instead of reading a stale
one.

Usage:

  import tensorflow_datasets as tfds
  from data import text_files
  config = text_files.make_config(glob="/path/to/corpus/**/*.txt")
  # BPE: settings = text_files.Settings(tokenizer="bpe").resolve(data_dir)
  #      config = settings.builder_config()
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

from data import builders, corpus
from data import tokenizer as tokenizer_lib

SPLITS = ("train", "validation")
VOCAB_SIZE = corpus.BYTE_VOCAB_SIZE
_ENCODE_FILES = 64   # Files tokenized together (in parallel threads).
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


class TokenizerChangedError(ValueError):
  """A tokenizer file is not the one the config records."""


def check_hf(path: str, sha256: str) -> str:
  """Loads a released model's tokenizer.json and returns its SHA-256.

  Raises:
    FileNotFoundError, ValueError: as `tokenizer.load_hf`.
    TokenizerChangedError: the file's SHA-256 is not `sha256` (if given).
  """
  tokenizer_lib.load_hf(path)
  return _checked_sha256(path, sha256)


def _checked_sha256(path: str, sha256: str) -> str:
  """The file's SHA-256, which must be `sha256` if given (the one check of
  a tokenizer file's identity).

  Raises:
    TokenizerChangedError: another checksum.
  """
  digest = tokenizer_lib.sha256(path)
  if sha256 and digest != sha256:
    raise TokenizerChangedError(
        f"The tokenizer {path} has SHA-256 {digest}, but the config records "
        f"{sha256} (config.data.tokenizer_sha256): the file changed since "
        "the run started. Restore it, or start a new run (another "
        "--workdir).")
  return digest


def check_bpe(path: str, sha256: str, vocab_size: int) -> str:
  """The SHA-256 of the byte-level BPE at `path`, checked against the
  recorded `sha256` ("" = none) and `vocab_size` (the one check of a BPE
  file, for every corpus).

  Raises:
    FileNotFoundError: no such file.
    TokenizerChangedError: another checksum than `sha256`.
    ValueError: not a byte-level tokenizer, or more than `vocab_size` ids.
  """
  tok = tokenizer_lib.load(path)
  digest = _checked_sha256(path, sha256)
  if tok.get_vocab_size() > vocab_size:
    raise ValueError(
        f"The tokenizer {path} has {tok.get_vocab_size()} tokens, more than "
        f"config.data.bpe_vocab_size={vocab_size}.")
  return digest


@dataclasses.dataclass(frozen=True)
class Settings(corpus.TokenizedSettings):
  """The `config.data` fields of the text_files dataset, validated (the one
  home of its defaults): `corpus.TokenizedSettings`'s and these."""
  glob: str = ""                  # Files ("" = the stdlib's .py files).
  tokenizer_seed: int = 0         # BPE: picks the files merges are learnt on.

  # Features each document carries into the pipeline.
  FEATURES = ("tokens",)

  @property
  def tokenizes_in_pipeline(self) -> bool:
    return bool(self.hf_path)

  def mean_length(self, info: Any, split: str) -> float:
    """Mean document length (tokens) of a split, for the packing window."""
    split_info = info.splits[split]
    # uint16 ids, or bytes (hf: tokenized later, ~4 bytes a token).
    token_bytes = 2 if self.is_bpe else 4 if self.hf_path else 1
    return split_info.num_bytes / token_bytes / max(
        split_info.num_examples, 1)

  def default_tokenizer_path(self, data_dir: str) -> str:
    """Where the tokenizer of this corpus, size and seed is built."""
    corpus = make_config(glob=self.glob,
                         validation_percent=self.validation_percent).name
    return os.path.join(
        data_dir, "tokenizers",
        f"{corpus}_bpe{self.bpe_vocab_size}_seed{self.tokenizer_seed}",
        "tokenizer.json")

  def resolve(self, data_dir: str) -> "Settings":
    """These settings with the BPE tokenizer's path and checksum filled in.

    Builds the corpus's tokenizer if `tokenizer_path` is unset and it does
    not exist yet; a no-op for bytes.

    Args:
      data_dir: the TFDS data dir (the default tokenizer lives under it).

    Returns:
      Settings with an absolute `tokenizer_path` and its `tokenizer_sha256`.

    Raises:
      FileNotFoundError: a given `tokenizer_path` does not exist.
      TokenizerChangedError: the file's SHA-256 differs from
        `tokenizer_sha256`.
      ValueError: not a byte-level tokenizer, or more ids than
        `bpe_vocab_size`.
    """
    if self.hf_path:
      return dataclasses.replace(self, tokenizer_sha256=check_hf(
          self.hf_path, self.tokenizer_sha256))
    if not self.is_bpe:
      return self
    path = self.tokenizer_path or self.default_tokenizer_path(data_dir)
    path = os.path.abspath(os.path.expanduser(path))
    if not self.tokenizer_path and not os.path.exists(path):
      train_files = split_files(_pattern_files(self.glob),
                                self.validation_percent)["train"]
      tokenizer_lib.train_for_files(
          [f[0] for f in train_files], vocab_size=self.bpe_vocab_size,
          seed=self.tokenizer_seed, path=path)
    digest = check_bpe(path, self.tokenizer_sha256, self.bpe_vocab_size)
    return dataclasses.replace(self, tokenizer_path=path,
                               tokenizer_sha256=digest)

  def builder_config(self) -> "TextFilesConfig":
    """The TFDS builder config for the files matching `glob`, named after
    them (see `make_config`).

    Raises:
      ValueError: BPE settings that were not `resolve`d.
    """
    if self.is_bpe and not (self.tokenizer_path and self.tokenizer_sha256):
      raise ValueError("text_files with tokenizer='bpe' needs its tokenizer "
                       "resolved first (Settings.resolve(data_dir)).")
    return make_config(glob=self.glob,
                       validation_percent=self.validation_percent,
                       tokenizer_path=self.tokenizer_path if self.is_bpe
                       else "",
                       tokenizer_sha256=self.tokenizer_sha256 if self.is_bpe
                       else "")


@dataclasses.dataclass(eq=False)
class TextFilesConfig(tfds.core.BuilderConfig):
  """TFDS config of the `text_files` dataset; build it with `make_config`."""
  glob: str = Settings.glob
  validation_percent: int = Settings.validation_percent
  exclude_installed: bool = True
  tokenizer_path: str = ""        # "" = bytes.
  tokenizer_sha256: str = ""


def _pattern_files(glob: str | None) -> list[tuple[str, str]]:
  """The non-empty files of a glob ("" = the stdlib's `.py` files)."""
  pattern = os.path.expanduser(glob) if glob else default_glob()
  return document_files(pattern, exclude_installed=not glob)


def make_config(*, glob: str | None = None,
                validation_percent: int = Settings.validation_percent,
                tokenizer_path: str = "", tokenizer_sha256: str = ""
                ) -> TextFilesConfig:
  """Returns a config for the files matching `glob`, named after them.

  Args:
    glob: files to read, one document each; None or "" means the standard
      library's `.py` files (without installed packages).
    validation_percent: share of files in the validation split, in [1, 99].
    tokenizer_path: a byte-level BPE `tokenizer.json`; "" = bytes.
    tokenizer_sha256: its SHA-256 (names the dataset; checked when built).

  Returns:
    A `TextFilesConfig`.

  Raises:
    ValueError: the glob matches fewer than 2 non-empty files, or a bad
      percentage, or a tokenizer path without its checksum.
  """
  Settings(glob=glob or "", validation_percent=validation_percent)
  if bool(tokenizer_path) != bool(tokenizer_sha256):
    raise ValueError("text_files: give tokenizer_path and tokenizer_sha256 "
                     "together.")
  exclude_installed = not glob
  pattern = os.path.expanduser(glob) if glob else default_glob()
  files = _pattern_files(glob)
  split_files(files, validation_percent)  # Fails early on a single file.
  digest = hashlib.sha256(f"{pattern}\0{exclude_installed}".encode("utf-8"))
  for path, relpath in files:
    stat = os.stat(path)
    digest.update(f"\0{relpath}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
  name = f"{digest.hexdigest()[:16]}_p{validation_percent}"
  if tokenizer_sha256:
    name += f"_bpe{tokenizer_sha256[:16]}"
  return TextFilesConfig(
      name=name,
      description=f"{len(files)} files matching {pattern}",
      glob=pattern,
      validation_percent=validation_percent,
      exclude_installed=exclude_installed,
      tokenizer_path=tokenizer_path,
      tokenizer_sha256=tokenizer_sha256)


class TextFiles(builders.LocalBuilder):
  """Documents (bytes or BPE ids), one per local file matched by a glob."""

  BUILDER_CONFIGS = [TextFilesConfig(name="stdlib",
                                     description="standard library .py")]

  def _features(self) -> dict[str, Any]:
    bpe = bool(self.builder_config.tokenizer_sha256)
    return {"tokens": builders.tensor(np.uint16 if bpe else np.uint8),
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
    config = self.builder_config
    if not config.tokenizer_sha256:
      for path, relpath in files:
        with open(path, "rb") as f:
          data = f.read()
        yield relpath, {"tokens": np.frombuffer(data, np.uint8),
                        "path": relpath}
      return
    yield from _bpe_examples(files, config)


def _bpe_examples(files: list[tuple[str, str]], config: TextFilesConfig):
  """`(key, example)` pairs of BPE-tokenized UTF-8 files."""
  digest = tokenizer_lib.sha256(config.tokenizer_path)
  if digest != config.tokenizer_sha256:
    raise TokenizerChangedError(
        f"The tokenizer {config.tokenizer_path} has SHA-256 {digest}, not "
        f"{config.tokenizer_sha256}.")
  tok = tokenizer_lib.load(config.tokenizer_path)
  skipped = 0
  for start in range(0, len(files), _ENCODE_FILES):
    chunk, texts = [], []
    for path, relpath in files[start:start + _ENCODE_FILES]:
      with open(path, "rb") as f:
        text = tokenizer_lib.decode_utf8(f.read())
      if text is None:
        skipped += 1
        continue
      chunk.append(relpath)
      texts.append(text)
    for relpath, encoding in zip(chunk, tok.encode_batch(texts), strict=True):
      yield relpath, {"tokens": np.asarray(encoding.ids, np.uint16),
                      "path": relpath}
  if skipped:
    logging.info("text_files: left %d files that are not UTF-8 out of the "
                 "BPE dataset.", skipped)
