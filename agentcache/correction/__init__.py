"""Shared-context KV correction (KVCMAS): low-rank factors, anchor pools, the chained corrector,
and the baseline strategies beside it."""

from agentcache.correction.anchors import Anchor, AnchorBank, AnchorPool, Correction
from agentcache.correction.corrector import Corrector, PHDecision
from agentcache.correction.lowrank import Factors, as_rows, factorize, from_rows
from agentcache.correction.store import Materialization, SegmentStore
from agentcache.correction.strategies import STRATEGIES, Strategy, get_strategy

__all__ = [
    "Anchor", "AnchorBank", "AnchorPool", "Correction",
    "Corrector", "PHDecision",
    "Factors", "as_rows", "factorize", "from_rows",
    "Materialization", "SegmentStore",
    "STRATEGIES", "Strategy", "get_strategy",
]
