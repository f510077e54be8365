"""Byte-level BPE tokenizers for the `text_files` corpus (Hugging Face
`tokenizers`), trained offline and identified by their SHA-256.

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
"""

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
  tok = train(texts, vocab_size)
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


def decode_bytes(tok: tokenizers.Tokenizer, ids: Sequence[int]) -> bytes:
  """The exact bytes of a token sequence (also a cut inside a character)."""
  pieces = token_bytes(tok)
  return b"".join(pieces[int(i)] for i in ids)


class TextCodec:
  """Text <-> token ids: UTF-8 bytes, or a byte-level BPE `tokenizer.json`.

  Args:
    tokenizer_path: the BPE; "" = bytes (ids 0..255).
  """

  def __init__(self, tokenizer_path: str = ""):
    self.tokenizer = load(tokenizer_path) if tokenizer_path else None

  def encode(self, text: str) -> list[int]:
    if self.tokenizer is None:
      return list(text.encode("utf-8"))
    return self.tokenizer.encode(text).ids

  def decode(self, ids: Sequence[int]) -> str:
    """The text; a character cut by the end of `ids` shows as U+FFFD."""
    data = (bytes(int(i) for i in ids) if self.tokenizer is None
            else decode_bytes(self.tokenizer, ids))
    return data.decode("utf-8", errors="replace")
