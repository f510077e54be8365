r"""Benchmarks the packed input pipeline: tokens/s and fill ratio.

For each dataset and row length it builds the dataset (first use only), runs
the training iterator exactly as training does (shuffle, repeat, pack, batch,
prefetch, numpy conversion) and reports

* tokens/s: real (non-padding) packed tokens delivered per second,
* fill: real tokens / all slots of the rows,
* vs text_files: tokens/s over the `text_files` (bytes) row of the same
  row length in the same run.

The corpus sources (`jsonl`, `jsonl_gz`, `jsonl_zst`, `parquet`, `tfds`,
and `jsonl_hf`: JSONL through the `text_files_bpe` tokenizer.json as a
released model's tokenizer) read the same documents as `text_files`: the
UTF-8 files of its default corpus (the standard library's `.py` files),
written once under `<workdir>/corpus` as one JSON line, Parquet row or TFDS
example per file; they tokenize in the pipeline.

Then, for the text datasets at seq_len 256 (4 rows a batch), how often a
training row continues the document whose piece ended the previous row, and
how many rows are a single piece of a longer file, without (the reference)
and with the piece shuffle (`config.data.piece_shuffle_buffer`). Pieces are
recognised by their tokens (`testbed.corpora.piece_index`).

Usage:

  python -m experiments.bench_data
  python -m experiments.bench_data --seq_lens=2048 --datasets=text_files \
      --seconds=5 --workdir=/tmp/bench_data --continuity_datasets=
"""

import gzip
import json
import os
import tempfile
import time

from absl import app, flags, logging
import ml_collections
import numpy as np
import pyarrow as pa
from pyarrow import parquet as pq
import tensorflow_datasets as tfds

from data import builders, pipeline, text_files
from data import tokenizer as tokenizer_lib
from testbed import corpora

_DATASETS = flags.DEFINE_list(
    "datasets", ["delayed_copy", "text_files", "text_files_bpe", "jsonl",
                 "jsonl_gz", "jsonl_zst", "parquet", "tfds", "jsonl_hf"],
    "Datasets to benchmark (text_files_bpe: text_files, 4096-token BPE; the "
    "corpus sources: see the module docstring).")
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


class BenchCorpus(builders.LocalBuilder):
  """The UTF-8 files of the default text_files corpus, one text each."""

  def _features(self):
    return {"text": tfds.features.Text()}

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    for i, text in enumerate(_corpus_texts()):
      yield i, {"text": text}


def _corpus_texts() -> list[str]:
  files = text_files.document_files(text_files.default_glob(),
                                    exclude_installed=True)
  texts = []
  for path, _ in files:
    with open(path, "rb") as f:
      text = tokenizer_lib.decode_utf8(f.read())
    if text is not None:
      texts.append(text)
  return texts


def write_corpus(workdir: str) -> str:
  """Writes the corpus files (once) under `<workdir>/corpus`; returns it."""
  root = os.path.join(workdir, "corpus")
  if os.path.exists(os.path.join(root, "done")):
    return root
  os.makedirs(root, exist_ok=True)
  texts = _corpus_texts()
  lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
  with open(os.path.join(root, "corpus.jsonl"), "wb") as f:
    f.write(lines)
  with gzip.open(os.path.join(root, "corpus.jsonl.gz"), "wb") as f:
    f.write(lines)
  with pa.CompressedOutputStream(os.path.join(root, "corpus.jsonl.zst"),
                                 "zstd") as f:
    f.write(lines)
  pq.write_table(pa.table({"text": texts}),
                 os.path.join(root, "corpus.parquet"), row_group_size=256)
  BenchCorpus(data_dir=os.path.join(workdir, "tfds"),
              file_format="tfrecord").download_and_prepare()
  open(os.path.join(root, "done"), "w").close()
  return root


def data_config(name: str, seq_len: int, batch_size: int, workdir: str = "",
                **overrides) -> ml_collections.ConfigDict:
  """`config.data` for a benchmarked dataset; `text_files_bpe` is
  `text_files` with its 4096-token BPE; the corpus sources read the files
  of `write_corpus(workdir)`."""
  config = pipeline.default_config()
  config.name = "text_files" if name == "text_files_bpe" else name
  if name == "text_files_bpe":
    config.tokenizer = "bpe"
  corpus = os.path.join(workdir, "corpus")
  files = {"jsonl": "corpus.jsonl", "jsonl_gz": "corpus.jsonl.gz",
           "jsonl_zst": "corpus.jsonl.zst", "jsonl_hf": "corpus.jsonl",
           "parquet": "corpus.parquet"}
  if name in files:
    config.name = name.split("_")[0]
    config.files = os.path.join(corpus, files[name])
  if name == "tfds":
    config.tfds_name = "bench_corpus"
  if name == "jsonl_hf":
    bpe = data_config("text_files_bpe", seq_len, batch_size)
    config.tokenizer = "hf:" + pipeline.resolve_config(
        ml_collections.ConfigDict({"data": bpe}), workdir
    ).data.tokenizer_path
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
  if name not in ("delayed_copy", "text_files", "text_files_bpe"):
    write_corpus(workdir)
  config = data_config(name, seq_len, max(1, tokens_per_batch // seq_len),
                       workdir)
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
  index = corpora.piece_index(
      (d["tokens"] for d in documents.as_numpy_iterator()), seq_len)
  out = []
  for buffer in (0, int(base.piece_shuffle_buffer)):
    iterator = pipeline.make_train_iterator(
        data_config(name, seq_len, batch_size, piece_shuffle_buffer=buffer),
        workdir=workdir, process_index=0, process_count=1)
    rows = [{k: v[i] for k, v in batch.items()}
            for batch in (next(iterator) for _ in range(batches))
            for i in range(batch_size)]
    result = corpora.row_continuity(rows, index)
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
  print("| dataset | seq_len | batch | packed tokens/s | vs text_files | "
        "fill ratio | setup s |")
  print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
  reference = {s: r["tokens_per_s"] for n, s, r in rows if n == "text_files"}
  for name, seq_len, r in rows:
    batch = max(1, _TOKENS_PER_BATCH.value // seq_len)
    ratio = (f"{r['tokens_per_s'] / reference[seq_len]:.2f}x"
             if seq_len in reference else "-")
    print(f"| {name} | {seq_len} | {batch} | {r['tokens_per_s']:,.0f} | "
          f"{ratio} | {r['fill']:.3f} | {r['setup_s']:.1f} |")
  if _CONTINUITY_DATASETS.value:
    _print_continuity(_WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
