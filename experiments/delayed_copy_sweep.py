r"""Delayed-copy sweep: steps to 99% eval accuracy per architecture and delay.

  python -m experiments.delayed_copy_sweep                    # quick
  python -m experiments.delayed_copy_sweep --num_steps=2000 --delays=8,32,128

Table 1 trains the `ling3_tiny` model as the hybrid (KKKM), KDA-only (KKKK)
and MLA-only (MMMM) at each delay and reports the first eval step with
accuracy >= `--target` (each run stops there, or after `--num_steps`).
Table 2 trains the hybrid for the whole budget at `--reset_delay` on packed
rows with `data.reset_at_document_boundaries` on (KDA state, short conv, MLA
mask and positions restart at every document) and off (each row is one
sequence): the reset-on vs reset-off comparison.

Per delay, documents are `2*delay .. 4*delay` tokens long (short documents
are packed several to a row) and rows are `max(128, 4*delay)` tokens, with
about 512 tokens per batch. Each run has its own workdir under `--workdir`;
an existing finished run is reused (delete the directory to rerun).

The runs use `--variant` of ling3_tiny, by default `dense` (a dense SwiGLU
in every layer): the sweep compares sequence mixers, and the MoE's masked
dense `ragged_dot` on CPU would only slow every run down alike. Pass
`--variant=` for the default MoE model.
"""

import os
import time
from typing import Any

from absl import app, flags, logging

from configs import ling3_tiny
from kda_lm import logs
from kda_lm.train import loop as train_loop
from kda_lm.train import metrics

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/delayed_copy_sweep",
                               "Parent directory of the runs.")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 300,
                                  "Step budget per run.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 25, "Steps between evals.")
_DELAYS = flags.DEFINE_list("delays", ["8", "32", "128"], "Copy delays.")
_PATTERNS = flags.DEFINE_list("patterns", ["KKKM", "KKKK", "MMMM"],
                              "attention_pattern values.")
_RESET_DELAY = flags.DEFINE_integer(
    "reset_delay", 8, "Delay of the reset on/off comparison (0: skip).")
_TARGET = flags.DEFINE_float("target", 0.99, "Eval accuracy to reach.")
_TOKENS_PER_BATCH = flags.DEFINE_integer("tokens_per_batch", 512,
                                         "batch_size x seq_len.")
_SEED = flags.DEFINE_integer("seed", 0, "train.seed of every run.")
_VARIANT = flags.DEFINE_string(
    "variant", "dense", "ling3_tiny variant(s) of every run ('' = default).")

_NAMES = {"KKKM": "hybrid", "KKKK": "KDA-only", "MMMM": "MLA-only"}


def make_config(pattern: str, delay: int, *, reset: bool = True,
                stop: bool = True, num_steps: int = 300, eval_every: int = 25,
                target: float = 0.99, tokens_per_batch: int = 512,
                seed: int = 0, data_dir: str | None = None,
                variant: str = "dense") -> Any:
  """The ling3_tiny config of one sweep run.

  Args:
    pattern: `model.attention_pattern`.
    delay: `data.delay`.
    reset: `data.reset_at_document_boundaries`.
    stop: stop at `target` eval accuracy (else run all steps).
    num_steps: step budget.
    eval_every: steps between evals.
    target: stop at this eval accuracy.
    tokens_per_batch: `batch_size * seq_len`.
    seed: `train.seed`.
    data_dir: shared TFDS dir.
    variant: the `ling3_tiny.get_config` argument.

  Returns:
    The config.
  """
  config = ling3_tiny.get_config(variant)
  config.model.attention_pattern = pattern
  data = config.data
  data.delay = delay
  data.seq_len = max(128, 4 * delay)
  data.min_len = 2 * delay
  data.max_len = min(4 * delay, data.seq_len + 1)
  data.batch_size = max(1, tokens_per_batch // data.seq_len)
  data.reset_at_document_boundaries = reset
  data.num_eval_docs = 128
  if data_dir:
    data.data_dir = data_dir
  config.opt.decay_steps = num_steps
  config.train.num_steps = num_steps
  config.train.log_every = eval_every
  config.train.seed = seed
  if stop:
    config.train.stop_at_eval_accuracy = target
  config.train.progress_bar = False
  config.eval.every_steps = eval_every
  config.checkpoint.enabled = False
  return config


def run(name: str, config: Any) -> dict[str, Any]:
  """Trains one run (or reuses a finished one) and summarises it."""
  workdir = os.path.join(_WORKDIR.value, name)
  rows = metrics.read_metrics(workdir)
  if not rows:
    start = time.time()
    train_loop.train_and_evaluate(config, workdir)
    logging.info("%s: %.0f s", name, time.time() - start)
    rows = metrics.read_metrics(workdir)
  hit = metrics.first_reaching(rows, _TARGET.value)
  evals = [r for r in rows if "eval_accuracy" in r]
  return {
      "workdir": workdir,
      "steps": None if hit is None else hit["step"],
      "wall_s": None if hit is None else hit.get("wall_s"),
      "final_accuracy": evals[-1]["eval_accuracy"] if evals else None,
      "final_loss": evals[-1]["eval_loss"] if evals else None,
      "last_step": rows[-1]["step"] if rows else 0,
  }


def _cell(result: dict[str, Any]) -> str:
  if result["steps"] is None:
    return (f"> {result['last_step']} ({result['final_accuracy']:.1%} at "
            f"the end)")
  return f"{result['steps']} ({result['wall_s']:.0f} s)"


def main(argv):
  del argv
  logs.quiet_library_logs()
  data_dir = os.path.join(_WORKDIR.value, "tfds")
  common = dict(num_steps=_NUM_STEPS.value, eval_every=_EVAL_EVERY.value,
                target=_TARGET.value,
                tokens_per_batch=_TOKENS_PER_BATCH.value,
                seed=_SEED.value, data_dir=data_dir,
                variant=_VARIANT.value)
  delays = [int(d) for d in _DELAYS.value]
  results = {}
  for delay in delays:
    for pattern in _PATTERNS.value:
      name = f"{pattern}_d{delay}"
      results[pattern, delay] = run(name, make_config(pattern, delay,
                                                      **common))
  lines = [f"Steps (wall time) to {_TARGET.value:.0%} eval accuracy, budget "
           f"{_NUM_STEPS.value} steps, eval every {_EVAL_EVERY.value}:", "",
           "| model | " + " | ".join(f"delay {d}" for d in delays) + " |",
           "| --- |" + " --- |" * len(delays)]
  for pattern in _PATTERNS.value:
    cells = [_cell(results[pattern, d]) for d in delays]
    lines.append(f"| {_NAMES.get(pattern, pattern)} ({pattern}) | "
                 + " | ".join(cells) + " |")
  if _RESET_DELAY.value:
    delay = _RESET_DELAY.value
    lines += ["", f"Hybrid (KKKM), delay {delay}, packed rows: "
              f"reset_at_document_boundaries on vs off:", "",
              "| reset | steps to target | final eval accuracy | "
              "final eval loss |", "| --- | --- | --- | --- |"]
    for reset in (True, False):
      name = f"KKKM_d{delay}_reset_{'on' if reset else 'off'}"
      result = run(name, make_config("KKKM", delay, reset=reset, stop=False,
                                     **common))
      lines.append(f"| {'on' if reset else 'off'} | {_cell(result)} | "
                   f"{result['final_accuracy']:.4f} | "
                   f"{result['final_loss']:.4f} |")
  table = "\n".join(lines)
  path = os.path.join(_WORKDIR.value, "results.md")
  with open(path, "w") as f:
    f.write(table + "\n")
  print(table)
  print(f"\nWritten to {path}")


if __name__ == "__main__":
  app.run(main)
