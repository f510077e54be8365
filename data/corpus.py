"""What the pipeline reads of every dataset's settings (`CorpusSettings`).

Each dataset's `Settings` (delayed_copy, text_files, the record sources)
derives from it: a dataset that has a feature overrides its member, the
others keep the default here, so `data/pipeline.py` and the tools read the
same names on every dataset instead of probing for them.
`TokenizedSettings` adds the fields of every dataset that tokenizes text
(text_files and the record sources), declared and checked once.
"""

import dataclasses

from data import tokenizer as tokenizer_lib

# Token ids of the byte tokenizer (one per byte value).
BYTE_VOCAB_SIZE = 256
# What `tokenizer` may name besides "hf:PATH" (a released model's
# tokenizer.json).
TOKENIZERS = ("bytes", "bpe")


class CorpusSettings:
  """The members of a dataset's settings that the pipeline reads."""

  @property
  def hf_path(self) -> str:
    """A released model's `tokenizer.json` ("" = none)."""
    return ""

  @property
  def is_bpe(self) -> bool:
    """Token ids of a BPE this project trains (`tokenizer_path`)."""
    return False

  @property
  def tokenizes_in_pipeline(self) -> bool:
    """Tokenizes inside the tf.data pipeline (external state)."""
    return False

  @property
  def skip_bad_records(self) -> bool:
    """Bad records are counted and skipped instead of raising."""
    return False


@dataclasses.dataclass(frozen=True)
class TokenizedSettings(CorpusSettings):
  """The `config.data` fields of a dataset that tokenizes text (the one
  home of their defaults and checks)."""
  # "bytes" (UTF-8 bytes, 256 ids), "bpe" (a byte-level BPE learnt on
  # this corpus's training split, built once per data dir) or "hf:PATH" (a
  # released model's tokenizer.json).
  tokenizer: str = "bytes"
  bpe_vocab_size: int = 4096      # BPE: token ids (the model's vocabulary).
  # BPE: a byte-level tokenizer.json; "" = the one built (once) for this
  # corpus under <data_dir>/tokenizers. Where it lives may change on resume.
  tokenizer_path: str = ""
  # % of the files or records held out for validation (by hash) where the
  # source has no validation split of its own, in [1, 99].
  validation_percent: int = 5
  # bpe, hf: the tokenizer's SHA-256; "" = filled in when the run starts.
  # A resume with another file is refused (it changes the data).
  tokenizer_sha256: str = ""

  def __post_init__(self):
    if not isinstance(self.validation_percent, int) or not (
        1 <= self.validation_percent <= 99):
      raise ValueError(f"config.data.validation_percent must be an int in "
                       f"[1, 99], got {self.validation_percent!r}.")
    if self.tokenizer not in TOKENIZERS and not self.hf_path:
      raise ValueError(
          f"config.data.tokenizer must be one of {TOKENIZERS} or 'hf:PATH' "
          f"(a tokenizer.json) for a {type(self).__module__} corpus, got "
          f"{self.tokenizer!r}.")
    if self.is_bpe:
      tokenizer_lib.check_vocab_size(self.bpe_vocab_size)

  @property
  def is_bpe(self) -> bool:
    return self.tokenizer == "bpe"

  @property
  def hf_path(self) -> str:
    """A released model's tokenizer.json ("hf:PATH"), or ""."""
    return tokenizer_lib.hf_path(self.tokenizer)

  def data_vocab_size(self) -> int:
    """Token ids of the dataset's tokenizer."""
    if self.hf_path:
      return tokenizer_lib.vocab_size(tokenizer_lib.load_hf(self.hf_path))
    return self.bpe_vocab_size if self.is_bpe else BYTE_VOCAB_SIZE
