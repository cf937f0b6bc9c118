#!/usr/bin/env bash
# Create (or refresh) the project-local virtual environment in .venv. Idempotent: a stamp
# of the dependency files skips the install when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
python="${PYTHON:-python3}"
extras="${AGENTCACHE_EXTRAS:-dev,bench,autogen,langgraph}"

if [ ! -x "$venv/bin/python" ]; then
    echo "agentcache setup: creating $venv"
    "$python" -m venv "$venv"
fi

stamp="$venv/.setup-stamp"
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1) $extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

echo "agentcache setup: installing into $venv (extras: $extras)"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# torch first, pinned to the CPU wheel, so no later resolution can pick a CUDA build.
"$venv/bin/python" -m pip install --quiet -c constraints.txt "torch==2.13.0"
"$venv/bin/python" -m pip install --quiet -c constraints.txt -e ".[$extras]"
echo "$want" > "$stamp"
