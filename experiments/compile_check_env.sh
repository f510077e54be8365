#!/usr/bin/env bash
# Creates (once) the virtual environment of the deviceless compile check and
# prints its python. The environment lives outside the repository, at
# $KDA_LM_COMPILE_CHECK_VENV (default ~/.cache/kda-lm/compile-check-venv),
# and is rebuilt when experiments/requirements-compile-check.txt changes.
#
#   py="$(bash experiments/compile_check_env.sh)"
#   "$py" -m experiments.compile_check
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
reqs="$repo/experiments/requirements-compile-check.txt"
venv="${KDA_LM_COMPILE_CHECK_VENV:-$HOME/.cache/kda-lm/compile-check-venv}"
stamp="$(cat "$reqs" "$repo/requirements.txt" | sha256sum | cut -c1-16)"
if [[ ! -x "$venv/bin/python" || "$(cat "$venv/.stamp" 2>/dev/null)" != \
      "$stamp" ]]; then
  echo "compile-check venv: creating $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q -r "$reqs" >&2
  echo "$stamp" > "$venv/.stamp"
fi
echo "$venv/bin/python"
