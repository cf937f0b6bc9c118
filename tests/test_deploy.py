"""deploy/cluster.sh as the README runs it: two `agentcache serve` processes (tiny-llama) and
vllm-router on loopback ports; a session stays on one instance; SIGTERM stops the router, drains
the instances and ends the script."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
ROUTER = Path(sys.executable).with_name("vllm-router")
pytestmark = pytest.mark.skipif(not ROUTER.is_file(), reason="vllm-router is not installed (the cluster extra)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_pair() -> int:
    """A port whose next port is free too (the instances take FIRST_PORT, FIRST_PORT + 1)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two adjacent free ports")


def test_cluster_script_routes_a_session_to_one_instance_and_stops_cleanly(tmp_path):
    env = os.environ | {"PYTHON": sys.executable, "MODEL": "tiny-llama", "INSTANCES": "2",
                        "FIRST_PORT": str(free_pair()), "ROUTER_PORT": str(free_port()),
                        "METRICS_PORT": str(free_port()),
                        "ANCHORS_DIR": str(tmp_path / "anchors"), "LOGS": str(tmp_path / "logs")}
    script = subprocess.Popen(["bash", str(ROOT / "deploy" / "cluster.sh")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = script.stdout.readline()
            if not line and script.poll() is not None:
                break
            lines.append(line)
            if line.startswith("cluster ready"):
                break
        assert any(line.startswith("cluster ready") for line in lines), "".join(lines)
        url = f"http://127.0.0.1:{env['ROUTER_PORT']}/v1/chat/completions"
        body = {"model": "tiny-llama", "max_tokens": 3, "temperature": 0,
                "messages": [{"role": "system", "content": "You are the planner."},
                             {"role": "user", "content": "Plan a week of meals for four people."}]}
        served = set()
        for _ in range(3):
            reply = httpx.post(url, json=body, headers={"X-Session-ID": "team-42"}, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["agentcache"]["session"] == "team-42"
            served.add(reply.json()["agentcache"]["instance"])
        assert len(served) == 1  # the whole session on one instance
    finally:
        if script.poll() is None:
            script.send_signal(signal.SIGTERM)  # the script stops the router and drains the instances
        out, _ = script.communicate(timeout=120)
    assert "cluster stopped" in out
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("instance-*.log"))
    assert "Traceback" not in logs
