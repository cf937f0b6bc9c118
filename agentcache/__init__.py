"""agentcache: KV-cache middleware for multi-agent LLM apps."""

from agentcache.engine import EmbeddedEngine, EngineConfig, ExecRequest, SamplingParams, SegmentPlan, Step
from agentcache.models import DEFAULT_MODEL, load_model

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "EmbeddedEngine",
    "EngineConfig",
    "ExecRequest",
    "SamplingParams",
    "SegmentPlan",
    "Step",
    "load_model",
]
