"""Shared-context KV correction (KVCMAS): low-rank factors, anchor pools, the strategies that
plan each call's shared segments (the chained corrector, KVCOMM's procedure, selective
recomputation) and their settings."""

from agentcache.correction.anchors import Anchor, AnchorBank, AnchorPool, Correction
from agentcache.correction.corrector import Corrector
from agentcache.correction.kvcomm import KVCommCorrector
from agentcache.correction.lowrank import Factors, as_rows, factorize, from_rows
from agentcache.correction.plan import PHDecision, Planned, Served, SharedContextStrategy, TokenizedCall
from agentcache.correction.selective import SelectiveCorrector
from agentcache.correction.store import Materialization, SegmentStore
from agentcache.correction.strategies import STRATEGIES, Strategy, get_strategy

__all__ = [
    "Anchor", "AnchorBank", "AnchorPool", "Correction",
    "Corrector", "KVCommCorrector", "SelectiveCorrector", "make_corrector",
    "PHDecision", "Planned", "Served", "SharedContextStrategy", "TokenizedCall",
    "Factors", "as_rows", "factorize", "from_rows",
    "Materialization", "SegmentStore",
    "STRATEGIES", "Strategy", "get_strategy",
]


def make_corrector(engine, strategy: Strategy, anchor_bytes: int, store_bytes: int) -> Corrector:
    """The strategy object that runs `strategy`'s settings: KVCOMM's procedure and selective
    recomputation have their own; every other setting runs on the chained corrector."""
    if strategy.kvcomm_procedure:
        kind = KVCommCorrector
    elif strategy.recompute is not None:
        kind = SelectiveCorrector
    else:
        kind = Corrector
    return kind(engine, strategy, anchor_bytes, store_bytes)
