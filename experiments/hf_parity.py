r"""The parity table of docs/hf.md: kda-lm's logits against transformers'.

For each fixture in tests/testdata/hf (tiny `bailing_hybrid` and
`kimi_linear` models made by transformers, with its logits of each document
run alone; `bailing_hybrid_yarn` with YaRN RoPE scaling and attention
biases, `kimi_linear_bias` with attention biases), imports the checkpoint,
runs all documents packed in one row with `segment_ids`, and prints each
document's relative error (`testbed.numerics.rel_err`) and the largest
absolute difference.

  python -m experiments.hf_parity
"""

import os

import jax.numpy as jnp
import numpy as np

import kda_lm  # noqa: F401  # isort: skip  (first: XLA:CPU flags)
from kda_lm import hf, model
from testbed import numerics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "testdata", "hf")


NAMES = ("bailing_hybrid", "kimi_linear", "bailing_hybrid_yarn",
         "kimi_linear_bias")


def parity(name: str) -> list[tuple[int, float, float]]:
  """(length, relative error, max |diff|) per document of fixture
  `name`."""
  path = os.path.join(FIXTURES, name)
  model_config, params = hf.load_pretrained(path)
  g = np.load(os.path.join(path, "golden.npz"))
  n = sum(k.startswith("tokens_") for k in g)
  docs = [g[f"tokens_{i}"] for i in range(n)]
  ids = np.concatenate([np.full(len(d), i + 1, np.int32)
                        for i, d in enumerate(docs)])
  logits = np.asarray(model.build(model_config).apply(
      params, jnp.asarray(np.concatenate(docs))[None],
      jnp.asarray(ids)[None]))[0]
  out, start = [], 0
  for i, d in enumerate(docs):
    got, want = logits[start:start + len(d)], g[f"logits_{i}"]
    out.append((len(d), numerics.rel_err(got, want),
                float(np.abs(got - want).max())))
    start += len(d)
  return out


def main() -> None:
  print("| fixture | " + " | ".join(f"doc {i}" for i in range(4))
        + " | max abs diff |")
  for name in NAMES:
    rows = parity(name)
    cells = " | ".join(f"{e:.1e} ({n})" for n, e, _ in rows)
    print(f"| `{name}` | {cells} | {max(m for *_, m in rows):.1e} |")


if __name__ == "__main__":
  main()
