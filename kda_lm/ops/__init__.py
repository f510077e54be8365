"""Kernels and ops: KDA and the grouped matmul.

- `chunk_kda` (`ops.kda.api`): KDA over whole rows, with its
  implementations (reference, xla, Pallas kernels) and segment resets. The
  model's KDA layer reaches it through `kda_lm.parallel.context.chunk_kda`
  (the same op, split over the `context` mesh axis when there is one);
  while decoding it runs `ops.kda.recurrent.recurrent_kda` one token at a
  time.
- `ops.gmm`: the MoE's grouped matmul (XLA loop or megablox).

May import `kda_lm.segments` only.
"""

from kda_lm.ops.kda.api import chunk_kda

__all__ = ["chunk_kda"]
