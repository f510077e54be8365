#!/usr/bin/env bash
# The GPU check: one prepared run of the Pallas KDA kernels on a real GPU,
# < 10 minutes on an H100/H200 with jax + CUDA installed (python3 on PATH, or
# PYTHON=...).
#
#   1. compiled correctness smoke (the GPU's default, compiled, kernels): pallas vs the
#      reference, packed segments, padding exactly 0, K=V=64        (<= 150 s)
#   2. benchmark: B=1, T=8192, H=16, K=V=128 bf16, segment_ids all ones and
#      8 documents per row, pallas (IEEE and TF32 dots) vs xla, fwd and
#      fwd+bwd, TFLOP/s and GB/s (experiments/gpu_check.py)         (<= 240 s)
#   3. the rest of tests/ops_kda_pallas_test.py, compiled           (<= 150 s)
#
# Logs go to $LOG_DIR (default /tmp/kda_gpu_check).
#
# Usage: bash experiments/gpu_check.sh

set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${LOG_DIR:-/tmp/kda_gpu_check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
# A dry run on CPU interprets the kernels (the CPU's default); BENCH_ARGS="..."
# passes flags to the benchmark.

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
"$PY" -c "import sys, jax; print(sys.version.split()[0], 'jax', \
jax.__version__, jax.devices())" 2>&1 | tee "$LOG/env.txt"

SMOKE="packed_segments or padding or head_dim_64"
PYTEST=("$PY" -m pytest tests/ops_kda_pallas_test.py -q -p no:cacheprovider
        --durations=8)

echo "== 1. compiled correctness smoke"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 "${PYTEST[@]}" -x \
  -k "$SMOKE" 2>&1 | tee "$LOG/tests_smoke.log"
smoke=${PIPESTATUS[0]}

echo "== 2. benchmark (pallas vs xla)"
# shellcheck disable=SC2086
timeout 240 "$PY" -m experiments.gpu_check ${BENCH_ARGS:-} 2>&1 | tee "$LOG/bench.md"
bench=${PIPESTATUS[0]}

echo "== 3. remaining pallas tests, compiled"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 "${PYTEST[@]}" \
  -k "not ($SMOKE)" 2>&1 | tee "$LOG/tests_rest.log"
rest=${PIPESTATUS[0]}
echo "== 3b. FLA golden fixture through impl=pallas, compiled"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 "$PY" -m pytest \
  tests/ops_kda_golden_test.py -q -p no:cacheprovider -k "golden and pallas" \
  2>&1 | tee "$LOG/tests_golden.log"
[ "${PIPESTATUS[0]}" = 0 ] || rest=1

echo "== exit codes (124 = timed out): smoke=$smoke bench=$bench rest=$rest"
[ "$smoke" = 0 ] && [ "$bench" = 0 ] && [ "$rest" = 0 ]
