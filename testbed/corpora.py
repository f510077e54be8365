"""Documents and packed-stream measurements shared by the tests and the
benchmarks: generated texts for the corpus-source tests and the
row-continuity measurement of packed streams.
"""

import collections
from typing import Iterable, Sequence

import numpy as np


def corpus_texts(num: int, seed: int = 0) -> list[str]:
  """`num` distinct documents for the corpus-source tests: 1 to ~150
  characters of ASCII, accents, CJK, an emoji, newlines, tabs, quotes and
  backslashes (what JSON escapes), each ending in its index."""
  rng = np.random.default_rng(seed)
  words = ["def", "x", "café", "naïve", "名前", "データ", "🐍", "\n", "\t",
           '"q"', "\\", "a\r\nb", "   ", "{}", "[1, 2]"]
  return ["".join(rng.choice(words, int(rng.integers(0, 24))).tolist())
          + f" #{i}" for i in range(num)]


def piece_index(documents: Iterable[np.ndarray], seq_len: int
                ) -> dict[bytes, set[tuple[int, int, int]]]:
  """Maps each piece's input tokens to its `(document, piece, pieces)`.

  A piece is what the packer makes of a document: `seq_len` pairs starting
  at pair `k * seq_len`; `pieces` is the document's number of pieces.
  Identical pieces (copied files) map to every place they occur.
  """
  index = collections.defaultdict(set)
  for d, tokens in enumerate(documents):
    inputs = np.asarray(tokens, np.int32)[:-1]
    starts = range(0, len(inputs), seq_len)
    for k, start in enumerate(starts):
      index[inputs[start:start + seq_len].tobytes()].add((d, k, len(starts)))
  return index


def _segment(row: dict[str, np.ndarray], segment: int) -> bytes:
  return row["inputs"][row["segment_ids"] == segment].tobytes()


def row_continuity(rows: Sequence[dict[str, np.ndarray]],
                   index: dict[bytes, set[tuple[int, int, int]]]
                   ) -> dict[str, float]:
  """How often consecutive rows continue one document.

  Args:
    rows: consecutive packed rows (reset mode: per-document segment ids),
      each a dict of `[seq_len]` int32 arrays.
    index: `piece_index` of the split the rows come from.

  Returns:
    `continuing`: share of rows (after the first) whose first segment is the
    next piece of a document whose piece ends the previous row;
    `single_piece`: share of rows that are one piece of a document of
    several pieces.
  """
  continuing = single = 0
  previous = set()
  for row in rows:
    segments = int(row["segment_ids"].max())
    first = index.get(_segment(row, 1), set())
    continuing += any((d, k + 1, n) in first for d, k, n in previous)
    single += segments == 1 and any(n > 1 for _, _, n in first)
    previous = index.get(_segment(row, segments), set())
  return {"continuing": continuing / max(len(rows) - 1, 1),
          "single_piece": single / max(len(rows), 1)}
