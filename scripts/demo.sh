#!/usr/bin/env bash
# Quickstart 1: set up .venv and run the demo.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/agentcache" demo "$@"
