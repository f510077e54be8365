"""TFDS builder `delayed_copy`: a synthetic memory task, generated offline.

Each document has a length drawn uniformly from `[min_len, max_len]`. Its
first `delay` tokens are i.i.d. uniform over `[0, vocab_size)` and every later
token repeats the one `delay` steps back (`t[i] = t[i - delay]`), so the next
token is predictable only by remembering the token `delay` steps back. The
per-token `loss_mask` is True exactly for the predictable tokens (`i >= delay`).

The builder config (vocabulary, delay, length range, split sizes, seed) is part
of the dataset's identity: `make_config` names the config after its values, so
a changed setting builds a new dataset beside the old one instead of reading a
stale one. Each split is a pure function of `(seed, split)`.

Usage:

  import tensorflow_datasets as tfds
  from data import delayed_copy
  config = delayed_copy.make_config(vocab_size=256, delay=8)
  ds = tfds.load("delayed_copy", split="train", data_dir=data_dir,
                 builder_kwargs={"config": config})
"""

import dataclasses
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from data import builders, corpus

SPLITS = ("train", "validation")
# Configs by name: TFDS accepts a config named like a registered one only if
# it is that very object, so equal settings must give the same object.
_CONFIGS = {}


@dataclasses.dataclass(frozen=True)
class Settings(corpus.CorpusSettings):
  """The `config.data` fields of the delayed_copy dataset, validated.

  The one home of the dataset's defaults; `builder_config` turns them into
  the TFDS builder config.
  """
  vocab_size: int = 256           # Token ids lie in [0, vocab_size).
  delay: int = 8                  # t[i] = t[i - delay] (tokens), >= 1.
  min_len: int = 16               # Shortest document (tokens), >= 2.
  max_len: int = 512              # Longest document (tokens), >= min_len.
  num_train_docs: int = 10_000    # Documents in the `train` split.
  num_eval_docs: int = 500        # Documents in the `validation` split.
  dataset_seed: int = 0           # Generator seed: the data itself.

  # Features each document carries into the pipeline.
  FEATURES = ("tokens", "loss_mask")

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"delayed_copy {f.name} must be an int, got "
                         f"{value!r}.")
      object.__setattr__(self, f.name, int(value))
    if not 2 <= self.vocab_size <= 2**31 - 1:
      raise ValueError(f"delayed_copy vocab_size must be in [2, 2**31), got "
                       f"{self.vocab_size}.")
    if self.delay < 1:
      raise ValueError(f"delayed_copy delay must be >= 1, got {self.delay}.")
    if self.min_len < 2 or self.max_len < self.min_len:
      raise ValueError(f"delayed_copy needs 2 <= min_len <= max_len, got "
                       f"min_len={self.min_len}, max_len={self.max_len}.")
    if self.num_train_docs < 1 or self.num_eval_docs < 1:
      raise ValueError(
          f"delayed_copy needs num_train_docs >= 1 and num_eval_docs >= 1, "
          f"got {self.num_train_docs} and {self.num_eval_docs}.")
    if self.dataset_seed < 0:
      raise ValueError(f"delayed_copy seed must be >= 0, got "
                       f"{self.dataset_seed}.")

  def data_vocab_size(self) -> int:
    return self.vocab_size

  def resolve(self, data_dir: str) -> "Settings":
    """Nothing besides the TFDS data to build or identify: `self`."""
    del data_dir
    return self

  def mean_length(self, info: Any, split: str) -> float:
    """Mean document length (tokens), for the packing window."""
    del info, split
    return (self.min_len + self.max_len) / 2

  def builder_config(self) -> "DelayedCopyConfig":
    """The TFDS builder config, named after the values; equal settings give
    the same object."""
    name = (f"v{self.vocab_size}_d{self.delay}_l{self.min_len}-"
            f"{self.max_len}_n{self.num_train_docs}-{self.num_eval_docs}_"
            f"s{self.dataset_seed}")
    if name not in _CONFIGS:
      _CONFIGS[name] = DelayedCopyConfig(
          name=name,
          description=(f"vocab {self.vocab_size}, delay {self.delay}, "
                       f"lengths {self.min_len}..{self.max_len}, "
                       f"{self.num_train_docs} train / {self.num_eval_docs} "
                       f"validation documents, seed {self.dataset_seed}"),
          vocab_size=self.vocab_size, delay=self.delay,
          min_len=self.min_len, max_len=self.max_len,
          num_train_docs=self.num_train_docs,
          num_eval_docs=self.num_eval_docs, seed=self.dataset_seed)
    return _CONFIGS[name]


@dataclasses.dataclass(eq=False)
class DelayedCopyConfig(tfds.core.BuilderConfig):
  """TFDS config of the `delayed_copy` dataset; build it with `make_config`
  (defaults: `Settings`)."""
  vocab_size: int = Settings.vocab_size
  delay: int = Settings.delay
  min_len: int = Settings.min_len
  max_len: int = Settings.max_len
  num_train_docs: int = Settings.num_train_docs
  num_eval_docs: int = Settings.num_eval_docs
  seed: int = Settings.dataset_seed


def make_config(*, seed: int = Settings.dataset_seed,
                **kwargs: int) -> DelayedCopyConfig:
  """Returns a validated config named after its values.

  Args:
    seed: seed of the generator; each split is deterministic in it.
    **kwargs: the other fields of `Settings` (`vocab_size`, `delay`,
      `min_len`, `max_len`, `num_train_docs`, `num_eval_docs`).

  Returns:
    A `DelayedCopyConfig`; equal settings give the same object.

  Raises:
    ValueError: a value out of range.
  """
  return Settings(dataset_seed=seed, **kwargs).builder_config()


def generate(config: DelayedCopyConfig, split: str):
  """Yields `(key, document)` pairs of one split, deterministically.

  Args:
    config: the dataset config.
    split: "train" or "validation".

  Yields:
    `(index, {"tokens": int32 [L], "loss_mask": bool [L]})`.

  Raises:
    ValueError: unknown split.
  """
  if split not in SPLITS:
    raise ValueError(f"Unknown delayed_copy split {split!r}; use {SPLITS}.")
  num_docs = (config.num_train_docs if split == "train"
              else config.num_eval_docs)
  rng = np.random.default_rng([config.seed, SPLITS.index(split)])
  lengths = rng.integers(config.min_len, config.max_len + 1, size=num_docs)
  heads = rng.integers(0, config.vocab_size, size=(num_docs, config.delay),
                       dtype=np.int32)
  for i, (length, head) in enumerate(zip(lengths, heads, strict=True)):
    # np.resize repeats the head cyclically: t[i] = t[i - delay].
    tokens = np.resize(head, int(length)).astype(np.int32)
    loss_mask = np.arange(length) >= config.delay
    yield i, {"tokens": tokens, "loss_mask": loss_mask}


class DelayedCopy(builders.LocalBuilder):
  """Delayed-copy documents: t[i] = t[i - delay] after i.i.d. heads."""

  BUILDER_CONFIGS = [make_config()]

  def _features(self) -> dict[str, Any]:
    return {"tokens": builders.tensor(np.int32),
            "loss_mask": builders.tensor(np.bool_)}

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing is downloaded.
    return {split: self._generate_examples(split) for split in SPLITS}

  def _generate_examples(self, split: str):
    yield from generate(self.builder_config, split)
