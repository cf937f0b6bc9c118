"""The server's settings, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

from agentcache.errors import InputError
from agentcache.serve.identity import ApiKeys

__all__ = ["ServeConfig"]


@dataclass(frozen=True)
class ServeConfig:
    model_name: str | None = None  # the model id clients name (`/v1/models`); None: the engine's model name
    api_keys: ApiKeys | None = None  # None: one local tenant, and the server binds to loopback only
    max_body_bytes: int = 4 << 20  # a larger request body is a 413
    max_prompt_tokens: int | None = None  # a longer prompt is a 400; None: the model's context
    default_max_tokens: int = 512  # the reply budget of a request that gives none (capped by the context left)
    # requests served at once (running or waiting in the engine); more are a 429 with Retry-After.
    # None: 4 x the engine's batch
    max_in_flight: int | None = None
    # of those, requests running on the runtime at once; the others wait their tenant's turn, handed
    # round robin between tenants (serve/admission.py). None: the engine's batch
    max_running: int | None = None
    # /tokenize requests served at once (tokenizing a long prompt holds a worker thread); more are a 429
    max_tokenizing: int = 2
    max_agents: int = 32  # agents per tenant with a metrics label of their own; the rest are "other"
    drain_s: float = 30.0  # on SIGTERM, how long in-flight requests may take to finish

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "default_max_tokens", "max_agents", "max_tokenizing"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InputError(f"ServeConfig.{name} must be a positive int, got {value!r}")
        for name in ("max_prompt_tokens", "max_in_flight", "max_running"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise InputError(f"ServeConfig.{name} must be a positive int or None, got {value!r}")
        if self.api_keys is not None and not isinstance(self.api_keys, ApiKeys):
            raise InputError(f"ServeConfig.api_keys must be ApiKeys or None, got {type(self.api_keys).__name__}")
        if not isinstance(self.drain_s, (int, float)) or self.drain_s < 0:
            raise InputError(f"ServeConfig.drain_s must be a number of seconds >= 0, got {self.drain_s!r}")
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name.strip()):
            raise InputError(f"ServeConfig.model_name must be a non-empty string or None, got {self.model_name!r}")
