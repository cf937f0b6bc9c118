"""agentcache: KV-cache middleware for multi-agent LLM apps."""

from agentcache.correction import STRATEGIES, Strategy
from agentcache.engine import EmbeddedEngine, EngineConfig, ExecRequest, SamplingParams, SegmentPlan, Step
from agentcache.metrics import CallResult, JsonlSink
from agentcache.models import DEFAULT_MODEL, load_model
from agentcache.policies import EVICTION_POLICIES, make_policy
from agentcache.runtime import Runtime, RuntimeConfig
from agentcache.segments import AgentCall, Segment
from agentcache.selfcheck import CheckReport, check_model

__version__ = "0.1.0"

__all__ = [
    "AgentCall",
    "CallResult",
    "CheckReport",
    "DEFAULT_MODEL",
    "EVICTION_POLICIES",
    "EmbeddedEngine",
    "EngineConfig",
    "ExecRequest",
    "JsonlSink",
    "Runtime",
    "RuntimeConfig",
    "STRATEGIES",
    "SamplingParams",
    "Segment",
    "SegmentPlan",
    "Step",
    "Strategy",
    "check_model",
    "load_model",
    "make_policy",
]
