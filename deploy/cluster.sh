#!/usr/bin/env bash
# Several `agentcache serve` instances behind vllm-router, on one machine.
#
#   deploy/cluster.sh                      # 2 instances of Gemma 3 270M, the router on :8000
#   INSTANCES=3 MODEL=qwen2.5-coder-0.5b ROUTER_PORT=9000 deploy/cluster.sh
#
# Clients use http://127.0.0.1:$ROUTER_PORT/v1 and send `X-Session-ID: <session>` on every
# request: the router keeps a session on one instance (sticky_least_loaded on that header), where its
# shared context's caches live, and the instance takes it as the session. The instances share one
# anchors directory ($ANCHORS_DIR), so one that starts later is warm from its first call.
# Each instance is pinned to its share of the cores. Ctrl-C or SIGTERM stops the router, then
# drains every instance (they save their anchors) and waits for them.
#
# Settings (environment): MODEL, ENGINE (embedded|vllm), INSTANCES, FIRST_PORT (instances listen on
# FIRST_PORT, FIRST_PORT+1, ...), ROUTER_PORT, METRICS_PORT (the router's Prometheus port),
# ANCHORS_DIR, POLICY (a vllm-router policy; kv_aware makes every instance publish its prefix
# cache as KV events on EVENTS_PORT+2i, with replay on EVENTS_PORT+2i+1, and the router read them),
# PYTHON, and EXTRA_SERVE_ARGS (passed to every `agentcache serve`). Ready when it prints
# "cluster ready".
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$here/.venv/bin/python}"
ROUTER="${ROUTER:-$(dirname "$PYTHON")/vllm-router}"
MODEL="${MODEL:-gemma3-270m}"
ENGINE="${ENGINE:-embedded}"
INSTANCES="${INSTANCES:-2}"
FIRST_PORT="${FIRST_PORT:-8101}"
ROUTER_PORT="${ROUTER_PORT:-8000}"
METRICS_PORT="${METRICS_PORT:-29000}"
ANCHORS_DIR="${ANCHORS_DIR:-$here/results/cluster-anchors}"
POLICY="${POLICY:-sticky_least_loaded}"
EVENTS_PORT="${EVENTS_PORT:-5600}"
LOGS="${LOGS:-$here/results/cluster-logs}"

[[ -x "$PYTHON" ]] || { echo "cluster: no python at $PYTHON (run scripts/setup.sh first)" >&2; exit 2; }
[[ -x "$ROUTER" ]] || { echo "cluster: no vllm-router at $ROUTER (the cluster extra: scripts/setup.sh installs it)" >&2; exit 2; }
[[ "$INSTANCES" =~ ^[1-9][0-9]*$ ]] || { echo "cluster: INSTANCES must be a positive integer, got '$INSTANCES'" >&2; exit 2; }
mkdir -p "$ANCHORS_DIR" "$LOGS"

# the CPUs this script may use (a container's cpuset included; nproc would follow OMP_NUM_THREADS)
read -r -a cpus <<<"$("$PYTHON" -c 'import os; print(*sorted(os.sched_getaffinity(0)))')"
pids=()
router_pid=""
stop() {
    local status=$?
    trap - INT TERM EXIT
    [[ -n "$router_pid" ]] && kill -TERM "$router_pid" 2>/dev/null || true
    for pid in ${pids[@]+"${pids[@]}"}; do kill -TERM "$pid" 2>/dev/null || true; done  # drain, save anchors
    wait 2>/dev/null || true
    echo "cluster stopped"
    exit "$status"
}
trap stop INT TERM EXIT
# wait_for URL PID WHAT: until URL answers, while PID lives, at most 10 minutes (a model may load slowly)
wait_for() {
    local deadline=$((SECONDS + 600))
    until curl -fsS --max-time 5 "$1" >/dev/null 2>&1; do
        kill -0 "$2" 2>/dev/null || { echo "cluster: $3 exited; see $LOGS" >&2; exit 1; }
        ((SECONDS < deadline)) || { echo "cluster: $3 not ready after 10 minutes; see $LOGS" >&2; exit 1; }
        sleep 1
    done
}

urls=()
routing=(--policy "$POLICY")
for ((i = 0; i < INSTANCES; i++)); do
    events=()
    if [[ "$POLICY" == kv_aware ]]; then  # the embedded engine's block size is 16
        pub="tcp://127.0.0.1:$((EVENTS_PORT + 2 * i))" replay="tcp://127.0.0.1:$((EVENTS_PORT + 2 * i + 1))"
        events=(--kv-events-endpoint "$pub" --kv-events-replay-endpoint "$replay")
        routing+=(--kv-event-source "http://127.0.0.1:$((FIRST_PORT + i))=$pub"
                  --kv-event-replay-source "http://127.0.0.1:$((FIRST_PORT + i))=$replay")
    fi
    port=$((FIRST_PORT + i))
    # instance i gets CPUs i, i+INSTANCES, ... of the allowed ones (one each, shared round the
    # list, when there are more instances than CPUs)
    mine=()
    for ((c = i % ${#cpus[@]}; c < ${#cpus[@]}; c += INSTANCES)); do mine+=("${cpus[$c]}"); done
    list="$(IFS=,; echo "${mine[*]}")"
    OMP_NUM_THREADS="${#mine[@]}" taskset -c "$list" "$PYTHON" -m agentcache.cli serve --model "$MODEL" \
        --engine "$ENGINE" --port "$port" --anchors-dir "$ANCHORS_DIR" ${events[@]+"${events[@]}"} \
        ${EXTRA_SERVE_ARGS:-} >"$LOGS/instance-$i.log" 2>&1 &
    pids+=($!)
    urls+=("http://127.0.0.1:$port")
done

for ((i = 0; i < INSTANCES; i++)); do
    wait_for "${urls[$i]}/health" "${pids[$i]}" "instance $i"
    echo "instance $i ready at ${urls[$i]}"
done

# health checks every second, a worker out after two failures and back after one success;
# retries re-pick the worker, spaced to outlast that detection (see docs/scale_out.md)
[[ "$POLICY" == kv_aware ]] && routing+=(--kv-event-block-size 16 --kv-event-model "$MODEL")
"$ROUTER" --worker-urls "${urls[@]}" "${routing[@]}" --host 127.0.0.1 --port "$ROUTER_PORT" \
    --prometheus-host 127.0.0.1 --prometheus-port "$METRICS_PORT" \
    --health-check-interval-secs 1 --health-check-timeout-secs 3 --health-failure-threshold 2 \
    --health-success-threshold 1 --retry-max-retries 10 --retry-initial-backoff-ms 100 \
    --retry-backoff-multiplier 1.5 --retry-max-backoff-ms 2000 \
    >"$LOGS/router.log" 2>&1 &
router_pid=$!
wait_for "http://127.0.0.1:$ROUTER_PORT/v1/models" "$router_pid" "the router"
echo "cluster ready: http://127.0.0.1:$ROUTER_PORT/v1 ($INSTANCES instances of $MODEL, policy $POLICY, anchors in $ANCHORS_DIR)"
wait "$router_pid"
