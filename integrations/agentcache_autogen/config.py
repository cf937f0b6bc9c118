"""The AutoGen component config of the client, and the runtimes loaded configs run on.

`client.dump_component()` writes what builds the client again: the model, the strategy, the
engine's and the runtime's options, the client's own (agents, sampling), and the id of the runtime
it ran on. A team's agents and its selector each carry their client's config, so loading a team
loads several configs naming one runtime id; `runtime_for` gives them one runtime: the live one
with that id in this process, else one built from the options (once, for all configs of that id).
What a runtime holds (caches, anchors, sessions) is never part of a config.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentcache.correction.strategies import STRATEGIES
from agentcache.engine.embedded import EmbeddedEngine, EngineConfig
from agentcache.errors import InputError
from agentcache.models import DEFAULT_MODEL
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
                                   "eviction by name, ...)")
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


def runtime_spec(runtime: Runtime) -> dict[str, Any]:
    """The config fields that build `runtime` again; refuses a runtime no config can describe."""
    engine = runtime.engine
    if not isinstance(engine, EmbeddedEngine):
        raise InputError(f"cannot write a component config for a runtime on {type(engine).__name__}: only "
                         "the embedded engine is built from a config")
    if engine.model_source is None:
        raise InputError(f"cannot write a component config for a runtime on {engine.model_name!r} loaded by the "
                         "caller: build the engine from a preset name or a model directory")
    if not isinstance(engine.config.eviction, str):
        raise InputError(f"cannot write a component config for an eviction policy object "
                         f"({type(engine.config.eviction).__name__}); name it: EngineConfig(eviction='survival')")
    if runtime.requested_strategy.name not in STRATEGIES:
        raise InputError(f"cannot write a component config for the custom strategy "
                         f"{runtime.requested_strategy.name!r}; configs name a built-in strategy")
    return {
        "model": engine.model_source,
        "strategy": runtime.requested_strategy.name,
        "engine": dataclasses.asdict(engine.config),
        "runtime": dataclasses.asdict(runtime.config),
        "runtime_id": runtime.id,
    }


_live: "weakref.WeakValueDictionary[str, Runtime]" = weakref.WeakValueDictionary()  # runtime id -> runtime
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
        engine_config = EngineConfig(**config.engine)
    except TypeError as exc:  # an option that does not exist
        raise InputError(f"bad agentcache client config: {exc}") from None
    return Runtime(EmbeddedEngine(config.model, engine_config), strategy=config.strategy, config=runtime_config)
