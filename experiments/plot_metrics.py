r"""Plots loss and accuracy curves of one or more runs from metrics.jsonl.

  python -m experiments.plot_metrics runs/ling3_tiny
  python -m experiments.plot_metrics runs/a runs/b --out=curves.png

Writes `<first workdir>/metrics.png` by default (two panels: train and eval
loss on a log scale, train and eval accuracy) and prints, per run, the first
step (and wall time) at which eval accuracy reached `--target`.
"""

import os
from typing import Sequence

from absl import app, flags
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=g-import-not-at-top

from kda_lm.train import metrics  # noqa: E402  pylint: disable=g-import-not-at-top

_OUT = flags.DEFINE_string("out", None,
                           "PNG path; default <first workdir>/metrics.png.")
_TARGET = flags.DEFINE_float("target", 0.99,
                             "Eval accuracy whose first step is reported.")


def _series(rows, key):
  points = [(r["step"], r[key]) for r in rows
            if isinstance(r.get(key), (int, float))]
  return [p[0] for p in points], [p[1] for p in points]


def plot(workdirs: str | Sequence[str], out: str | None = None) -> str:
  """Draws the curves of `workdirs` into a PNG.

  Args:
    workdirs: one run directory or several (one colour each).
    out: PNG path; default `<first workdir>/metrics.png`.

  Returns:
    The PNG path.

  Raises:
    FileNotFoundError: a workdir without metrics.jsonl rows.
  """
  if isinstance(workdirs, str):
    workdirs = [workdirs]
  out = out or os.path.join(workdirs[0], "metrics.png")
  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
  for i, workdir in enumerate(workdirs):
    rows = metrics.read_metrics(workdir)
    if not rows:
      raise FileNotFoundError(f"No metrics rows in {workdir}.")
    color = f"C{i}"
    label = os.path.basename(os.path.normpath(workdir))
    for ax, metric in ((ax_loss, "loss"), (ax_acc, "accuracy")):
      for key, style, name in ((metric, "-", "train"),
                               (f"eval_{metric}", "o--", "eval")):
        steps, values = _series(rows, key)
        if steps:
          ax.plot(steps, values, style, color=color, markersize=3,
                  label=f"{label} {name}")
  ax_loss.set_yscale("log")
  ax_loss.set_xlabel("step")
  ax_loss.set_ylabel("cross-entropy (nats/token, loss_mask positions)")
  ax_acc.set_xlabel("step")
  ax_acc.set_ylabel("accuracy (loss_mask positions)")
  ax_acc.set_ylim(0.0, 1.02)
  for ax in (ax_loss, ax_acc):
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def main(argv):
  workdirs = argv[1:]
  if not workdirs:
    raise app.UsageError("Give one or more workdirs.")
  path = plot(workdirs, _OUT.value)
  print(f"Wrote {path}")
  for workdir in workdirs:
    rows = metrics.read_metrics(workdir)
    hit = metrics.first_reaching(rows, _TARGET.value)
    train = [r for r in rows if "tokens_per_s" in r]
    speed = (sum(r["tokens_per_s"] for r in train) / len(train)
             if train else float("nan"))
    evals = [r for r in rows if "eval_accuracy" in r]
    final = evals[-1]["eval_accuracy"] if evals else float("nan")
    reached = ("not reached" if hit is None else
               f"step {hit['step']} ({hit.get('wall_s', float('nan')):.0f} s)")
    print(f"{workdir}: eval accuracy >= {_TARGET.value}: {reached}; final "
          f"eval accuracy {final:.4f}; mean {speed:,.0f} tokens/s")


if __name__ == "__main__":
  app.run(main)
