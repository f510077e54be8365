r"""Benchmarks the packed input pipeline: tokens/s and fill ratio.

For each dataset and row length it builds the dataset (first use only), runs
the training iterator exactly as training does (shuffle, repeat, pack, batch,
prefetch, numpy conversion) and reports

* tokens/s: real (non-padding) packed tokens delivered per second,
* fill: real tokens / all slots of the rows.

Then, for the text datasets at seq_len 256 (4 rows a batch), how often a
training row continues the document whose piece ended the previous row, and
how many rows are a single piece of a longer file, without (the reference)
and with the piece shuffle (`config.data.piece_shuffle_buffer`). Pieces are
recognised by their tokens (`kda_lm.testing.piece_index`).

Usage:

  python -m experiments.bench_data
  python -m experiments.bench_data --seq_lens=2048 --datasets=text_files \
      --seconds=5 --workdir=/tmp/bench_data --continuity_datasets=
"""

import os
import tempfile
import time

from absl import app, flags, logging
import ml_collections
import numpy as np

from data import pipeline
from kda_lm import testing

_DATASETS = flags.DEFINE_list(
    "datasets", ["delayed_copy", "text_files", "text_files_bpe"],
    "Datasets to benchmark (text_files_bpe: text_files, 4096-token BPE).")
_CONTINUITY_DATASETS = flags.DEFINE_list(
    "continuity_datasets", ["text_files", "text_files_bpe"],
    "Datasets whose training-stream continuity is measured (none: skip).")
_CONTINUITY_BATCHES = flags.DEFINE_integer(
    "continuity_batches", 200, "Batches of the continuity measurement.")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["2048", "8192"], "Row lengths.")
_TOKENS_PER_BATCH = flags.DEFINE_integer(
    "tokens_per_batch", 65536, "Slots per batch; batch = this // seq_len.")
_SECONDS = flags.DEFINE_float("seconds", 4.0,
                              "Measured time per configuration.")
_WORKDIR = flags.DEFINE_string(
    "workdir", os.path.join(tempfile.gettempdir(), "kda_lm_bench_data"),
    "Where the datasets are built (<workdir>/tfds).")


def data_config(name: str, seq_len: int, batch_size: int, **overrides
                ) -> ml_collections.ConfigDict:
  """`config.data` for a benchmarked dataset; `text_files_bpe` is
  `text_files` with its 4096-token BPE."""
  config = pipeline.default_config()
  config.name = "text_files" if name == "text_files_bpe" else name
  if name == "text_files_bpe":
    config.tokenizer = "bpe"
  config.seq_len = seq_len
  config.batch_size = batch_size
  config.update(overrides)
  return config


def bench(name: str, seq_len: int, *, tokens_per_batch: int, seconds: float,
          workdir: str) -> dict[str, float]:
  """Measures one configuration.

  Args:
    name: dataset name (or `text_files_bpe`).
    seq_len: row length.
    tokens_per_batch: slots per batch.
    seconds: measured time (after 2 warm-up batches).
    workdir: the datasets are built under `<workdir>/tfds`.

  Returns:
    A dict with `setup_s`, `tokens_per_s`, `fill`, `batches`.
  """
  config = data_config(name, seq_len, max(1, tokens_per_batch // seq_len))
  start = time.perf_counter()
  iterator = pipeline.make_train_iterator(config, workdir=workdir,
                                          process_index=0, process_count=1)
  for _ in range(2):
    next(iterator)
  setup = time.perf_counter() - start
  real = slots = batches = 0
  start = time.perf_counter()
  while time.perf_counter() - start < seconds:
    batch = next(iterator)
    real += int((batch["segment_ids"] > 0).sum())
    slots += batch["segment_ids"].size
    batches += 1
  elapsed = time.perf_counter() - start
  return dict(setup_s=setup, tokens_per_s=real / elapsed, fill=real / slots,
              batches=batches)


def continuity(name: str, seq_len: int, batch_size: int, batches: int,
               workdir: str) -> list[tuple[int, dict[str, float]]]:
  """Row continuity and fill of the training stream, without and with the
  piece shuffle (`piece_shuffle_buffer` 0 and its default)."""
  base = data_config(name, seq_len, batch_size)
  documents, _ = pipeline.load_documents(
      base, "train", data_dir=os.path.join(workdir, "tfds"))
  index = testing.piece_index(
      (d["tokens"] for d in documents.as_numpy_iterator()), seq_len)
  out = []
  for buffer in (0, int(base.piece_shuffle_buffer)):
    iterator = pipeline.make_train_iterator(
        data_config(name, seq_len, batch_size, piece_shuffle_buffer=buffer),
        workdir=workdir, process_index=0, process_count=1)
    rows = [{k: v[i] for k, v in batch.items()}
            for batch in (next(iterator) for _ in range(batches))
            for i in range(batch_size)]
    result = testing.row_continuity(rows, index)
    result["fill"] = float(np.mean([(r["segment_ids"] > 0).mean()
                                    for r in rows]))
    out.append((buffer, result))
  return out


def _print_continuity(workdir: str) -> None:
  seq_len, batch, batches = 256, 4, _CONTINUITY_BATCHES.value
  print(f"\nTraining-stream continuity (seq_len {seq_len}, {batch} rows a "
        f"batch, {batches} batches; reference: no piece shuffle):\n")
  print("| dataset | piece_shuffle_buffer | rows continuing the previous | "
        "rows one piece of a longer file | fill ratio |")
  print("| --- | ---: | ---: | ---: | ---: |")
  for name in _CONTINUITY_DATASETS.value:
    for buffer, r in continuity(name, seq_len, batch, batches, workdir):
      print(f"| {name} | {buffer} | {100 * r['continuing']:.1f}% | "
            f"{100 * r['single_piece']:.1f}% | {r['fill']:.3f} |")


def main(argv):
  del argv
  rows = []
  for name in _DATASETS.value:
    for seq_len in map(int, _SEQ_LENS.value):
      result = bench(name, seq_len, tokens_per_batch=_TOKENS_PER_BATCH.value,
                     seconds=_SECONDS.value, workdir=_WORKDIR.value)
      logging.info("%s %d: %s", name, seq_len, result)
      rows.append((name, seq_len, result))
  print(f"\nPacked-data throughput on {os.cpu_count()} CPU cores "
        f"({_TOKENS_PER_BATCH.value} slots per batch, "
        f"{_SECONDS.value:g} s each):\n")
  print("| dataset | seq_len | batch | packed tokens/s | fill ratio | "
        "setup s |")
  print("| --- | ---: | ---: | ---: | ---: | ---: |")
  for name, seq_len, r in rows:
    batch = max(1, _TOKENS_PER_BATCH.value // seq_len)
    print(f"| {name} | {seq_len} | {batch} | {r['tokens_per_s']:,.0f} | "
          f"{r['fill']:.3f} | {r['setup_s']:.1f} |")
  if _CONTINUITY_DATASETS.value:
    _print_continuity(_WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
