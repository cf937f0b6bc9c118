"""The framework recipes of docs/serve.md, run as they are written (docs/recipes/*.py) against a
real `agentcache serve` on a loopback port: each finishes, and the server names its agent as the
recipe says.

smolagents and Pydantic AI are in the `recipes` extra (they add packages without moving any of the
pinned set's), so they run everywhere. CrewAI and LlamaIndex would move it (CrewAI pins httpx and
pulls chromadb; LlamaIndex moves openai): they run with the Python of a separate environment,
`AGENTCACHE_RECIPES_PYTHON` (`bash scripts/recipes_venv.sh` makes one), and are skipped without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from agentcache.config import RuntimeConfig
from agentcache.runtime import Runtime
from agentcache.serve import ServeConfig, ServerThread, create_app
from conftest import make_engine

MODEL = "tiny-qwen2-chat"
RECIPES = Path(__file__).resolve().parents[1] / "docs" / "recipes"
OTHER_PYTHON = os.environ.get("AGENTCACHE_RECIPES_PYTHON")


@pytest.fixture(scope="module")
def served():
    runtime = Runtime(make_engine(MODEL, pool_blocks=512), config=RuntimeConfig(self_check=False))
    with ServerThread(create_app(runtime, ServeConfig(default_max_tokens=96))) as server:
        yield server
    runtime.close()


def _python(own_environment: bool) -> str:
    if own_environment:
        return sys.executable
    if not OTHER_PYTHON:
        pytest.skip("its framework's dependencies are outside the pinned set: set AGENTCACHE_RECIPES_PYTHON "
                    "to the Python of `bash scripts/recipes_venv.sh`")
    return OTHER_PYTHON


@pytest.mark.parametrize(("recipe", "agent", "own_environment"), [
    ("smolagents_recipe.py", "researcher", True),
    ("pydantic_ai_recipe.py", "planner", True),
    ("crewai_recipe.py", "guide", False),
    ("llamaindex_recipe.py", "calculator", False),
])
def test_a_recipe_runs_as_written_and_its_agent_is_named(served, recipe, agent, own_environment):
    env = {**os.environ, "AGENTCACHE_URL": served.url, "AGENTCACHE_MODEL": MODEL, "NO_COLOR": "1"}
    done = subprocess.run([_python(own_environment), str(RECIPES / recipe)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=RECIPES)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = httpx.get(served.url.removesuffix("/v1") + "/metrics").text
    assert f'agentcache_requests_total{{agent="{agent}",outcome="ok"}}' in metrics, metrics[-2000:]
