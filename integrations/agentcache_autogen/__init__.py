"""agentcache for AutoGen: a `ChatCompletionClient` (autogen-core 0.7) backed by an agentcache Runtime."""

try:
    import autogen_core  # noqa: F401
except ImportError as exc:
    raise ImportError("agentcache_autogen needs AutoGen (autogen-core and autogen-agentchat 0.7): install the extra "
                      "with pip install 'agentcache[autogen]' (scripts/setup.sh does)") from exc

from agentcache_autogen.client import (
    DEFAULT_AGENT,
    SELECTOR,
    AgentCacheChatCompletionClient,
    Caller,
    UnsupportedMessageError,
    UnsupportedRequestError,
)

from agentcache_autogen.config import AgentCacheClientConfig

__all__ = ["AgentCacheChatCompletionClient", "AgentCacheClientConfig", "Caller", "DEFAULT_AGENT", "SELECTOR",
           "UnsupportedMessageError", "UnsupportedRequestError"]
