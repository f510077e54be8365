"""kda-lm: hybrid MLA + KDA language models in JAX and Haiku.

Importing the package turns off XLA:CPU's experimental YNNPACK fusions
(`--xla_cpu_experimental_ynn_fusion_type=`) unless XLA_FLAGS already chooses a
value. With jaxlib 0.10.2 those fusions segfault in the backward pass of the
chunked KDA at chunk size 32 and make it 2-3x slower at every chunk size
(measured: T=2048 forward+backward 744 -> 289 ms, chunk 64, exact gates). The
flag only affects the CPU backend and must be set before JAX initialises its
backends, so import `kda_lm` before running any JAX computation.

`IMPORTED_AT` records when the package was first imported; the training
log's start-up line counts its phases from there.
"""

import os
import time

# When the package was first imported: the start-up log counts from here.
IMPORTED_AT = time.time()

_YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
if _YNN_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + f" {_YNN_FLAG}=").strip()
