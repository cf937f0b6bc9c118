"""Shared-context strategies: the contract (`plan`), one small class per strategy kind (a
registry), and the parts they compose: sources, acceptance policies, the correction itself,
the learner, the cost gate, anchor pools and low-rank factors."""

from agentcache.correction.anchored import AnchoredStrategy
from agentcache.correction.anchors import Anchor, AnchorBank, AnchorPool, Correction
from agentcache.correction.kvcmas import KVCMAS
from agentcache.correction.kvcomm import KVComm
from agentcache.correction.lowrank import Factors, as_rows, factorize, from_rows
from agentcache.correction.nonshared import NonShared
from agentcache.correction.plan import PHDecision, Planned, Served, SharedContextStrategy, TokenizedCall
from agentcache.correction.selective import Selective
from agentcache.correction.sourced import FullShared, SourcedStrategy
from agentcache.correction.store import Materialization, SegmentStore
from agentcache.correction.strategies import STRATEGIES, Strategy, get_strategy

__all__ = [
    "Anchor", "AnchorBank", "AnchorPool", "Correction",
    "SharedContextStrategy", "SourcedStrategy", "AnchoredStrategy",
    "NonShared", "FullShared", "KVCMAS", "KVComm", "Selective", "STRATEGY_KINDS", "make_strategy",
    "PHDecision", "Planned", "Served", "TokenizedCall",
    "Factors", "as_rows", "factorize", "from_rows",
    "Materialization", "SegmentStore",
    "STRATEGIES", "Strategy", "get_strategy",
]

# Strategy.kind -> the class that runs it
STRATEGY_KINDS: dict[str, type[SharedContextStrategy]] = {
    "nonshared": NonShared,
    "fullshared": FullShared,
    "kvcmas": KVCMAS,
    "kvcomm": KVComm,
    "cacheblend": Selective,
    "droidspeak": Selective,
}


def make_strategy(engine, settings: Strategy, anchor_bytes: int, store_bytes: int) -> SharedContextStrategy:
    """The strategy object that runs `settings` on `engine`, with its byte budgets."""
    return STRATEGY_KINDS[settings.kind](engine, settings, anchor_bytes, store_bytes)
