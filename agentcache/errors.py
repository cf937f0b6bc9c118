"""Exceptions raised by agentcache. Each message says what was wrong and what to do."""

__all__ = [
    "AgentCacheError",
    "ModelLoadError",
    "DataLoadError",
    "SegmentError",
    "PlanError",
    "ContextLengthError",
    "KVShapeError",
    "RopeAlignmentError",
    "CapacityError",
    "TraceError",
    "InputError",
    "Preempted",
    "RequestCancelled",
    "EngineUnavailableError",
]


class AgentCacheError(Exception):
    """Base class of every error agentcache raises on purpose."""


class ModelLoadError(AgentCacheError):
    """A model name or path could not be resolved or loaded."""


class DataLoadError(AgentCacheError):
    """An evaluation data set could not be downloaded, verified or parsed."""


class SegmentError(AgentCacheError, ValueError):
    """A segment of a call is malformed (empty, bad token ids, ...)."""


class PlanError(AgentCacheError, ValueError):
    """An execution plan asks for something the engine cannot do."""


class ContextLengthError(AgentCacheError, ValueError):
    """A call (prompt plus generation budget) exceeds the model's context window."""


class KVShapeError(AgentCacheError, ValueError):
    """Given KV tensors do not match the model's layout or the segment they claim to cover."""


class RopeAlignmentError(AgentCacheError):
    """The model's rotary position scheme cannot be re-aligned exactly."""


class CapacityError(AgentCacheError, ValueError):
    """A block pool is too small for what was asked of it."""


class TraceError(AgentCacheError, ValueError):
    """A workload trace is malformed or does not match what it is replayed against."""


class InputError(AgentCacheError, ValueError, TypeError):
    """A public API was called with an argument of the wrong type or value; raised before any work.
    It is a ValueError and a TypeError too, so code catching either keeps working."""


class Preempted(AgentCacheError):
    """A low-priority request (a warm-up) gave its place to a real call; nothing it computed was cached."""


class RequestCancelled(AgentCacheError):
    """The caller cancelled the request (`ExecRequest.cancelled` was set): the engine dropped it and
    freed its blocks; nothing it computed was cached."""


class EngineUnavailableError(AgentCacheError):
    """An engine's backend (vLLM) is not installed here, or not in a version agentcache supports."""
