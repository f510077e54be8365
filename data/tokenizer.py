"""Tokenizers (Hugging Face `tokenizers`): the byte-level BPE trained for the
`text_files` corpus, and any released model's `tokenizer.json` ("hf:PATH");
both identified by their SHA-256.

Byte-level BPE (GPT-2's scheme) first maps every UTF-8 byte to one of 256
printable characters, so every string is encoded without unknown tokens and
`decode(encode(text)) == text` exactly; merges are learnt on top of those
256 byte symbols. Inputs are strings, so only files that are valid UTF-8 can
be tokenized (`decode_utf8`); the caller decides what to do with the others.

A tokenizer is trained once per corpus, vocabulary size and seed
(`train_for_files`): the seed picks which training files are read when the
training split is larger than `SAMPLE_BYTES`, and the result is the same
`tokenizer.json`, byte for byte, for the same inputs.

Usage:

  from data import tokenizer
  tokenizer.train_for_files(paths, vocab_size=4096, seed=0, path=out_path)
  tok = tokenizer.load(out_path)
  ids = tok.encode(text).ids
  text = tok.decode(ids)
  digest = tokenizer.sha256(out_path)

  # A released model's tokenizer (`config.data.tokenizer="hf:PATH"`):
  tok = tokenizer.load_hf(tokenizer.hf_path("hf:/models/x/tokenizer.json"))
  ids = tokenizer.encode_documents(tok, ["one document", "another"])

A released model's `tokenizer.json` is used as it is: each document is
encoded with the tokenizer's own special-token template (its
post-processor: for example a BOS token in front for Llama-style
tokenizers, nothing for GPT-2-style ones), exactly what
`Tokenizer.encode(text)` gives.
"""

import functools
import hashlib
import os
import tempfile
from typing import Iterable, Sequence

from absl import logging
import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

# At most this many bytes of training files are read to learn the merges
# (about 8 s for 4096 tokens on 2 CPU cores); the seed picks the files.
SAMPLE_BYTES = 16 << 20
# Byte-level BPE starts from the 256 byte symbols.
MIN_VOCAB_SIZE = 257
MAX_VOCAB_SIZE = 1 << 16   # Token ids are stored as uint16.
# `config.data.tokenizer` of a released model's tokenizer: "hf:PATH".
HF_PREFIX = "hf:"


def decode_utf8(data: bytes) -> str | None:
  """`data` as text, or None if it is not valid UTF-8."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return None


# The hex SHA-256 of a file, as every checksum in a run's directory.
def sha256(path: str) -> str:
  """The hex SHA-256 of a file (identifies a tokenizer in a run's config)."""
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def check_vocab_size(vocab_size: int) -> None:
  """Raises ValueError unless `vocab_size` fits a byte-level BPE in uint16."""
  if (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
      or not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE):
    raise ValueError(f"A BPE vocabulary size must be an int in "
                     f"[{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}], got "
                     f"{vocab_size!r}.")


def _empty_byte_level() -> tokenizers.Tokenizer:
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                               use_regex=True)
  tok.decoder = decoders.ByteLevel()
  return tok


def bytes_tokenizer() -> tokenizers.Tokenizer:
  """The byte-level data as a `tokenizer.json`: id b is byte b (as the
  "bytes" tokenizer's ids), no merges, no special tokens; encoding a text
  gives its UTF-8 bytes and decoding any ids their bytes as UTF-8."""
  vocab = {symbol: b for symbol, b in _byte_of_symbol().items()}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                               use_regex=False)
  tok.decoder = decoders.ByteLevel()
  return tok


def train(texts: Sequence[str], vocab_size: int) -> tokenizers.Tokenizer:
  """Learns a byte-level BPE of at most `vocab_size` tokens on `texts`.

  Args:
    texts: the training documents.
    vocab_size: the vocabulary size (smaller if the texts run out of
      merges), in [257, 65536].

  Returns:
    The tokenizer: no special tokens, ids 0..255 the byte symbols.

  Raises:
    ValueError: a bad vocabulary size or no text.
  """
  check_vocab_size(vocab_size)
  if not any(texts):
    raise ValueError("A tokenizer needs some text to learn from.")
  tok = _empty_byte_level()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, show_progress=False, special_tokens=[],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer, length=len(texts))
  return tok


def sample_files(paths: Sequence[str], seed: int,
                 max_bytes: int = SAMPLE_BYTES) -> list[str]:
  """The files (in a seeded order) whose sizes add up to `max_bytes`."""
  order = np.random.default_rng(seed).permutation(len(paths))
  chosen, total = [], 0
  for i in order:
    if total >= max_bytes:
      break
    chosen.append(paths[i])
    total += os.path.getsize(paths[i])
  return chosen


def _read_texts(paths: Iterable[str]) -> tuple[list[str], int]:
  texts, skipped = [], 0
  for path in paths:
    with open(path, "rb") as f:
      text = decode_utf8(f.read())
    if text is None:
      skipped += 1
    else:
      texts.append(text)
  return texts, skipped


def train_for_files(paths: Sequence[str], *, vocab_size: int, seed: int,
                    path: str, max_bytes: int = SAMPLE_BYTES) -> str:
  """Trains a tokenizer on (a seeded sample of) files; writes it atomically.

  Args:
    paths: the training files, in a fixed order.
    vocab_size: as for `train`.
    seed: picks the files when they hold more than `max_bytes`.
    path: where to write `tokenizer.json` (directories are created).
    max_bytes: see `sample_files`.

  Returns:
    The SHA-256 of the file written.

  Raises:
    ValueError: a bad vocabulary size, or no valid UTF-8 text.
  """
  texts, skipped = _read_texts(sample_files(paths, seed, max_bytes))
  logging.info("Training a %d-token byte-level BPE on %d files (%d bytes; "
               "%d not UTF-8, left out).", vocab_size, len(texts),
               sum(len(t.encode()) for t in texts), skipped)
  return write(train(texts, vocab_size), path)


def write(tok: tokenizers.Tokenizer, path: str) -> str:
  """Writes `tok` to `path` atomically (directories are created); returns
  the file's SHA-256."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with tempfile.NamedTemporaryFile(
      "w", encoding="utf-8", dir=os.path.dirname(os.path.abspath(path)),
      delete=False) as f:
    f.write(tok.to_str())
  os.replace(f.name, path)
  return sha256(path)


def load(path: str) -> tokenizers.Tokenizer:
  """Loads a `tokenizer.json`.

  Raises:
    FileNotFoundError: no such file.
    ValueError: not a byte-level tokenizer (it could not round-trip every
      text).
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"No tokenizer file at {path}.")
  tok = tokenizers.Tokenizer.from_file(path)
  if not isinstance(tok.pre_tokenizer, pre_tokenizers.ByteLevel) or (
      not isinstance(tok.decoder, decoders.ByteLevel)):
    raise ValueError(
        f"{path} is not a byte-level tokenizer (its pre-tokenizer and "
        "decoder must be ByteLevel, so that every text round-trips).")
  return tok


def hf_path(spec: str) -> str:
  """The path of a "hf:PATH" tokenizer spec ("" for any other spec).

  Raises:
    ValueError: "hf:" without a path.
  """
  if not spec.startswith(HF_PREFIX):
    return ""
  path = spec[len(HF_PREFIX):]
  if not path:
    raise ValueError("config.data.tokenizer='hf:' needs the path of a "
                     "tokenizer.json after the colon, e.g. "
                     "'hf:/models/my-model/tokenizer.json'.")
  return os.path.abspath(os.path.expanduser(path))


def load_hf(path: str) -> tokenizers.Tokenizer:
  """Loads any `tokenizer.json` (a released model's), as `tokenizers` does.

  Loaded once per file version (cached by path, size and modification
  time); the tokenizer is shared, so do not change it.

  Args:
    path: a `tokenizer.json` file (a directory: its `tokenizer.json`).

  Raises:
    FileNotFoundError: no such file.
    ValueError: the `tokenizers` library cannot read it.
  """
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.isdir(path):
    path = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"No tokenizer file at {path}.")
  stat = os.stat(path)
  return _load_hf(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _load_hf(path: str, size: int, mtime_ns: int) -> tokenizers.Tokenizer:
  del size, mtime_ns  # Only the cache key.
  try:
    return tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # The library raises a bare Exception.
    raise ValueError(f"{path} is not a tokenizer.json that the tokenizers "
                     f"library can read: {e}") from e


def vocab_size(tok: tokenizers.Tokenizer) -> int:
  """Token ids of a tokenizer, added (special) tokens included."""
  return tok.get_vocab_size(with_added_tokens=True)


def encode_documents(tok: tokenizers.Tokenizer, texts: Sequence[str]
                     ) -> list[list[int]]:
  """The ids of each document, with the tokenizer's special-token template
  (its post-processor, e.g. a BOS token) applied per document."""
  return [e.ids for e in tok.encode_batch(list(texts),
                                          add_special_tokens=True)]


def _byte_of_symbol() -> dict[str, int]:
  """GPT-2's byte-level alphabet: printable character -> byte value."""
  printable = (list(range(ord("!"), ord("~") + 1))
               + list(range(ord("\xa1"), ord("\xac") + 1))
               + list(range(ord("\xae"), ord("\xff") + 1)))
  codes, extra = {}, 0
  for b in range(256):
    if b in printable:
      codes[chr(b)] = b
    else:
      codes[chr(256 + extra)] = b
      extra += 1
  return codes


def token_bytes(tok: tokenizers.Tokenizer) -> list[bytes]:
  """The bytes each token id stands for (id -> bytes), for byte counts."""
  table = _byte_of_symbol()
  vocab = tok.get_vocab()
  out = [b""] * tok.get_vocab_size()
  for symbol, i in vocab.items():
    out[i] = bytes(table[c] for c in symbol)
  return out


def token_byte_lengths(tok: tokenizers.Tokenizer) -> np.ndarray:
  """UTF-8 bytes per token id `[vocab]` of any tokenizer, for losses per byte.

  Special tokens count 0. A byte-level tokenizer's tokens count their
  exact bytes; other tokenizers' count the bytes of the token decoded on
  its own (approximate for pieces of a character, e.g. byte fallback).
  """
  table = _byte_of_symbol()
  byte_level = isinstance(tok.decoder, decoders.ByteLevel)
  special = {i for i, t in tok.get_added_tokens_decoder().items()
             if t.special}
  out = np.zeros(vocab_size(tok), np.float32)
  others = []
  for symbol, i in tok.get_vocab(with_added_tokens=True).items():
    if i in special:
      continue
    if byte_level and all(c in table for c in symbol):
      out[i] = len(symbol)
    else:
      others.append(i)
  decoded = tok.decode_batch([[i] for i in others],
                             skip_special_tokens=False)
  for i, text in zip(others, decoded, strict=True):
    out[i] = len(text.encode("utf-8", errors="replace"))
  return out


def decode_bytes(tok: tokenizers.Tokenizer, ids: Sequence[int]) -> bytes:
  """The exact bytes of a token sequence (also a cut inside a character)."""
  pieces = token_bytes(tok)
  return b"".join(pieces[int(i)] for i in ids)


class TextCodec:
  """Text <-> token ids: UTF-8 bytes, a byte-level BPE `tokenizer.json`, or
  a released model's `tokenizer.json`.

  Args:
    tokenizer_path: the BPE; "" = bytes (ids 0..255).
    hf_tokenizer_path: a released model's `tokenizer.json` (overrides
      `tokenizer_path`); a text is encoded as a document starts (with
      the tokenizer's special-token template, as in training).
  """

  def __init__(self, tokenizer_path: str = "", hf_tokenizer_path: str = ""):
    self.hf = bool(hf_tokenizer_path)
    self.tokenizer = (load_hf(hf_tokenizer_path) if self.hf
                      else load(tokenizer_path) if tokenizer_path else None)

  def encode(self, text: str) -> list[int]:
    if self.tokenizer is None:
      return list(text.encode("utf-8"))
    return self.tokenizer.encode(text).ids

  def decode(self, ids: Sequence[int]) -> str:
    """The text; a character cut by the end of `ids` shows as U+FFFD."""
    if self.hf:
      return self.tokenizer.decode([int(i) for i in ids],
                                   skip_special_tokens=False)
    data = (bytes(int(i) for i in ids) if self.tokenizer is None
            else decode_bytes(self.tokenizer, ids))
    return data.decode("utf-8", errors="replace")
