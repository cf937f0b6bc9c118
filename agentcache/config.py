"""The runtime's settings, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentcache.errors import InputError
from agentcache.scout.config import ScoutConfig

__all__ = ["RuntimeConfig", "LEARN_MODES"]

LEARN_MODES = ("idle", "after_call")


@dataclass(frozen=True)
class RuntimeConfig:
    anchor_bytes: int = 2**30  # all anchor pools together
    store_bytes: int = 2**30  # materialized shared-segment caches (chain sources)
    keep_calls: int = 1000  # per-call records (`results`, `events`) kept in a ring; 0 keeps none
    max_sessions: int = 128  # sessions remembered (outputs, shared texts, sources); the oldest are forgotten
    session_entries: int = 256  # agents' outputs and shared texts kept per session
    self_check: bool = True  # verify re-alignment and correction on this model before correcting
    keep_kv: bool = False  # keep each call's KV and engine result on its CallResult (for measuring)
    warmup: bool = False  # between calls, prefill the predicted next agent's prefix (CacheScout)
    # when the strategy learns from a finished call (anchors, verification): "idle" (when no call
    # is in flight, or within a CPU budget: `agentcache.idle`) or "after_call" (before `run`
    # returns: deterministic decisions, for evaluations and tests)
    learn: str = "idle"
    # with persisted anchors (`Runtime(anchors_dir=...)`): every this many seconds, when idle, take in
    # what other instances sharing the store learned and store what this one learned; None: only
    # at the tenant's first call and on `close`
    anchor_sync_s: float | None = 30.0
    # the warm-up gate and rate limit (r_min, warmup_min_gap); the learning constants too when the
    # engine's eviction policy is not Survival (Survival brings its own ScoutConfig)
    scout: ScoutConfig = field(default_factory=ScoutConfig)

    def __post_init__(self) -> None:
        for name in ("anchor_bytes", "store_bytes", "max_sessions", "session_entries"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InputError(f"RuntimeConfig.{name} must be a positive int, got {value!r}")
        if type(self.keep_calls) is not int or self.keep_calls < 0:
            raise InputError(f"RuntimeConfig.keep_calls must be an int >= 0 (0 keeps no records), got {self.keep_calls!r}")
        if self.learn not in LEARN_MODES:
            raise InputError(f"RuntimeConfig.learn must be one of {LEARN_MODES}, got {self.learn!r}")
        if self.anchor_sync_s is not None and not (isinstance(self.anchor_sync_s, (int, float))
                                                   and not isinstance(self.anchor_sync_s, bool)
                                                   and 0 < self.anchor_sync_s < float("inf")):
            raise InputError(f"RuntimeConfig.anchor_sync_s must be a positive number of seconds or None, "
                             f"got {self.anchor_sync_s!r}")
        if not isinstance(self.scout, ScoutConfig):
            raise InputError(f"RuntimeConfig.scout must be a ScoutConfig, got {type(self.scout).__name__}")

    @staticmethod
    def checked(value: object) -> RuntimeConfig:
        """`value`, or the defaults for None; anything else is an InputError."""
        if value is None:
            return RuntimeConfig()
        if not isinstance(value, RuntimeConfig):
            raise InputError(f"Runtime(config=...) must be a RuntimeConfig, got {type(value).__name__}")
        return value
