"""LangGraph adapter for agentcache.

    from agentcache import Runtime
    from agentcache_langgraph import AgentCacheChatModel, agent_node

    model = AgentCacheChatModel(runtime=Runtime())

    def critic(state):  # added as graph.add_node("critic", critic): its calls run as agent "critic"
        return {"messages": [model.invoke(state["messages"])]}

Each model call runs as the agent of the innermost `@agent_node(name)` in effect, else the
model's `agent`, else the graph node it runs in, else "assistant"; in the session of the graph's
`thread_id`, with a dispatch event for CacheScout. Messages become the shared transcript layout of `agentcache.transcript`, so the
agents of one graph reuse each other's KV for the query and for each other's outputs.
"""

try:
    import langchain_core  # noqa: F401 - the chat model; LangGraph itself is read lazily, inside a graph run
except ImportError as exc:
    raise ImportError("agentcache_langgraph needs langchain-core (and LangGraph for graphs): install the extra "
                      "with pip install 'agentcache[langgraph]' (scripts/setup.sh does)") from exc

from agentcache.transcript import UnsupportedMessageError

from agentcache_langgraph.chat_model import AgentCacheChatModel, UnsupportedFeatureError
from agentcache_langgraph.nodes import agent_node, current_agent

__all__ = ["AgentCacheChatModel", "agent_node", "current_agent", "UnsupportedMessageError", "UnsupportedFeatureError"]
