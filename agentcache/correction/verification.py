"""Acceptance by verification: reuse a shared segment on an edge only while shadow runs show that
doing so gives the same output as dense prefill.

An edge (`records.Edge`) is (tenant, slot, source agent, consumer agent, whether the source is exact, the length of
the rest of the call in powers of 4): a source that was itself reused carries its own error down a
chain, and a long continuation after an approximate segment can drift where a short one did not,
so each is verified on its own. Whenever a consumer's segment is prefilled
densely while a source existed, the call's own output is the exact reference: when the engine is
idle, a *shadow run* replays the call with the segment served by each reuse method (`raw`: the
re-aligned source as it is; `corrected`: with the edge's anchor correction, learned before this
call) and compares its greedy continuation and last-position distribution with the dense call's.
A method is served on the edge while its latest verdicts (at least MIN_VERDICTS) all agree (the
one with the lowest KL when both do); a disagreement sends the edge back to dense prefill until a new verdict agrees.
While a method is served, one reused call in `audit_gap` is audited when the engine is idle: the
same prompt is replayed densely and the served output compared with it (never on a call's
critical path). The gap doubles with every agreeing audit up to MAX_AUDIT_GAP and returns to
FIRST_AUDIT_GAP on a disagreement.

This tracks what acceptance stands for (the answer the consumer gives) on any workload, where the
paper's entropy gate tracks how alike the anchors are (the `kvcmas_entropy` variant keeps it).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from agentcache.correction.records import Edge

__all__ = ["Verdict", "EdgeRecord", "Verification", "METHODS", "WINDOW", "MIN_VERDICTS", "MAX_AUDIT_GAP",
           "SHADOW_TOKENS", "CONTEXT_FREE_VERDICTS", "compare_outputs"]

METHODS = ("corrected", "raw")
WINDOW = 3  # verdicts kept per edge and method
# agreeing verdicts before a method is served: 2 halved long-document reuse over 5 workflows
# (consumer TTFT 0.37x NonShared's against 0.11x) and left greedy agreement where it was (0.958)
MIN_VERDICTS = 1
# a context-free source (a reference prefill) is further from every consumer's context than one
# made in an agent's: served as siblings' source with one verdict per edge, it changed 40% of a
# Gemma swarm's answers
CONTEXT_FREE_VERDICTS = WINDOW
FIRST_AUDIT_GAP = 2
MAX_AUDIT_GAP = 16  # at most one eligible call in 16 prefilled densely to re-verify a served method
SHADOW_TOKENS = 8  # greedy tokens a shadow run compares (fewer when the call generated fewer)


@dataclass(frozen=True)
class Verdict:
    """One shadow run: did `method` give the dense call's output?"""

    method: str
    agrees: bool
    kl: float  # KL(dense ‖ shadow) of the next-token distributions at the last prompt position
    tokens: int  # greedy tokens compared


def compare_outputs(method: str, dense_logits: torch.Tensor, dense_tokens: Sequence[int] | None,
                    shadow_logits: torch.Tensor, shadow_tokens: Sequence[int]) -> Verdict:
    """The verdict of a shadow run against the dense call. `dense_tokens`: the dense call's greedy
    continuation (None when it sampled: then only the most likely next token is compared)."""
    dense_logp = torch.log_softmax(dense_logits.double(), -1)  # (V,)
    shadow_logp = torch.log_softmax(shadow_logits.double(), -1)
    kl = float((dense_logp.exp() * (dense_logp - shadow_logp)).sum().clamp_min(0.0))
    agrees = int(dense_logits.argmax()) == int(shadow_logits.argmax()) and math.isfinite(kl)
    compared = 1
    if dense_tokens is not None:
        compared = min(len(dense_tokens), len(shadow_tokens))
        agrees = agrees and list(dense_tokens[:compared]) == list(shadow_tokens[:compared])
    return Verdict(method, agrees, kl, compared)


@dataclass
class EdgeRecord:
    """What the shadow runs of one edge said, and when it is next audited."""

    verdicts: dict[str, deque[Verdict]] = field(default_factory=dict)
    audit_gap: int = FIRST_AUDIT_GAP
    since_audit: int = 0
    updated: float = 0.0  # wall-clock time of the last verdict: instances sharing records keep the newest

    def choice(self, can_correct: bool, needed: int = MIN_VERDICTS) -> str | None:
        """The method to serve: at least `needed` verdicts kept and every one agrees, lowest mean
        KL first; None: prefill."""
        passing = []
        for method in METHODS:
            kept = self.verdicts.get(method)
            if (kept and len(kept) >= needed and all(v.agrees for v in kept)
                    and (method != "corrected" or can_correct)):
                passing.append((sum(v.kl for v in kept) / len(kept), METHODS.index(method), method))
        return min(passing)[2] if passing else None

    def due_audit(self) -> bool:
        """Count one reused call; True when this one is to be audited."""
        self.since_audit += 1
        if self.since_audit >= self.audit_gap:
            self.since_audit = 0
            return True
        return False

    def record(self, verdict: Verdict) -> None:
        kept = self.verdicts.setdefault(verdict.method, deque(maxlen=WINDOW))
        kept.append(verdict)
        self.updated = time.time()
        if not verdict.agrees:
            self.audit_gap = FIRST_AUDIT_GAP

    def audited(self, served_method_agreed: bool) -> None:
        """A dense call re-verified the method being served: audit less often while it agrees."""
        self.audit_gap = min(2 * self.audit_gap, MAX_AUDIT_GAP) if served_method_agreed else FIRST_AUDIT_GAP
        self.updated = time.time()


class Verification:
    """Every edge's record; `decide` before a call, `record` after its shadow runs."""

    def __init__(self) -> None:
        self.edges: dict[Edge, EdgeRecord] = {}
        self.shadow_runs = 0
        self.shadow_s = 0.0
        self.audits = 0  # per edge: a dense replay of a call that reused k segments counts k
        self.audit_disagreements = 0  # of those, the ones whose dense replay gave another output
        self.borrowed = 0  # edges first served a neighbouring distance's method
        self._to_audit: set[Edge] = set()  # of those, the ones whose first reused call is still to be audited
        self.agreed: dict[str, int] = {m: 0 for m in METHODS}
        self.disagreed: dict[str, int] = {m: 0 for m in METHODS}

    def decide(self, edge: Edge, can_correct: bool, needed: int = MIN_VERDICTS) -> tuple[str | None, str | None]:
        """(method, None) to reuse, or (None, "unverified"): no method agreed on the edge yet
        (`needed` verdicts at least). An edge never judged at this distance from the call's end
        (`Edge.after`) takes the method its judged neighbour one bucket nearer or farther serves
        (the same text read by the same consumer, a suffix at most four times longer or shorter:
        one agent's notes run 25 tokens in one workflow and 48 in the next), and its first such
        call is audited, which gives the edge a verdict of its own."""
        record = self.edges.get(edge)
        method = record.choice(can_correct, needed) if record is not None else None
        if method is None and not self.judged(edge):
            method = self._borrowed_choice(edge, can_correct, needed)
        return (method, None) if method is not None else (None, "unverified")

    def _borrowed_choice(self, edge: Edge, can_correct: bool, needed: int) -> str | None:
        for after in (edge.after - 1, edge.after + 1):
            neighbour = self.edges.get(replace(edge, after=after))
            method = neighbour.choice(can_correct, needed) if neighbour is not None else None
            if method is not None:
                self.borrowed += edge not in self._to_audit
                self._to_audit.add(edge)
                return method
        return None

    def judged(self, edge: Edge) -> bool:
        """Whether a shadow run (or an audit) has given the edge a verdict yet."""
        record = self.edges.get(edge)
        return record is not None and any(record.verdicts.values())

    def untested(self, edge: Edge, methods: Sequence[str]) -> list[str]:
        """Of `methods` (those a shadow run of the edge could try now), the ones that could make the
        edge serve reuse and have no verdict on it yet: none while the edge serves a method."""
        record = self.edges.get(edge)
        if record is None:
            return list(methods)
        if record.choice(can_correct="corrected" in methods) is not None:
            return []
        return [m for m in methods if not record.verdicts.get(m)]

    def serves_from(self, tenant: str | None, slot: str, source_agent: str) -> bool:
        """Whether some edge from `source_agent`'s exact materialization of `slot` serves reuse."""
        return any((edge.tenant, edge.slot, edge.source) == (tenant, slot, source_agent) and edge.exact_source
                   and record.choice(can_correct=True) for edge, record in self.edges.items())

    def audit_due(self, edge: Edge) -> bool:
        """Count one reused call on the edge; True when it is to be audited (always, the first call
        served a neighbour's method)."""
        if edge in self._to_audit:
            self._to_audit.discard(edge)
            return True
        record = self.edges.get(edge)
        return record is not None and record.due_audit()

    def record(self, edge: Edge, verdicts: Sequence[Verdict], seconds: float = 0.0, *, audit: bool = False) -> None:
        """Keep the verdicts of a shadow run (or, `audit`, of a served call's dense replay)."""
        record = self.edges.setdefault(edge, EdgeRecord())
        for verdict in verdicts:
            record.record(verdict)
            (self.agreed if verdict.agrees else self.disagreed)[verdict.method] += 1
        if audit:
            agreed = all(v.agrees for v in verdicts)
            record.audited(agreed)
            self.audits += 1
            self.audit_disagreements += not agreed
        self.shadow_runs += len(verdicts)
        self.shadow_s += seconds

    def figures(self) -> dict:
        return dict(verified_edges=len(self.edges), borrowed_edges=self.borrowed, shadow_runs=self.shadow_runs,
                    audits=self.audits,
                    audit_disagreements=self.audit_disagreements,
                    shadow_s=round(self.shadow_s, 4),
                    shadow_agreed=dict(self.agreed), shadow_disagreed=dict(self.disagreed))

    # --- persistence: plain JSON, no tensors ---------------------------------------------

    def to_json(self, tenant: str | None) -> list[dict]:
        """The records of `tenant`'s edges."""
        return [dict(slot=edge.slot, source=edge.source, consumer=edge.consumer, exact_source=edge.exact_source,
                     after=edge.after,
                     audit_gap=record.audit_gap, updated=record.updated,
                     verdicts=[dict(method=v.method, agrees=v.agrees, kl=v.kl, tokens=v.tokens)
                               for kept in record.verdicts.values() for v in kept])
                for edge, record in self.edges.items() if edge.tenant == tenant]

    def load_json(self, tenant: str | None, records: Sequence[dict], *, replace: bool = True) -> int:
        """Add `tenant`'s saved records (after validating every field); returns how many. With
        `replace` False, an edge's record is replaced only by a newer one (another instance's
        later verdicts)."""
        parsed = []
        for item in records:
            edge = Edge(tenant, str(item["slot"]), str(item["source"]), str(item["consumer"]),
                        bool(item["exact_source"]), int(item["after"]))
            record = EdgeRecord(audit_gap=min(MAX_AUDIT_GAP, max(FIRST_AUDIT_GAP, int(item["audit_gap"]))))
            for v in item["verdicts"]:
                if v["method"] not in METHODS:
                    raise ValueError(f"unknown reuse method {v['method']!r}")
                record.record(Verdict(v["method"], bool(v["agrees"]), float(v["kl"]), int(v["tokens"])))
            updated = float(item.get("updated", 0.0))
            if not math.isfinite(updated):
                raise ValueError("updated is not a finite time")
            record.updated = updated
            parsed.append((edge, record))
        if not replace:
            parsed = [(edge, record) for edge, record in parsed
                      if edge not in self.edges or record.updated > self.edges[edge].updated]
        self.edges.update(parsed)
        return len(parsed)
