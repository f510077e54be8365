#!/usr/bin/env bash
# Prepares (once) the deviceless compile check's environment and prints the
# command to run it with. The check runs on the repository's own Python
# environment (the `python3` on PATH, e.g. the activated .venv, which must
# already hold requirements.txt) with four compiler packages beside it:
# libtpu, jaxlib's CUDA plugin and PJRT, and ptxas
# (experiments/requirements-compile-check.txt). They are installed into a
# folder of their own, outside the repository, at $KDA_LM_COMPILE_CHECK_VENV
# (default ~/.cache/kda-lm/compile-check-venv), and only the printed command
# puts them on the path: with the CUDA plugin importable, jax probes for a
# GPU on import, so the test environment never sees them. The folder is
# rebuilt when that Python or the requirements change.
#
#   py="$(bash experiments/compile_check_env.sh)"
#   "$py" -m experiments.compile_check
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
reqs="$repo/experiments/requirements-compile-check.txt"
dir="${KDA_LM_COMPILE_CHECK_VENV:-$HOME/.cache/kda-lm/compile-check-venv}"
base="$(command -v python3)"
if ! "$base" -c "import haiku, jax, optax" 2>/dev/null; then
  echo "compile_check_env.sh: $base lacks the repository's packages;" \
       "activate its environment first (pip install -r requirements.txt)." >&2
  exit 1
fi
base="$("$base" -c "import sys; print(sys.executable)")"
stamp="$( (cat "$reqs"; echo "$base"; "$base" -c "import jax; print(jax.__version__)") \
    | sha256sum | cut -c1-16)"
if [[ ! -x "$dir/python" || "$(cat "$dir/.stamp" 2>/dev/null)" != \
      "$stamp" ]]; then
  echo "compile-check packages: installing into $dir" >&2
  rm -rf "$dir"
  mkdir -p "$dir"
  "$base" -m pip install -q --no-deps --target "$dir/site" -r "$reqs" >&2
  cat > "$dir/python" <<WRAP
#!/usr/bin/env bash
# The repository's Python with the compile check's packages first on the path.
PYTHONPATH="$dir/site\${PYTHONPATH:+:\$PYTHONPATH}" exec "$base" "\$@"
WRAP
  chmod +x "$dir/python"
  echo "$stamp" > "$dir/.stamp"
fi
echo "$dir/python"
