"""The AutoGen component config of the client, and the runtimes loaded configs run on.

`client.dump_component()` writes what builds the client again: the model, the strategy, the
engine's and the runtime's options, the client's own (agents, sampling), and the id of the runtime
it ran on. A team's agents and its selector each carry their client's config, so loading a team
loads several configs naming one runtime id; `runtime_for` gives them one runtime: the live one
with that id in this process (while that runtime object exists: see `_live`), else one built from
the options (once, for all configs of that id loaded while it lives). What a runtime holds
(caches, anchors, sessions) is never part of a config.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentcache.correction.strategies import STRATEGIES
from agentcache.engine.embedded import EmbeddedEngine, EngineConfig
from agentcache.engine.eviction import BUILTIN_POLICIES
from agentcache.errors import InputError
from agentcache.models import DEFAULT_MODEL
from agentcache.policies import EVICTION_POLICIES, make_policy
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.scout.config import ScoutConfig

__all__ = ["AgentCacheClientConfig", "DEFAULT_AGENT", "runtime_spec", "runtime_for", "remember"]

DEFAULT_AGENT = "assistant"  # who calls when neither the client nor AutoGen names an agent


class AgentCacheClientConfig(BaseModel):
    """The component config of `agentcache_autogen.AgentCacheChatCompletionClient`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(default=DEFAULT_MODEL, description="a model preset name or a local Hugging Face model directory")
    strategy: str = Field(default="kvcmas", description="kvcmas, nonshared, fullshared, ...")
    engine: dict[str, Any] = Field(default_factory=dict, description="EngineConfig options (block_size, pool_bytes, "
                                   "eviction by name: a name of agentcache.EVICTION_POLICIES, ...)")
    runtime: dict[str, Any] = Field(default_factory=dict, description="RuntimeConfig options (anchor_bytes, "
                                    "self_check, warmup, scout, ...)")
    runtime_id: str | None = Field(default=None, description="configs with one id run on one runtime; a live "
                                   "runtime of this id in this process is used as it is")
    agent: str | None = Field(default=None, description="always call as this agent")
    default_agent: str = Field(default=DEFAULT_AGENT, description="the agent when neither the client nor AutoGen "
                               "names one")
    session: str | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    stop: list[str] = Field(default_factory=list, description="stop strings added to the transcript's own")
    tool_choice: Literal["auto", "required"] = Field(default="auto", description="what a request with tools that "
                                                     "asks for 'auto' gets; 'required' forces a tool call")


def runtime_spec(runtime: Runtime) -> dict[str, Any]:
    """The config fields that build `runtime` again; refuses a runtime no config can describe."""
    engine = runtime.engine
    if not isinstance(engine, EmbeddedEngine):
        raise InputError(f"cannot write a component config for a runtime on {type(engine).__name__}: only "
                         "the embedded engine is built from a config")
    if engine.model_source is None:
        raise InputError(f"cannot write a component config for a runtime on {engine.model_name!r} loaded by the "
                         "caller: build the engine from a preset name or a model directory")
    eviction = _eviction_name(engine.config.eviction)
    if eviction is None:
        raise InputError(f"cannot write a component config for an eviction policy object "
                         f"({type(engine.config.eviction).__name__}) with settings of its own: a config names a "
                         f"policy of agentcache.EVICTION_POLICIES with its default settings")
    if runtime.requested_strategy.name not in STRATEGIES:
        raise InputError(f"cannot write a component config for the custom strategy "
                         f"{runtime.requested_strategy.name!r}; configs name a built-in strategy")
    return {
        "model": engine.model_source,
        "strategy": runtime.requested_strategy.name,
        "engine": dataclasses.asdict(dataclasses.replace(engine.config, eviction="lru")) | {"eviction": eviction},
        "runtime": dataclasses.asdict(runtime.config),
        "runtime_id": runtime.id,
    }


def _eviction_name(policy: Any) -> str | None:
    """The name in agentcache.EVICTION_POLICIES that builds `policy` again, or None when none does."""
    if isinstance(policy, str):
        return policy
    name = getattr(policy, "name", None)
    if name not in EVICTION_POLICIES:
        return None
    twin = make_policy(name)
    same = type(twin) is type(policy) and all(getattr(twin, setting, None) == getattr(policy, setting, None)
                                              for setting in ("config", "ttl"))  # the registry policies' settings
    return name if same else None


# Runtime id -> runtime, for `runtime_for`: AutoGen builds a client from its config alone, so this is
# how a loaded config finds the runtime it was written from. Held weakly: an entry lives exactly as
# long as its runtime object (its clients and the caller hold it; `Runtime.close()` does not end it),
# and no config keeps a runtime alive: one loaded after its runtime was collected builds a new one.
_live: "weakref.WeakValueDictionary[str, Runtime]" = weakref.WeakValueDictionary()
_live_lock = threading.Lock()


def remember(runtime: Runtime) -> None:
    """Configs written from `runtime` load onto it again in this process, while it lives."""
    with _live_lock:
        _live[runtime.id] = runtime


def runtime_for(config: AgentCacheClientConfig) -> Runtime:
    """The live runtime of the config's id, else a new one built from its options (and found by that
    id by the next config naming it)."""
    with _live_lock:
        found = _live.get(config.runtime_id) if config.runtime_id is not None else None
        if found is not None:
            return found
        runtime = _build(config)
        _live[config.runtime_id or runtime.id] = runtime
        return runtime


def _build(config: AgentCacheClientConfig) -> Runtime:
    options = dict(config.runtime)
    try:
        if isinstance(options.get("scout"), dict):
            options["scout"] = ScoutConfig(**options["scout"])
        runtime_config = RuntimeConfig(**options)
        engine_options = dict(config.engine)
        eviction = engine_options.get("eviction")
        if isinstance(eviction, str) and eviction not in BUILTIN_POLICIES:  # another name of EVICTION_POLICIES
            engine_options["eviction"] = make_policy(eviction)
        engine_config = EngineConfig(**engine_options)
    except TypeError as exc:  # an option that does not exist
        raise InputError(f"bad agentcache client config: {exc}") from None
    return Runtime(EmbeddedEngine(config.model, engine_config), strategy=config.strategy, config=runtime_config)
