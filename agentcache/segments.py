"""What adapters hand the runtime: agent calls made of PF and PH segments (KVCMAS Eq. 1), and the
dispatch event that says which agent of which framework and session runs now."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from agentcache.errors import InputError, PlanError

__all__ = ["Segment", "AgentCall", "DispatchEvent", "output_slot", "output_author", "MAX_TOKEN_ID"]

MAX_TOKEN_ID = 2**31 - 1  # no vocabulary is larger; engines check their own size


class _Validated(BaseModel):
    """A pydantic model whose bad input raises InputError with one line per problem, naming the field."""

    def __init__(self, **data) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            problems = "; ".join(
                ".".join([type(self).__name__, *(str(p) for p in e["loc"])]) + ": " + e["msg"].removeprefix("Value error, ")
                for e in exc.errors(include_url=False)
            )
            raise InputError(problems) from None


def _optional_name(value: str | None, what: str) -> str | None:
    if value is not None and not value.strip():
        raise ValueError(f"{what} must be a non-empty string or None (the default), got {value!r}")
    return value


def output_slot(agent: str) -> str:
    """The slot of an agent's output as other agents read it."""
    return f"out:{agent}"


def output_author(slot: str) -> str | None:
    """The agent whose output `slot` is (`output_slot`'s inverse); None for any other slot."""
    return slot.removeprefix("out:") if slot.startswith("out:") else None


class Segment(_Validated):
    """PF: agent-specific text (always exact). PH: shared content, read through its `slot`."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["pf", "ph"]
    text: str | None = None
    token_ids: tuple[StrictInt, ...] | None = None  # given instead of text, already tokenized
    slot: str | None = None
    source: str | None = None  # PH only: read the materialization this agent made (a fan-out edge)

    @model_validator(mode="after")
    def _check(self) -> "Segment":
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("a segment needs exactly one of `text` or `token_ids`")
        if self.text is not None and self.text == "":
            raise ValueError(f"{self.kind.upper()} segment text is empty; a segment must have content")
        if self.token_ids is not None and len(self.token_ids) == 0:
            raise ValueError(f"{self.kind.upper()} segment has no token ids; a segment must have content")
        if self.token_ids is not None:
            bad = [t for t in self.token_ids if not 0 <= t <= MAX_TOKEN_ID]
            if bad:
                raise ValueError(f"token ids {bad[:3]} are outside [0, {MAX_TOKEN_ID}]; pass the model's token ids")
        if self.kind == "ph" and not self.slot:
            raise ValueError("a PH (shared) segment needs a slot name, e.g. 'query' or 'out:<agent>'")
        if self.kind == "pf" and (self.slot is not None or self.source is not None):
            raise ValueError("a PF (agent-specific) segment has no slot or source; use kind='ph' for shared content")
        return self

    @classmethod
    def pf(cls, text: str) -> "Segment":
        return cls(kind="pf", text=text)

    @classmethod
    def ph(cls, slot: str, text: str, source: str | None = None) -> "Segment":
        """Shared content. `source` names the agent whose cache of it to start from (the producer of a
        fan-out); by default the latest agent that materialized it (the previous hop of a chain)."""
        return cls(kind="ph", slot=slot, text=text, source=source)

    @property
    def name(self) -> str:
        return self.slot if self.kind == "ph" else "pf"


class AgentCall(_Validated):
    """One LLM call of one agent: `[PF_sys, PH_q, PF_glue, PH_out, ...]`."""

    model_config = ConfigDict(frozen=True)

    agent: str
    segments: tuple[Segment, ...]
    session: str | None = None  # calls of one session share materializations and agents' outputs
    tenant: str | None = None  # sessions of one tenant share anchors; None: the runtime's default tenant

    @field_validator("session", "tenant")
    @classmethod
    def _scope_names(cls, value: str | None, info) -> str | None:
        return _optional_name(value, info.field_name)

    @field_validator("agent")
    @classmethod
    def _agent_name(cls, value: str) -> str:
        if not value or not value.strip():
            raise ValueError("an agent call needs a non-empty agent name")
        if value.startswith("<"):
            raise ValueError(f"agent names starting with '<' are reserved, got {value!r}")
        return value

    @field_validator("segments")
    @classmethod
    def _some_segments(cls, value: tuple[Segment, ...]) -> tuple[Segment, ...]:
        if not value:
            raise ValueError("an agent call needs at least one segment")
        return value

    @staticmethod
    def checked(value: object, where: str) -> "AgentCall":
        """`value` when it is an AgentCall; otherwise an InputError naming `where`."""
        if not isinstance(value, AgentCall):
            raise InputError(f"{where} takes an AgentCall, got {type(value).__name__}")
        return value


class DispatchEvent(_Validated):
    """An adapter's word that `agent` runs now (CacheScout's dispatch). The runtime checks it
    against the call it comes with, keeps it in `Runtime.events`, and the call's agent and
    session reach the eviction policy and the warm-up coordinator."""

    model_config = ConfigDict(frozen=True)

    agent: str
    session: str | None = None
    framework: str  # "autogen", "langgraph", "runtime", ...
    caller: str | None = None  # the framework's own id of the caller (an AutoGen agent id, a graph node)
    messages: int = Field(default=0, ge=0)  # messages the framework handed the model
    at: float = Field(default_factory=time.time)  # wall clock, seconds

    @field_validator("agent", "framework")
    @classmethod
    def _named(cls, value: str) -> str:
        if not value or not value.strip():
            raise ValueError("a dispatch event needs a non-empty agent and framework")
        return value

    @staticmethod
    def checked_for(value: object, call: AgentCall) -> "DispatchEvent | None":
        """`value` (None, or a DispatchEvent naming `call`'s agent and session); else an error."""
        if value is None:
            return None
        if not isinstance(value, DispatchEvent):
            raise InputError(f"event must be a DispatchEvent, got {type(value).__name__}")
        if (value.agent, value.session) != (call.agent, call.session):
            raise PlanError(f"dispatch event for agent {value.agent!r} (session {value.session!r}) does not "
                            f"match the call of agent {call.agent!r} (session {call.session!r})")
        return value
