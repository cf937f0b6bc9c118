"""Engines: the protocol, the embedded PyTorch engine, RoPE re-alignment, the paged block pool."""

from agentcache.engine.blocks import Block, BlockPool, CacheEvent, PoolStats, block_hash
from agentcache.engine.cache_manager import CacheManager, Lease, PrefixHit
from agentcache.engine.embedded import EmbeddedEngine, EngineConfig
from agentcache.engine.eviction import AgentAwarePolicy, EvictionPolicy, LFUPolicy, LRUPolicy
from agentcache.engine.kv import KVLayout, SegmentKV
from agentcache.engine.protocol import (
    Engine,
    ExecRequest,
    ExecResult,
    SamplingParams,
    SegmentOutcome,
    SegmentPlan,
    Step,
)
from agentcache.engine.rope import RopeAligner, rotate_keys

__all__ = [
    "Block", "BlockPool", "CacheEvent", "PoolStats", "block_hash",
    "CacheManager", "Lease", "PrefixHit",
    "EmbeddedEngine", "EngineConfig",
    "AgentAwarePolicy", "EvictionPolicy", "LFUPolicy", "LRUPolicy",
    "KVLayout", "SegmentKV",
    "Engine", "ExecRequest", "ExecResult", "SamplingParams", "SegmentOutcome", "SegmentPlan", "Step",
    "RopeAligner", "rotate_keys",
]
