#!/usr/bin/env bash
# The GPU check of docs/gpu.md, on a machine that has python3 with torch (CUDA), transformers,
# numpy, safetensors and tokenizers but none of agentcache's other dependencies, and no network.
#
# Here (with network), once:   bash scripts/gpu_check.sh --fetch-wheels
#   downloads the cp312 wheels agentcache needs beside those into .whl/ (git-ignored; ~2.5 MB).
# There, from the repository root (the folder .whl/ carried along):   bash scripts/gpu_check.sh
#   installs them into /tmp/site and runs benchmarks/gpu.py, writing its JSON to $OUT (or results/).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
wheels=(pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0)

if [ "${1:-}" = "--fetch-wheels" ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${wheels[@]}"
    ls .whl
    exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$root" PYTHONUNBUFFERED=1
out="${OUT:-results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
python3 benchmarks/gpu.py "$@" --out "$out/gpu.json" 2> "$out/gpu.log"
