"""What the tests and the experiments measure with; never the library.

* `numerics`: the error metric `rel_err` (an L2 ratio in float64) and the
  numpy logistic functions.
* `kda_cases`: random KDA op inputs in FLA's test distributions, their
  cotangents, document ids, and the op's float64 oracle `kda_float64`.
* `corpora`: generated documents for the corpus-source tests and the
  row-continuity measurement of packed streams.
* `hlo_flops`: the matmul FLOPs of a compiled program's optimized HLO
  text, every loop's body times its trip count, and what of them is
  recompute (`python -m experiments.hlo_flops` prints them for saved HLO).
* `compile_report`: what XLA and ptxas report about compiled GPU kernels,
  the compile check's limits, and the bytes of a compiled step's
  collectives (HLO text parsing).
* `profile_summary`: a compiled program's device time per model part, from
  a `jax.profiler` trace.
* `timing`: the benchmarks' median call time and reference matmul rate.

Imported by `tests/` and `experiments/`; nothing in `kda_lm/` or `data/`
imports it. May import: the library (`kda_lm`, `data`), never `configs/`,
`experiments/` or the tests' own modules (`tests/architecture_test.py`
checks both). Test-only support (fixtures, tiny configs, compiled test
calls) lives in `tests/`.
"""
