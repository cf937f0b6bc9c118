"""LangChain's standard chat-model test suites (`langchain-tests`) on `AgentCacheChatModel`, with a
tiny random-weight runtime. What the runtime cannot do is declared the way the suites read it
(no tool calls, structured output, JSON mode or non-text inputs; one model per runtime), so those
tests skip; every other test of both suites runs."""

from __future__ import annotations

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from agentcache.runtime import Runtime, RuntimeConfig
from agentcache_langgraph import AgentCacheChatModel
from tests.conftest import make_engine


@pytest.fixture(scope="module")
def shared_runtime() -> Runtime:
    return Runtime(make_engine("tiny-llama", pool_blocks=512), config=RuntimeConfig(self_check=False))


class _Declared:
    """What both suites need to know about the model."""

    @pytest.fixture(autouse=True)
    def _runtime(self, shared_runtime: Runtime) -> None:
        self._shared_runtime = shared_runtime

    @property
    def chat_model_class(self) -> type[AgentCacheChatModel]:
        return AgentCacheChatModel

    @property
    def chat_model_params(self) -> dict:
        return {"runtime": self._shared_runtime}

    has_tool_calling = False
    has_tool_choice = False
    has_structured_output = False
    supports_json_mode = False
    supports_image_inputs = False
    supports_image_urls = False
    supports_pdf_inputs = False
    supports_audio_inputs = False
    supports_video_inputs = False
    supports_image_tool_message = False
    supports_pdf_tool_message = False
    supports_anthropic_inputs = False
    supports_model_override = False
    returns_usage_metadata = True


class TestAgentCacheChatModelUnit(_Declared, ChatModelUnitTests):
    pass


class TestAgentCacheChatModelIntegration(_Declared, ChatModelIntegrationTests):
    pass
