"""agentcache for AutoGen: a `ChatCompletionClient` (autogen-core 0.7) backed by an agentcache Runtime."""

from agentcache_autogen.client import (
    SELECTOR,
    AgentCacheChatCompletionClient,
    Caller,
    UnsupportedMessageError,
    UnsupportedRequestError,
)

__all__ = ["AgentCacheChatCompletionClient", "Caller", "SELECTOR", "UnsupportedMessageError",
           "UnsupportedRequestError"]
