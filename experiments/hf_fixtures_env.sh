#!/usr/bin/env bash
# Creates (once) the virtual environment that makes the Hugging Face golden
# fixtures and prints its python. It lives outside the repository, at
# $KDA_LM_HF_VENV (default ~/.cache/kda-lm/hf-venv), and is rebuilt when
# experiments/requirements-hf.txt changes. torch's default wheel is its CUDA
# build (several GB); it runs on CPU.
#
#   py="$(bash experiments/hf_fixtures_env.sh)"
#   "$py" -m experiments.make_hf_fixtures
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
reqs="$repo/experiments/requirements-hf.txt"
venv="${KDA_LM_HF_VENV:-$HOME/.cache/kda-lm/hf-venv}"
stamp="$(sha256sum < "$reqs" | cut -c1-16)"
if [[ ! -x "$venv/bin/python" || "$(cat "$venv/.stamp" 2>/dev/null)" != \
      "$stamp" ]]; then
  echo "hf venv: creating $venv" >&2
  rm -rf "$venv"
  python3.11 -m venv "$venv"
  "$venv/bin/python" -m pip install -q -r "$reqs" >&2
  echo "$stamp" > "$venv/.stamp"
fi
echo "$venv/bin/python"
