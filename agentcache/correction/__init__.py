"""Shared-context KV correction (KVCMAS): low-rank factors, anchor pools, the chained corrector,
and the baseline strategies beside it."""

from agentcache.correction.anchors import Anchor, AnchorBank, AnchorPool, Correction
from agentcache.correction.corrector import Corrector, PHDecision
from agentcache.correction.kvcomm import KVCommCorrector
from agentcache.correction.lowrank import Factors, as_rows, factorize, from_rows
from agentcache.correction.store import Materialization, SegmentStore
from agentcache.correction.strategies import STRATEGIES, Strategy, get_strategy

__all__ = [
    "Anchor", "AnchorBank", "AnchorPool", "Correction",
    "Corrector", "PHDecision", "KVCommCorrector", "make_corrector",
    "Factors", "as_rows", "factorize", "from_rows",
    "Materialization", "SegmentStore",
    "STRATEGIES", "Strategy", "get_strategy",
]


def make_corrector(engine, strategy: Strategy, anchor_bytes: int, store_bytes: int) -> Corrector:
    """The corrector that runs `strategy`: KVCOMM's procedure has one of its own."""
    kind = KVCommCorrector if strategy.kvcomm_procedure else Corrector
    return kind(engine, strategy, anchor_bytes, store_bytes)
