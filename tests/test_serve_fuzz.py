"""Property-based fuzzing of `agentcache serve` from its own OpenAPI document (schemathesis, pinned
in the `fuzz` extra): requests the document allows and requests it does not, against a real server
on a loopback port. Whatever comes, the answer is never a 5xx and never carries a traceback.

In CI the examples are derandomized (the same ones every run, so a failure reproduces); elsewhere
each run draws new ones."""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from agentcache import __version__
from agentcache.config import RuntimeConfig
from agentcache.runtime import Runtime
from agentcache.serve import ServeConfig, ServerThread, create_app
from agentcache.serve.openapi import openapi_document
from conftest import make_engine

MODEL = "tiny-qwen2-chat"
MAX_TOKENS = 4  # what a generated request may ask for: the fuzzing is of the API, not of long replies
schema = schemathesis.openapi.from_dict(openapi_document(MODEL, __version__))


@pytest.fixture(scope="module")
def served():
    runtime = Runtime(make_engine(MODEL, pool_blocks=256), config=RuntimeConfig(self_check=False))
    with ServerThread(create_app(runtime, ServeConfig(default_max_tokens=MAX_TOKENS))) as server:
        server.root, server.runtime = server.url.removesuffix("/v1"), runtime
        yield server
    runtime.close()


def _short(body: object) -> object:
    """`body` with its token budgets capped (a dict only: other bodies are sent as they are)."""
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            if type(body.get(field)) is int and body[field] > MAX_TOKENS:
                body[field] = MAX_TOKENS
    return body


def test_the_served_document_is_the_one_fuzzed(served):
    assert httpx.get(f"{served.root}/openapi.json").json() == schema.raw_schema


@schema.parametrize()
@settings(max_examples=80, deadline=None, database=None, derandomize=os.environ.get("CI") == "true",
          suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_5xx_or_a_traceback(case, served):
    case.body = _short(case.body)
    response = case.call(base_url=served.root, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    assert "Traceback" not in response.text and 'File "' not in response.text, response.text[:500]


def test_the_fuzzing_reached_the_model(served):
    assert served.runtime.summary()["calls"] >= 10  # requests the document allows were served, not only refused
