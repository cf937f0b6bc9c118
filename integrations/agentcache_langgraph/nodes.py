"""Which agent is calling: the `@agent_node` decorator, and what the LangGraph run says about the call."""

from __future__ import annotations

import functools
import inspect
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

__all__ = ["agent_node", "current_agent", "NodeTag", "current_node", "graph_context"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class NodeTag:
    agent: str  # the agent the node's model calls run as
    function: str  # the decorated function's name (the caller when no graph names the node)


_current: ContextVar[NodeTag | None] = ContextVar("agentcache_langgraph_node", default=None)


def current_node() -> NodeTag | None:
    """The innermost `@agent_node` in effect, or None."""
    return _current.get()


def current_agent() -> str | None:
    """The agent name of the innermost `@agent_node` in effect, or None outside one."""
    tag = _current.get()
    return tag.agent if tag is not None else None


def agent_node(name: str) -> Callable[[F], F]:
    """Decorate a LangGraph node function so that the `AgentCacheChatModel` calls made inside it run
    as agent `name`. Sync and async functions both work; the signature stays visible (through
    `functools.wraps`), so LangGraph still injects `config`, `runtime`, `store` and the like."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"agent_node needs a non-empty agent name, got {name!r}")

    def decorate(func: F) -> F:
        if not callable(func):
            raise TypeError(f"agent_node({name!r}) decorates a function, got {type(func).__name__}")
        tag = NodeTag(agent=name, function=getattr(func, "__name__", name))

        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def async_node(*args: Any, **kwargs: Any) -> Any:
                token = _current.set(tag)
                try:
                    return await func(*args, **kwargs)
                finally:
                    _current.reset(token)

            wrapper: Any = async_node
        else:
            @functools.wraps(func)
            def node(*args: Any, **kwargs: Any) -> Any:
                token = _current.set(tag)
                try:
                    return func(*args, **kwargs)
                finally:
                    _current.reset(token)

            wrapper = node
        wrapper.agentcache_agent = name
        return wrapper

    return decorate


def graph_context() -> tuple[str | None, str | None]:
    """(thread_id, node name) of the LangGraph run this code runs in; (None, None) outside a graph."""
    try:
        from langgraph.config import get_config

        config = get_config()
    except (ImportError, RuntimeError):  # get_config raises RuntimeError outside a runnable context
        return None, None
    thread_id = (config.get("configurable") or {}).get("thread_id")
    node = (config.get("metadata") or {}).get("langgraph_node")
    return (str(thread_id) if thread_id is not None else None), (str(node) if node is not None else None)
