#!/usr/bin/env bash
# Quickstart 2: set up .venv and run the whole test suite (slow, real-model tests included).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
# Two pytest processes: the vLLM engine's tests apart, since a vLLM engine fixes the torch thread
# count of its whole process once it starts (the other tests choose theirs).
run_pytest() {
    set +e
    "$root/.venv/bin/python" -m pytest "$@"
    local rc=$?
    set -e
    # pytest exits 5 when no test was collected (e.g. a -k filter that matches nothing): not a failure.
    if [ "$rc" -eq 5 ]; then
        echo "pytest collected no tests"
        rc=0
    fi
    return "$rc"
}
status=0
run_pytest -m "not vllm" "$@" || status=$?
run_pytest -m vllm "$@" || status=$?
exit "$status"
