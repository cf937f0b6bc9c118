"""Bad input to the `agentcache` command: one line on stderr saying what is wrong, exit status 2, no traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentcache.cli import main
from agentcache.scout.workloads import WorkloadSpec, generate

ROOT = Path(__file__).resolve().parents[1]
HEADER = '{"agents": ["a"]}\n'


def _good_trace(tmp_path: Path) -> str:
    path = tmp_path / "good.jsonl"
    generate(WorkloadSpec(sessions=2, turns=2)).save(path)
    return str(path)


def _trace_with(text: str | bytes):
    """A setup writing `text` as the trace file; it returns the `trace replay` argv."""
    def setup(tmp_path: Path) -> list[str]:
        path = tmp_path / "bad.jsonl"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return ["trace", "replay", str(path)]
    return setup


def _prompt(token) -> str:
    return HEADER + json.dumps({"agent": "a", "session": "s", "prompt": [1, token]}) + "\n"


def _replay(*options: str):
    return lambda tmp_path: ["trace", "replay", _good_trace(tmp_path), *options]


def _argv(*argv: str):
    return lambda tmp_path: [arg.replace("TMP", str(tmp_path)) for arg in argv]


# (id, setup(tmp_path) -> argv, fragment of the one stderr line, run in a subprocess)
CASES = [
    ("check-no-model", _argv("check", "--model", "/nonexistent"), "--model '/nonexistent' is not a preset", True),
    ("record-no-model", _argv("trace", "record", "TMP/out.jsonl", "--model", "/nonexistent"), "--model '/nonexistent'", False),
    ("demo-no-model", _argv("demo", "--model", "/nonexistent"), "--model '/nonexistent'", False),
    ("serve-no-model", _argv("serve", "--model", "/nonexistent"), "--model '/nonexistent'", False),
    ("serve-open-host", _argv("serve", "--model", "tiny-llama", "--host", "0.0.0.0"), "give --api-keys FILE", False),
    ("serve-tp-embedded", _argv("serve", "--model", "tiny-llama", "--tensor-parallel-size", "2"), "needs --engine vllm",
     False),
    ("serve-events-open", _argv("serve", "--model", "tiny-llama", "--kv-events-endpoint", "tcp://*:5557"),
     "must be loopback", False),
    ("serve-events-vllm", _argv("serve", "--model", "tiny-llama", "--engine", "vllm", "--kv-events-endpoint",
                                "tcp://127.0.0.1:5557"), "vLLM publishes its own", False),
    ("serve-tp-zero", _argv("serve", "--model", "tiny-llama", "--tensor-parallel-size", "0"), "at least 1", False),
    ("serve-sync-negative", _argv("serve", "--model", "tiny-llama", "--anchors-dir", "TMP/a", "--anchor-sync-s", "-1"),
     "anchor_sync_s", False),
    ("serve-keys-missing", _argv("serve", "--model", "tiny-llama", "--api-keys", "TMP/none.json"), "none.json", False),
    ("serve-keys-not-json", lambda tmp_path: (tmp_path / "k.json").write_text("{nope") and
     ["serve", "--model", "tiny-llama", "--api-keys", str(tmp_path / "k.json")], "not JSON", False),
    ("serve-keys-short", lambda tmp_path: (tmp_path / "k.json").write_text('{"abc": "t"}') and
     ["serve", "--model", "tiny-llama", "--api-keys", str(tmp_path / "k.json")], "at least 8 characters", False),
    ("demo-no-sample", _argv("demo", "--sample", "no_such_sample"), "--sample 'no_such_sample' is not a sample", False),
    ("trace-not-utf8", _trace_with(b"\xff\xfe{}\n"), "not UTF-8", False),
    ("token-id-huge", _trace_with(_prompt(10**30)), "token id 1000000000000000000000000000000 is not an int in [0, 2**31)", False),
    ("token-id-2**31", _trace_with(_prompt(2**31)), "token id 2147483648", False),
    ("token-id-negative", _trace_with(_prompt(-1)), "token id -1", False),
    ("token-id-float", _trace_with(_prompt(1.5)), "token id 1.5", False),
    ("token-id-bool", _trace_with(_prompt(True)), "token id True", False),
    ("trace-nested", _trace_with(HEADER + "[" * 100_000 + "\n"), "line 2: JSON nested too deeply", False),
    ("trace-missing", _argv("trace", "replay", "TMP/none.jsonl"), "No such file", False),
    ("capacity-nan", _replay("--capacity", "nan"), "--capacity must be a finite positive number", False),
    ("capacity-inf", _replay("--capacity", "inf"), "--capacity must be a finite positive number", False),
    ("capacity-negative", _replay("--capacity", "-1"), "--capacity must be a finite positive number", False),
    ("block-size-zero", _replay("--block-size", "0"), "--block-size must be positive", False),
    ("topology", _argv("trace", "generate", "TMP/t.jsonl", "--topology", "nosuch"),
     "unknown topology 'nosuch'; choose one of pipeline, debate, selector, random", False),
    ("sessions", _argv("trace", "generate", "TMP/t.jsonl", "--sessions", "-1"), "sessions must be a positive int", False),
    ("turns", _argv("trace", "generate", "TMP/t.jsonl", "--turns", "0"), "turns must be a positive int", False),
    ("out-no-dir", _argv("trace", "generate", "/proc/nope/x.jsonl"), "cannot write /proc/nope/x.jsonl", True),
    ("out-is-dir", _argv("trace", "generate", "TMP"), "it is a directory", False),
    ("results-in-file", lambda tmp_path: ["bench", "scout_overhead", "--quick", "--results",
                                          _good_trace(tmp_path) + "/results"], "is a file, not a directory", False),
    ("unknown-bench", _argv("bench", "no_such_bench"), "unknown benchmark", False),
]


def _run(argv: list[str], subprocess_: bool, capsys) -> tuple[int, str]:
    if subprocess_:
        proc = subprocess.run([sys.executable, "-m", "agentcache.cli", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        return proc.returncode, proc.stderr
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("setup, fragment, subprocess_", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup, fragment, subprocess_):
    code, err = _run(setup(tmp_path), subprocess_, capsys)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentcache: error: "), err
    assert fragment in lines[0]
    assert code == 2


def test_replay_clamps_a_pool_larger_than_the_trace(tmp_path, capsys):
    assert main(["trace", "replay", _good_trace(tmp_path), "--capacity-blocks", str(10**10), "--json"]) == 0
    out = capsys.readouterr().out
    assert "clamped" in out and json.loads(out.splitlines()[-1])["capacity"] < 10**10
