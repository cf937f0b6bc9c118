"""agentcache for AutoGen: a `ChatCompletionClient` (autogen-core 0.7) backed by an agentcache Runtime."""

try:
    import autogen_core  # noqa: F401
except ImportError as exc:
    raise ImportError("agentcache_autogen needs AutoGen (autogen-core and autogen-agentchat 0.7): install the extra "
                      "with pip install 'agentcache[autogen]' (scripts/setup.sh does)") from exc

from agentcache_autogen.client import (
    SELECTOR,
    AgentCacheChatCompletionClient,
    Caller,
    UnsupportedMessageError,
    UnsupportedRequestError,
)

__all__ = ["AgentCacheChatCompletionClient", "Caller", "SELECTOR", "UnsupportedMessageError",
           "UnsupportedRequestError"]
