r"""Does resetting at document boundaries help? A small controlled study.

Trains the ling3_tiny hybrid (KKKM, MoE) on `:text` (4096-token BPE of the
standard library's `.py` files) with `config.data.reset_at_document_
boundaries` on and off, the same seeds (model init and data order) and the
same number of tokens, then evaluates every model on the same held-out
files:

* per document: each file alone in its row (its first `--eval_len`
  tokens; longer files are cut there, and the table says so), with the mean
  loss over positions in the document: [0, 64), [64, 512) and
  [512, eval_len);
* packed: the same tokens packed into training-length rows the way the
  model was trained (segment resets on or off).

Losses are nats per token and bits per byte (the BPE tokens' UTF-8 bytes),
mean and standard deviation over seeds, and the paired difference
(on - off, same seed). All runs share one compiled training step.

  python -m experiments.reset_study
  python -m experiments.reset_study --steps=20 --seeds=1   # a quick look
"""

import dataclasses
import math
import os
import tempfile
import time
from typing import Any, Sequence

from absl import app, flags, logging
import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tensorflow as tf

import kda_lm  # noqa: F401  # isort: skip  (first: XLA:CPU flags)
from configs import ling3_tiny
from data import packing, pipeline
from kda_lm import config as config_lib
from kda_lm import model as model_lib
from kda_lm import optimizer
from kda_lm.infer import evaluate
from kda_lm.train import state as state_lib
from kda_lm.train import step as step_lib

_STEPS = flags.DEFINE_integer("steps", 160, "Training steps per run.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per condition.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 512, "Training row length.")
_BATCH = flags.DEFINE_integer("batch_size", 2, "Training rows per step.")
_EVAL_DOCS = flags.DEFINE_integer("eval_docs", 64,
                                  "Held-out files evaluated.")
_EVAL_LEN = flags.DEFINE_integer(
    "eval_len", 1024, "Tokens scored per held-out file (its first ones).")
_OUT = flags.DEFINE_string(
    "out_dir", os.path.join(tempfile.gettempdir(), "kda_lm_reset_study"),
    "Data (<workdir>/tfds), table and plot.")

BUCKETS = ((0, 64), (64, 512), (512, None))
_EVAL_ROWS = 8


@dataclasses.dataclass(frozen=True)
class Setting:
  """What the study runs: config, steps, seeds, held-out evaluation."""
  config: ml_collections.ConfigDict
  steps: int
  seeds: Sequence[int]
  eval_docs: int
  eval_len: int
  data_dir: str


def study_config(seq_len: int, batch_size: int) -> ml_collections.ConfigDict:
  """ling3_tiny:text with the study's row length and batch."""
  config = ling3_tiny.get_config("text")
  config.data.seq_len = seq_len
  config.data.batch_size = batch_size
  return config


class Compiled:
  """The jitted init, update and per-token loss, shared by all runs."""

  def __init__(self, config: ml_collections.ConfigDict, steps: int):
    cfg = config_lib.check_config(config)
    model = model_lib.build(cfg.model)
    tx, schedule = optimizer.make_optimizer(cfg.opt, steps)
    self.init = jax.jit(state_lib.make_init_fn(model, tx, cfg.data.seq_len))
    self.update = jax.jit(
        step_lib.make_update_fn(model, tx, schedule, cfg.model),
        donate_argnums=0)

    def token_loss(params: hk.Params, batch: Any) -> jax.Array:
      logits = model.apply(params, batch["inputs"], batch["segment_ids"],
                           batch["positions"])
      ce = optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), batch["targets"])
      return ce * batch["loss_mask"]

    self.token_loss = jax.jit(token_loss)
    self.vocab_size = cfg.model.vocab_size


def _data(config, seed: int, reset: bool) -> ml_collections.ConfigDict:
  data = ml_collections.ConfigDict(config.data.to_dict())
  data.seed = seed
  data.reset_at_document_boundaries = reset
  return data


def train(compiled: Compiled, setting: Setting, seed: int, reset: bool
          ) -> tuple[hk.Params, float]:
  """One run; returns its parameters and mean loss of the last 10% steps."""
  it = pipeline.make_train_iterator(
      _data(setting.config, seed, reset), data_dir=setting.data_dir,
      process_index=0, process_count=1)
  state = compiled.init(jax.random.PRNGKey(seed))
  losses = []
  for step in range(1, setting.steps + 1):
    batch = next(it)
    step_lib.check_batch(batch, compiled.vocab_size, "a study batch")
    state, metrics = compiled.update(state, batch)
    losses.append(metrics["loss"])
    if step % 50 == 0:
      logging.info("reset=%s seed=%d step %d: loss %.4f", reset, seed, step,
                   float(losses[-1]))
  tail = max(1, setting.steps // 10)
  return state.params, float(np.mean(jax.device_get(losses[-tail:])))


def held_out(setting: Setting) -> list[np.ndarray]:
  """The first `eval_docs` validation files, each cut to `eval_len + 1`
  tokens (`eval_len` scored targets)."""
  docs, _ = pipeline.load_documents(setting.config.data, "validation",
                                    data_dir=setting.data_dir)
  out = [np.asarray(d["tokens"], np.int32)[:setting.eval_len + 1]
         for d in docs.take(setting.eval_docs).as_numpy_iterator()]
  return [d for d in out if len(d) >= 2]


def _batches(rows: list[dict[str, np.ndarray]]):
  empty = {k: np.zeros_like(v) for k, v in rows[0].items()}
  for i in range(0, len(rows), _EVAL_ROWS):
    chunk = rows[i:i + _EVAL_ROWS]
    yield evaluate._stack(chunk + [empty] * (_EVAL_ROWS - len(chunk)))  # pylint: disable=protected-access


def per_document(compiled: Compiled, params: hk.Params,
                 docs: list[np.ndarray], eval_len: int) -> np.ndarray:
  """Per-token losses `[docs, eval_len]` (NaN past a document's end)."""
  rows = [evaluate.document_rows(d, None, eval_len)[0] for d in docs]
  out = []
  for batch in _batches(rows):
    loss = np.asarray(compiled.token_loss(params, batch))
    out.append(np.where(batch["loss_mask"] > 0, loss, np.nan))
  return np.concatenate(out)[:len(docs)]


def packed(compiled: Compiled, params: hk.Params, docs: list[np.ndarray],
           seq_len: int, reset: bool, token_bytes: np.ndarray
           ) -> tuple[float, float]:
  """(nats/token, bits/byte) of the documents packed as in training."""
  dataset = tf.data.Dataset.from_generator(
      lambda: ({"tokens": d} for d in docs),
      output_signature={"tokens": tf.TensorSpec([None], tf.int32)})
  rows = list(packing.pack_documents(
      dataset, seq_len, reset_at_document_boundaries=reset)
              .as_numpy_iterator())
  nats = nbytes = tokens = 0.0
  for batch in _batches(rows):
    nats += float(np.asarray(compiled.token_loss(params, batch)).sum())
    nbytes += float((token_bytes[batch["targets"]] * batch["loss_mask"])
                    .sum())
    tokens += float(batch["loss_mask"].sum())
  return nats / tokens, nats / nbytes / math.log(2)


def summarize(loss_DT: np.ndarray, docs: list[np.ndarray],
              token_bytes: np.ndarray) -> dict[str, float]:
  """Per-document figures: overall, bits/byte and position buckets."""
  out = {"doc nats/token": float(np.nanmean(loss_DT))}
  targets = np.full(loss_DT.shape, 0, np.int64)
  for i, d in enumerate(docs):
    targets[i, :len(d) - 1] = d[1:]
  nbytes = np.where(np.isnan(loss_DT), 0, token_bytes[targets]).sum()
  out["doc bits/byte"] = float(np.nansum(loss_DT) / nbytes / math.log(2))
  for lo, hi in BUCKETS:
    part = loss_DT[:, lo:hi]
    out[bucket_name(lo, hi)] = (float(np.nanmean(part))
                                if np.isfinite(part).any() else math.nan)
  return out


def bucket_name(lo: int, hi: int | None) -> str:
  return f"pos {lo}-{hi - 1}" if hi else f"pos {lo}+"


def run_study(setting: Setting) -> tuple[list[dict[str, Any]], np.ndarray]:
  """Trains and evaluates every (condition, seed).

  Returns:
    (rows, curves): one dict of figures per run (`reset`, `seed`, losses);
    the per-position mean per-document loss `[runs, eval_len]`.
  """
  compiled = Compiled(setting.config, setting.steps)
  docs = held_out(setting)
  token_bytes = pipeline.token_bytes(setting.config.data, setting.data_dir)
  seq_len = int(setting.config.data.seq_len)
  rows, curves = [], []
  for seed in setting.seeds:
    for reset in (True, False):
      start = time.time()
      params, train_loss = train(compiled, setting, seed, reset)
      loss_DT = per_document(compiled, params, docs, setting.eval_len)
      row = {"reset": reset, "seed": seed, "train nats/token": train_loss}
      row.update(summarize(loss_DT, docs, token_bytes))
      row["packed nats/token"], row["packed bits/byte"] = packed(
          compiled, params, docs, seq_len, reset, token_bytes)
      row["seconds"] = time.time() - start
      logging.info("reset=%s seed=%d: %s", reset, seed, row)
      rows.append(row)
      curves.append(np.nanmean(loss_DT, axis=0))
  return rows, np.stack(curves)


METRICS = ("train nats/token", "doc nats/token", "doc bits/byte",
           "packed nats/token", "packed bits/byte",
           *(bucket_name(lo, hi) for lo, hi in BUCKETS))


def _stats(values: Sequence[float]) -> str:
  values = np.asarray(values, np.float64)
  std = values.std(ddof=1) if len(values) > 1 else math.nan
  return f"{values.mean():.4f} ± {std:.4f}"


def format_table(rows: list[dict[str, Any]]) -> str:
  """Markdown: mean ± std over seeds per condition and of the paired
  difference (on - off, same seed)."""
  on = [r for r in rows if r["reset"]]
  off = [r for r in rows if not r["reset"]]
  by_seed = {r["seed"]: r for r in off}
  lines = ["| metric | resets on | resets off | on - off (paired) |",
           "| --- | ---: | ---: | ---: |"]
  for m in METRICS:
    diff = [r[m] - by_seed[r["seed"]][m] for r in on if r["seed"] in by_seed]
    lines.append(f"| {m} | {_stats([r[m] for r in on])} | "
                 f"{_stats([r[m] for r in off])} | {_stats(diff)} |")
  return "\n".join(lines)


def plot(curves: np.ndarray, rows: list[dict[str, Any]], path: str) -> bool:
  """Loss by position in the document, per condition (mean over seeds);
  False when matplotlib is not installed."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  edges = np.unique(np.geomspace(1, curves.shape[1], 24).astype(int))
  centers = (edges[:-1] + edges[1:] - 1) / 2
  fig, ax = pyplot.subplots(figsize=(6, 4))
  for reset in (True, False):
    mean = curves[[r["reset"] == reset for r in rows]].mean(axis=0)
    binned = [np.nanmean(mean[a - 1:b - 1]) for a, b in
              zip(edges[:-1], edges[1:], strict=True)]
    ax.plot(centers, binned, marker="o", ms=3,
            label=f"resets {'on' if reset else 'off'}")
  ax.set_xscale("log")
  ax.set_xlabel("position in the document (tokens)")
  ax.set_ylabel("held-out loss (nats/token)")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  pyplot.close(fig)
  return True


def write_outputs(setting: Setting, rows, curves, directory: str) -> str:
  """Writes `reset_study.md` (and `reset_study.png`); returns the table."""
  os.makedirs(directory, exist_ok=True)
  tokens = setting.steps * int(setting.config.data.batch_size) * int(
      setting.config.data.seq_len)
  header = (f"{setting.steps} steps x {setting.config.data.batch_size} rows "
            f"x {setting.config.data.seq_len} tokens = {tokens:,} training "
            f"tokens per run; seeds {list(setting.seeds)}; {len(curves[0])}"
            f" scored positions of {setting.eval_docs} held-out files.\n\n")
  table = header + format_table(rows)
  png = os.path.join(directory, "reset_study.png")
  if not plot(curves, rows, png):
    table += "\n\n(matplotlib is not installed: no plot.)"
  with open(os.path.join(directory, "reset_study.md"), "w") as f:
    f.write(table + "\n")
  return table


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}.")
  workdir = os.path.abspath(_OUT.value)
  setting = Setting(
      config=study_config(_SEQ_LEN.value, _BATCH.value), steps=_STEPS.value,
      seeds=tuple(range(_SEEDS.value)), eval_docs=_EVAL_DOCS.value,
      eval_len=_EVAL_LEN.value, data_dir=os.path.join(workdir, "tfds"))
  start = time.time()
  rows, curves = run_study(setting)
  table = write_outputs(setting, rows, curves, workdir)
  print(table)
  print(f"\nWrote {workdir}/reset_study.md (and .png); "
        f"{time.time() - start:.0f} s in all.")


if __name__ == "__main__":
  app.run(main)
