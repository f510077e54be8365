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

from etils import epath
import numpy as np
import tensorflow_datasets as tfds

SPLITS = ("train", "validation")
# Configs by name: TFDS accepts a config named like a registered one only if
# it is that very object, so equal settings must give the same object.
_CONFIGS = {}


@dataclasses.dataclass(eq=False)
class DelayedCopyConfig(tfds.core.BuilderConfig):
  """Config of the `delayed_copy` dataset; build it with `make_config`."""
  vocab_size: int = 256
  delay: int = 8
  min_len: int = 16
  max_len: int = 512
  num_train_docs: int = 10_000
  num_eval_docs: int = 500
  seed: int = 0


def make_config(*,
                vocab_size: int = 256,
                delay: int = 8,
                min_len: int = 16,
                max_len: int = 512,
                num_train_docs: int = 10_000,
                num_eval_docs: int = 500,
                seed: int = 0) -> DelayedCopyConfig:
  """Returns a validated config named after its values.

  Args:
    vocab_size: number of token ids, tokens lie in `[0, vocab_size)`.
    delay: copy distance, >= 1.
    min_len: shortest document (tokens), >= 2.
    max_len: longest document (tokens), >= min_len.
    num_train_docs: documents in the `train` split, >= 1.
    num_eval_docs: documents in the `validation` split, >= 1.
    seed: seed of the generator; each split is deterministic in it.

  Returns:
    A `DelayedCopyConfig`; equal settings give the same object.

  Raises:
    ValueError: a value out of range.
  """
  values = dict(vocab_size=vocab_size, delay=delay, min_len=min_len,
                max_len=max_len, num_train_docs=num_train_docs,
                num_eval_docs=num_eval_docs, seed=seed)
  for key, value in values.items():
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ValueError(f"delayed_copy {key} must be an int, got {value!r}.")
  if not 2 <= vocab_size <= 2**31 - 1:
    raise ValueError(f"delayed_copy vocab_size must be in [2, 2**31), got "
                     f"{vocab_size}.")
  if delay < 1:
    raise ValueError(f"delayed_copy delay must be >= 1, got {delay}.")
  if min_len < 2 or max_len < min_len:
    raise ValueError(f"delayed_copy needs 2 <= min_len <= max_len, got "
                     f"min_len={min_len}, max_len={max_len}.")
  if num_train_docs < 1 or num_eval_docs < 1:
    raise ValueError(
        f"delayed_copy needs num_train_docs >= 1 and num_eval_docs >= 1, got "
        f"{num_train_docs} and {num_eval_docs}.")
  if seed < 0:
    raise ValueError(f"delayed_copy seed must be >= 0, got {seed}.")
  name = (f"v{vocab_size}_d{delay}_l{min_len}-{max_len}_"
          f"n{num_train_docs}-{num_eval_docs}_s{seed}")
  if name in _CONFIGS:
    return _CONFIGS[name]
  _CONFIGS[name] = DelayedCopyConfig(
      name=name,
      description=(f"vocab {vocab_size}, delay {delay}, lengths "
                   f"{min_len}..{max_len}, {num_train_docs} train / "
                   f"{num_eval_docs} validation documents, seed {seed}"),
      **{k: int(v) for k, v in values.items()})
  return _CONFIGS[name]


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


class DelayedCopy(tfds.core.GeneratorBasedBuilder):
  """Delayed-copy documents: t[i] = t[i - delay] after i.i.d. heads."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  BUILDER_CONFIGS = [make_config()]

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # TFDS's own lookup needs the `importlib_resources` backport for modules
    # inside a package; the file path is all it uses it for.
    return epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__.split("\n\n")[1],
        features=tfds.features.FeaturesDict({
            "tokens": tfds.features.Tensor(
                shape=(None,), dtype=np.int32,
                encoding=tfds.features.Encoding.BYTES),
            "loss_mask": tfds.features.Tensor(
                shape=(None,), dtype=np.bool_,
                encoding=tfds.features.Encoding.BYTES),
        }),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing is downloaded.
    return {split: self._generate_examples(split) for split in SPLITS}

  def _generate_examples(self, split: str):
    yield from generate(self.builder_config, split)
