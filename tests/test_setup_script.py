"""scripts/setup.sh decides from its stamp whether to install: the demo's set-up wants fewer extras
than the tests', and neither may drop what the other installed. The venv's python is replaced by a
script that records each call, so the decision is checked without installing anything."""
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _project(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    for name in ("pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    calls = tmp_path / "calls.log"
    python.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n'
                      # `pip show` of an unwanted package: not installed
                      'case "$*" in *" show "*) exit 1 ;; esac\n')
    python.chmod(0o755)
    return tmp_path, calls


def _setup(root: Path, extras: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "scripts" / "setup.sh")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "AGENTCACHE_EXTRAS": extras}, timeout=60)


def _installs(calls: Path) -> list[str]:
    if not calls.exists():
        return []
    return [line for line in calls.read_text().splitlines() if " -e .[" in line]


def test_setup_installs_only_when_a_wanted_extra_is_missing_and_keeps_what_is_installed(tmp_path):
    root, calls = _project(tmp_path)
    stamp = root / ".venv" / ".setup-stamp"

    first = _setup(root, "langgraph,bench")  # the demo's set-up
    assert first.returncode == 0, first.stderr
    assert _installs(calls) == ["-m pip install --quiet -c constraints.txt -e .[bench,langgraph]"]
    assert stamp.read_text().split()[1] == "bench,langgraph"

    again = _setup(root, "bench")  # a subset of what is installed: nothing to do
    assert again.returncode == 0, again.stderr
    assert len(_installs(calls)) == 1

    more = _setup(root, "dev,langgraph")  # the tests' set-up wants more: both sets are asked for
    assert more.returncode == 0, more.stderr
    assert _installs(calls)[-1].endswith("-e .[bench,dev,langgraph]")
    assert stamp.read_text().split()[1] == "bench,dev,langgraph"

    (root / "constraints.txt").write_text((root / "constraints.txt").read_text() + "\n# moved\n")
    changed = _setup(root, "langgraph")  # the dependency files changed: installed afresh, as asked
    assert changed.returncode == 0, changed.stderr
    assert _installs(calls)[-1].endswith("-e .[langgraph]")
    assert len(_installs(calls)) == 3
