"""What the pipeline reads of every dataset's settings (`CorpusSettings`).

Each dataset's `Settings` (delayed_copy, text_files, the record sources)
derives from it: a dataset that has a feature overrides its member, the
others keep the default here, so `data/pipeline.py` and the tools read the
same names on every dataset instead of probing for them.
"""


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
