"""Who calls: the tenant from the API key, the agent and session from the request.

The tenant is the API key's (`ApiKeys`, read from `--api-keys FILE`); with no keys configured
there is one local tenant. A request's `cache_salt` (vLLM's field) splits the caller's tenant
further, never joins another: the salted tenant is "<tenant>#<salt>", and no configured tenant
may hold a "#".

The agent, in order: the request's `agentcache.agent` field (`extra_body`), the
`X-Agentcache-Agent` header, the `name` on the system message, the one name on the caller's own
(assistant) messages, what the first system message's fingerprint was last called by one of
those, and otherwise the fingerprint itself ("agent-<12 hex>": an unmodified client still gets one agent
per system prompt, so per role). The session: `agentcache.session`, else `X-Agentcache-Session`,
else `X-Session-ID` (the header routers such as vllm-router keep a session on one instance by),
else the tenant's default session.

Every name a client sends (agent, session, `cache_salt`) is bounded: at most `MAX_NAME_CHARS`
printable characters (no control, format or surrogate code points), else a 400 naming the field.
Names become metric labels and session keys, so a client cannot grow either by sending long ones.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from agentcache.errors import InputError
from agentcache.serve.api import ApiError, ChatRequest
from agentcache.serve.messages import Transcript

__all__ = ["ApiKeys", "Caller", "Identities", "AGENT_HEADER", "SESSION_HEADER", "ROUTER_SESSION_HEADER",
           "DEFAULT_AGENT", "METRICS_TENANT", "MAX_NAME_CHARS", "checked_name"]

AGENT_HEADER = "x-agentcache-agent"
SESSION_HEADER = "x-agentcache-session"
ROUTER_SESSION_HEADER = "x-session-id"  # vllm-router's consistent_hash and sticky policies key on it
DEFAULT_AGENT = "assistant"  # a request with no system prompt and no name
METRICS_TENANT = "metrics"  # with API keys configured, only this tenant's keys read /metrics
_ALIASES = 4096  # fingerprints remembered per server, oldest forgotten first
MAX_NAME_CHARS = 128  # in an agent, session or cache_salt name a client sends


@dataclass(frozen=True)
class Caller:
    agent: str
    session: str | None
    tenant: str | None  # None: the local tenant (no API keys configured)
    how: str  # what named the agent: "field", "header", "name", "alias", "fingerprint" or "default"


class ApiKeys:
    """API keys and the tenant each belongs to. The file is a JSON object {"<key>": "<tenant>"}."""

    def __init__(self, tenants: Mapping[str, str]) -> None:
        for key, tenant in tenants.items():
            if not isinstance(key, str) or len(key) < 8:
                raise InputError("every API key must be a string of at least 8 characters")
            if not isinstance(tenant, str) or not tenant.strip() or "#" in tenant:
                raise InputError(f"the tenant of an API key must be a non-empty name without '#', got {tenant!r}")
        if not tenants:
            raise InputError("the API keys file maps no key to a tenant")
        self._tenants = dict(tenants)

    @classmethod
    def load(cls, path: str | Path) -> "ApiKeys":
        try:
            tenants = json.loads(Path(path).read_text())
        except ValueError as exc:
            raise InputError(f"{path}: not JSON ({exc}); write {{\"<key>\": \"<tenant>\", ...}}") from None
        if not isinstance(tenants, dict):
            raise InputError(f"{path}: must hold a JSON object {{\"<key>\": \"<tenant>\", ...}}")
        return cls(tenants)

    def tenant(self, authorization: str | None) -> str:
        """The tenant of the request's `Authorization: Bearer <key>`; a 401 without a known key."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "missing API key: send the header Authorization: Bearer <key>", code="invalid_api_key")
        key = key.strip()
        found = None
        for known, tenant in self._tenants.items():  # compare every key in constant time
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        if found is None:
            raise ApiError(401, "incorrect API key", code="invalid_api_key")
        return found


class Identities:
    """Names the caller of each request; remembers which name each system-prompt fingerprint went by."""

    def __init__(self) -> None:
        self._aliases: OrderedDict[tuple[str | None, str], str] = OrderedDict()

    def caller(self, request: ChatRequest, headers: Mapping[str, str], transcript: Transcript,
               tenant: str | None) -> Caller:
        fields = request.agentcache
        session = _first_name((fields.session if fields else None, "agentcache.session"),
                              (_header(headers, SESSION_HEADER), f"header {SESSION_HEADER}"),
                              (_header(headers, ROUTER_SESSION_HEADER), f"header {ROUTER_SESSION_HEADER}"))
        if request.cache_salt is not None:
            tenant = f"{tenant or 'local'}#{checked_name(request.cache_salt, 'cache_salt')}"
        agent, how = self._agent(fields.agent if fields else None, headers, transcript, tenant, request.tools)
        checked_name(agent, _AGENT_PARAMS[how])
        if agent.startswith("<"):
            raise ApiError(400, f"agent names starting with '<' are reserved, got {agent!r}", param="agentcache.agent")
        return Caller(agent, session, tenant, how)

    def _agent(self, explicit: str | None, headers: Mapping[str, str], transcript: Transcript,
               tenant: str | None, tools: list | None) -> tuple[str, str]:
        if explicit:
            return explicit, "field"
        header = _header(headers, AGENT_HEADER)
        if header:
            return header, "header"
        if transcript.system:
            fingerprint = _fingerprint(transcript.system[0])
        else:  # no system prompt (LlamaIndex's agents without one): the tools it offers tell agents apart
            fingerprint = _fingerprint("tools:" + json.dumps(_tool_names(tools))) if tools else None
        own = transcript.own_names
        named = transcript.system_name or (next(iter(own)) if len(own) == 1 else None)
        if named:
            checked_name(named, "messages.name")  # before an alias remembers it
            if fingerprint is not None:
                self._remember((tenant, fingerprint), named)
            return named, "name"
        if fingerprint is None:
            return DEFAULT_AGENT, "default"
        alias = self._aliases.get((tenant, fingerprint))
        if alias is not None:
            self._aliases.move_to_end((tenant, fingerprint))
            return alias, "alias"
        return f"agent-{fingerprint}", "fingerprint"

    def _remember(self, key: tuple[str | None, str], name: str) -> None:
        self._aliases[key] = name
        self._aliases.move_to_end(key)
        while len(self._aliases) > _ALIASES:
            self._aliases.popitem(last=False)


_AGENT_PARAMS = {"field": "agentcache.agent", "header": f"header {AGENT_HEADER}", "name": "messages.name",
                 "alias": "messages.name", "fingerprint": "messages", "default": "messages"}


def checked_name(name: str, param: str) -> str:
    """`name` when it is a bounded, printable name; a 400 naming `param` otherwise."""
    if len(name) > MAX_NAME_CHARS:
        raise ApiError(400, f"{param} is {len(name)} characters long; names are at most {MAX_NAME_CHARS}",
                       param=param)
    if not name.isprintable():
        raise ApiError(400, f"{param} holds a control, format or surrogate character; names are printable text",
                       param=param)
    return name


def _first_name(*candidates: tuple[str | None, str]) -> str | None:
    """The first name given among (name, param) pairs, checked."""
    return next((checked_name(name, param) for name, param in candidates if name), None)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    return value.strip() if value and value.strip() else None


def _tool_names(tools: list) -> list[str]:
    """The names of the tools offered, sorted (unchecked here: the tools are read, and refused, later)."""
    functions = (tool.get("function", tool) if isinstance(tool, dict) else None for tool in tools)
    names = (function.get("name") for function in functions if isinstance(function, dict))
    return sorted(name for name in names if isinstance(name, str))


def _fingerprint(first_system: str) -> str:
    """The first system message's digest: a framework that adds a system message later (Pydantic AI's
    retry prompt, a memory note) keeps the agent it had."""
    return hashlib.sha256(first_system.encode()).hexdigest()[:12]
