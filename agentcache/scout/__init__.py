"""CacheScout: learn who runs next, evict and warm up accordingly.

learner.py    online transition counts, next-agent prediction, predictability R
scorer.py     threshold graph, BFS hop distances, survival scores
policies.py   TTL pinning, Survival (CacheScout), Belady eviction policies for the block pool
warmup.py     the warm-up coordinator
workloads.py  the trace format and the multi-agent workload generator
trace_replay.py  hit rates of policies on a trace, through the real block pool
recorder.py   traces from real runs of the runtime
"""

from agentcache.scout.config import ScoutConfig
from agentcache.scout.learner import TransitionLearner, prompt_fingerprint
from agentcache.scout.policies import BeladyPolicy, SurvivalPolicy, TTLPolicy
from agentcache.scout.recorder import TraceRecorder
from agentcache.scout.trace_replay import REPLAY_POLICIES, ReplayResult, replay
from agentcache.scout.scorer import SurvivalScorer
from agentcache.scout.warmup import Warmup, WarmupCoordinator
from agentcache.scout.workloads import AGENTS, TOPOLOGIES, Trace, TraceRequest, WorkloadSpec, generate

__all__ = [
    "AGENTS", "BeladyPolicy", "REPLAY_POLICIES", "ReplayResult", "ScoutConfig", "SurvivalPolicy", "SurvivalScorer",
    "TOPOLOGIES", "TTLPolicy", "Trace", "TraceRecorder", "TraceRequest", "TransitionLearner", "Warmup", "WarmupCoordinator",
    "WorkloadSpec", "generate", "prompt_fingerprint", "replay",
]
