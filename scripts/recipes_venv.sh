#!/usr/bin/env bash
# A separate environment for the CrewAI and LlamaIndex recipes (docs/recipes/): their dependencies
# would move agentcache's pinned set, so they are not in .venv. Then:
#   AGENTCACHE_RECIPES_PYTHON=.recipes-venv/bin/python .venv/bin/python -m pytest tests/test_serve_recipes.py
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.recipes-venv"
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "crewai==1.15.30" "llama-index-core==0.14.25" "llama-index-llms-openai-like==0.8.1"
echo "$venv/bin/python"
