"""KVCOMM's reference procedure as a strategy (`kvcomm`), beside agentcache's own construction.

What it does differently from `KVCMAS` (KVCOMM's `kvcomm_engine.py` and `gpt_chat.py`):

- One gate per shared segment (per source cache, the "message"), made when the segment is first
  needed: value distances to the anchors of its pool that cover the whole segment, softmax at
  T = 1 on raw distances, normalized entropy against τ. A pool with fewer than two such anchors,
  or an entropy above τ, makes the segment an anchor: every consumer then prefills its whole
  call densely once, and that prefill adds the consumer's corrections to the anchor. Otherwise
  every consumer reuses it.
- Anchors are kept at the positions they were observed at (base = the source placed where the
  consumer read it; Δ = dense − base), and a correction is added to the re-placed source
  without rotating it.
- The shared segment's correction weights are one per token and anchor, shared by all layers:
  a softmax over anchors of the mean absolute key (or value) distance over every layer (layer 0
  included), head and channel. Layer 0 is never corrected.
- The template text after a shared segment (up to the next one) is reused too: its KV from a
  prefill of the agent's template (each shared segment replaced by `{slot}`), placed where it
  sits, plus the anchors' observed template corrections, weighted per layer, head and channel by
  a softmax of the L2 distance between the segment and each anchor's last tokens. A reused call
  therefore prefills only its last token.
- Only anchors covering the whole segment qualify. An anchor's use is credited when the gate
  passes a segment, to the anchors before the cumulative gate weight reaches 0.9 (all of them
  when the first alone reaches it, as the reference code does).
- A reference (context-free) prefill puts the end of the line before the segment in the
  consumer's prompt (at most 8 tokens) in front of it, after BOS, as KVCOMM puts the chat
  template's user-turn header.

Every fault falls back to dense prefill, as in every strategy (`sourced`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch

from agentcache.correction.anchored import AnchoredStrategy
from agentcache.correction.anchors import Anchor, Correction
from agentcache.correction.corrections import fits
from agentcache.correction.lowrank import Factors, as_rows, from_rows
from agentcache.correction.matching import gate_distances, gate_weights, normalized_entropy
from agentcache.correction.plan import Piece, Planned, PHDecision, Served, TokenizedCall
from agentcache.correction.records import NewAnchor, Prepared, PreparedAnchor
from agentcache.correction.sources import REFERENCE
from agentcache.correction.store import Materialization
from agentcache.engine.kv import SegmentKV, all_finite, joined
from agentcache.engine.protocol import ExecRequest, SamplingParams, SegmentPlan, Step
from agentcache.engine.tokens import common_prefix
from agentcache.isolation import Scope, tenant_salt

__all__ = ["KVComm", "KVCommDetail", "GlueWeights", "Verdict", "token_weights", "channel_weights",
           "credited", "header_lead_in", "TOP_P"]

TOP_P = 0.9  # a passed gate credits the anchors holding this share of its weight
HEADER_TOKENS = 8  # at most this many tokens of the line before a segment (a user-turn header's size) lead its reference prefill
VERDICTS_KEPT = 4096  # gate verdicts remembered (one per source cache)
TEMPLATES_KEPT = 256  # agents' template prefills remembered


@dataclass(frozen=True)
class Verdict:
    """The gate's one decision on a source cache: reuse it, or make it an anchor."""

    anchor: bool
    reason: str | None  # why it is an anchor: "few_anchors" or "gate"
    entropy: float | None


@dataclass(frozen=True)
class GlueWeights:
    """How the template text after one corrected segment is corrected: per anchor, layer and
    feature (head and channel), for keys and for values."""

    anchors: list[Anchor]
    keys: torch.Tensor  # (n, L, F)
    values: torch.Tensor  # (n, L, F)


@dataclass(frozen=True)
class KVCommDetail:
    """KVCOMM's `PHDecision.detail`: whether the segment is an anchor this consumer's dense prefill
    teaches (`learn`), and for a correction, the anchors it used and how its template text is corrected."""

    learn: bool = False
    anchors: tuple[Anchor, ...] = ()
    glue: GlueWeights | None = None


def _dense(factors: Factors) -> torch.Tensor:
    """The (L, T, F) rows of full-dimensional factors, without a copy."""
    return factors.a if factors.b is None else factors.rows()


def token_weights(real: torch.Tensor, bases: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per token, a softmax over anchors of −mean over layers and features of |real − base|.

    real: (L, T, F); bases: (L, ≥T, F) each, compared on their first T rows. Returns (n, T)."""
    tokens = real.shape[1]
    distance = torch.stack([(real - base[:, :tokens]).abs().mean(dim=(0, 2)) for base in bases])  # (n, T)
    return torch.softmax(-distance, dim=0)


def channel_weights(real: torch.Tensor, bases: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per layer and feature, a softmax over anchors of −‖real − base's last T rows‖₂ over tokens.

    real: (L, T, F); bases: (L, ≥T, F) each. Returns (n, L, F)."""
    tokens = real.shape[1]
    distance = torch.stack([(real - base[:, base.shape[1] - tokens:]).norm(dim=1) for base in bases])  # (n, L, F)
    return torch.softmax(-distance, dim=0)


def credited(weights: torch.Tensor, top_p: float = TOP_P) -> list[int]:
    """The anchors a passed gate credits with a use: in order of weight, those before the
    cumulative weight reaches `top_p`; every anchor when the heaviest alone reaches it."""
    order = torch.argsort(weights, descending=True)
    below = (torch.cumsum(weights[order], dim=0) < top_p).nonzero().flatten()
    cutoff = int(below[-1]) if below.numel() else weights.numel() - 1
    return [int(i) for i in order[: cutoff + 1]]


def header_lead_in(engine, preceding: Sequence[int]) -> list[int]:
    """BOS and the end of the last line before a segment (at most HEADER_TOKENS tokens): the
    reference prefill's lead-in, mimicking what precedes the segment in a real prompt."""
    text = engine.detokenize(list(preceding)) if preceding else ""
    body = text.rstrip("\n")
    line = text[body.rfind("\n") + 1:] if body else ""
    lead = engine.tokenize(line, bos=True) if line else engine.tokenize("\n", bos=True)
    bos = engine.bos_token_id
    if bos is not None and (not lead or lead[0] != bos):
        lead = [bos] + lead
    return lead[:1] + lead[1:][-HEADER_TOKENS:]


class KVComm(AnchoredStrategy):
    """KVCOMM's reference procedure (see the module's description)."""

    def __init__(self, engine, strategy, anchor_bytes: int, store_bytes: int) -> None:
        super().__init__(engine, strategy, anchor_bytes, store_bytes)
        self.verdicts: OrderedDict[str, Verdict] = OrderedDict()  # source id -> the gate's decision
        self.templates: OrderedDict[tuple, list[SegmentKV | None]] = OrderedDict()
        self._templates_lock = threading.Lock()  # templates are also made after a call, with no runtime lock

    # --- a call ---------------------------------------------------------------------------

    def plan_call(self, call: TokenizedCall, *, lineage: str, namespace: str | None,
                  capture_all: bool = False) -> Planned:
        """KVCOMM's call: when every shared segment is reused, everything after the first one is
        injected (shared segments corrected, the template text between them taken from the agent's
        template prefill and corrected) but the last token, which is prefilled, and what no anchor
        covers (a segment's tail past its source, template text no anchor has seen); otherwise the
        whole call is prefilled densely, and the shared segments that are anchors learn from it."""
        runs = _glue_runs(call.segments)
        decisions: dict[int, PHDecision] = {}
        for index in runs:
            before = call.token_lists[index - 1] if index > 0 and call.segments[index - 1].kind == "pf" else ()
            decisions[index] = self.plan(call.scope, call.agent, call.segments[index].slot, call.token_lists[index],
                                         call.segments[index].source, start=call.starts[index],
                                         lead_in=header_lead_in(self.engine, before))
        injected = self._injection(call, runs, decisions)
        if injected is None:
            return self._dense_call(call, runs, decisions, capture_all)
        pieces = []
        last = len(call.segments) - 1
        for i, (seg, tokens) in enumerate(zip(call.segments, call.token_lists)):
            kv = injected.get(i)
            name = seg.slot if seg.kind == "ph" else seg.name
            if kv is None:
                pieces.append(Piece(i, SegmentPlan(seg.name, tokens, Step.PREFIX, capture=capture_all)))
                continue
            keep = min(kv.length, len(tokens) - 1 if i == last else len(tokens))  # the call's last token is prefilled
            capture = capture_all or seg.kind == "ph"
            if keep:
                pieces.append(Piece(i, SegmentPlan(name, tokens[:keep], Step.INJECT, kv.slice(0, keep), capture=capture)))
            if keep < len(tokens):
                pieces.append(Piece(i, SegmentPlan(name, tokens[keep:], Step.PREFIX, capture=capture)))
            if seg.kind == "pf":
                decisions[i] = PHDecision("corrected", covered=len(tokens), inject=kv)
        return Planned(tuple(pieces), MappingProxyType(decisions))

    @staticmethod
    def _dense_call(call: TokenizedCall, runs: dict[int, list[int]], decisions: dict[int, PHDecision],
                    capture_all: bool) -> Planned:
        """The whole call prefilled; the template text after the first shared segment is captured
        when an anchor segment learns from it."""
        for index, decision in list(decisions.items()):
            if decision.reused:
                decisions[index] = replace(decision, decision="fallback", reason="call_dense", inject=None, covered=0,
                                           detail=KVCommDetail(learn=_learns(decision)))
        learning = any(_learns(d) for d in decisions.values())
        first = min(runs, default=len(call.segments))
        pieces = tuple(Piece(i, SegmentPlan(seg.name, tokens, Step.PREFIX,
                                            capture=capture_all or seg.kind == "ph" or (learning and i > first)))
                       for i, (seg, tokens) in enumerate(zip(call.segments, call.token_lists)))
        return Planned(pieces, MappingProxyType(decisions))

    def _injection(self, call: TokenizedCall, runs: dict[int, list[int]],
                   decisions: dict[int, PHDecision]) -> dict[int, SegmentKV] | None:
        """The KV to inject per segment from the first shared one on, or None when the call runs densely.
        Template text that no anchor has seen corrected (it changes from call to call) is prefilled."""
        if not runs or not all(d.decision == "corrected" and d.covered > 0 for d in decisions.values()):
            return None
        injected: dict[int, SegmentKV] = {index: decisions[index].inject for index in runs}
        glued = {index: tokens for index, run in runs.items()
                 if run and self.glue_known(call.agent, decisions[index], tokens := _run_tokens(run, call.token_lists))}
        if not glued:
            return injected
        started = time.perf_counter()
        template = self.template(call.scope, call.agent, _template_shape(call))
        first = min(runs)  # KVCOMM makes templates before the workflow
        decisions[first] = replace(decisions[first], setup_s=decisions[first].setup_s + time.perf_counter() - started)
        for index, tokens in glued.items():
            run = runs[index]
            glue = self.glue_kv(call.agent, decisions[index], tokens, joined([template[j] for j in run]),
                                call.starts[run[0]])
            if glue is None:
                continue
            offset = 0
            for j in run:
                injected[j] = glue.slice(offset, offset + len(call.token_lists[j]))
                offset += len(call.token_lists[j])
        return injected

    def prepare(self, served: Served) -> Prepared:
        """The anchor corrections the call's dense prefill teaches, segment and template text alike
        (the reference procedure learns right after each call; its gate decides in `correct`)."""
        glue = self._glue(served)
        anchors = {index: self.prepare_anchor(served.call.agent, tokens, decision, kv, kv is not None and kv.exact,
                                              glue=glue.get(index))
                   for index, _, tokens, decision, _, kv in served.shared()}
        return Prepared(MappingProxyType({index: a for index, a in anchors.items() if a is not None}))

    def _glue(self, served: Served) -> dict[int, tuple]:
        """Per anchor segment the call learns from: its template text's tokens, dense KV and template KV."""
        learning = [i for i, d in served.decisions.items() if _learns(d)]
        if not learning:
            return {}
        call = served.call
        runs = _glue_runs(call.segments)
        template = None
        glue = {}
        for index in learning:
            run = runs.get(index, [])
            if not run:
                glue[index] = ((), None, None)
                continue
            if template is None:
                template = self.template(call.scope, call.agent, _template_shape(call))
            glue[index] = (tuple(_run_tokens(run, call.token_lists)), joined([served.kvs[j] for j in run]),
                           joined([template[j] for j in run]))
        return glue

    # --- one shared segment ----------------------------------------------------------------

    def correct(self, scope: Scope, agent: str, slot: str, source: Materialization, aligned: SegmentKV,
                start: int = 0) -> PHDecision:
        pool_key = (scope.tenant, slot)
        length = aligned.length
        gate_started = time.perf_counter()
        verdict = self._verdict(pool_key, source, aligned)
        gate_s = time.perf_counter() - gate_started
        if verdict.anchor:
            anchor = self.bank.anchor(pool_key, source.id)
            if anchor is None or agent not in anchor.corrections:  # this consumer has not prefilled it yet
                return PHDecision("fallback", reason=verdict.reason, source=source, entropy=verdict.entropy,
                                  setup_s=gate_s, detail=KVCommDetail(learn=True))
        layout = self.engine.layout
        candidates = []
        for anchor in self.bank.candidates(pool_key, source.agent, agent):
            if not fits(anchor, layout):
                self.fault("bad_anchor", f"dropping anchor {anchor.source_id} of slot {slot!r}: its shapes do not "
                           f"fit {self.engine.model_name}")
                self.bank.drop(pool_key, anchor)
                return PHDecision("fallback", reason="bad_anchor", source=source, setup_s=gate_s)
            if anchor.length >= length:  # only anchors covering the whole segment
                candidates.append(anchor)
        if not candidates:
            return PHDecision("fallback", reason="no_anchor", source=source, entropy=verdict.entropy, setup_s=gate_s)
        placed = self.engine.realign(aligned, start)  # the source where the segment sits in this call
        corrected, glue = [], {}
        for part in ("keys", "values"):
            real = as_rows(getattr(placed, part)).float()  # (L, T, F)
            bases = [_dense(getattr(a, part)) for a in candidates]  # (L, ≥T, F) at the anchors' positions
            weights = token_weights(real, bases)  # (n, T)
            rows = real.clone()
            for v, anchor in enumerate(candidates):  # added unrotated, as observed; layer 0 stays exact
                delta = getattr(anchor.corrections[agent], part)  # (L-1, ≥T, F)
                rows[1:] += weights[v, None, :, None] * delta.rows(length)
            corrected.append(from_rows(rows.to(layout.dtype), layout.num_kv_heads))
            glue[part] = channel_weights(real, bases)
        if not all_finite(*corrected):
            self.drop_non_finite(pool_key, candidates)
            return PHDecision("fallback", reason="nonfinite", source=source, entropy=verdict.entropy, setup_s=gate_s)
        return PHDecision("corrected", source=source, covered=length,
                          inject=SegmentKV(corrected[0], corrected[1], start), entropy=verdict.entropy, setup_s=gate_s,
                          detail=KVCommDetail(anchors=tuple(candidates),
                                              glue=GlueWeights(candidates, glue["keys"], glue["values"])))

    def _verdict(self, pool_key: tuple, source: Materialization, aligned: SegmentKV) -> Verdict:
        """The gate's decision on `source`, made once (KVCOMM's predict_as_anchor)."""
        known = self.verdicts.get(source.id)
        if known is not None:
            return known
        length = aligned.length
        pool = self.bank.pools.get(pool_key)
        anchors = [a for a in pool.anchors.values() if a.source == source.agent] if pool is not None else []
        covering = [a for a in anchors if a.length >= length]
        if len(covering) < 2:
            verdict = Verdict(True, "few_anchors", None)
        else:
            values = as_rows(aligned.values).float()  # (L, T, F): values carry no position
            distances = gate_distances(values, [a.values for a in covering], length)
            if not bool(torch.isfinite(distances).all()):
                self.drop_non_finite(pool_key, covering)
                raise FloatingPointError("non-finite gate distances")
            weights = gate_weights(distances, self.strategy.temperature, self.strategy.gate_scale)
            entropy = normalized_entropy(weights)
            if entropy > self.tau:
                verdict = Verdict(True, "gate", entropy)
            else:
                verdict = Verdict(False, None, entropy)
                for i in credited(weights):
                    covering[i].uses += 1
        self.verdicts[source.id] = verdict
        while len(self.verdicts) > VERDICTS_KEPT:
            self.verdicts.popitem(last=False)
        return verdict

    # --- the template text after shared segments -----------------------------------------

    def template(self, scope: Scope, agent: str, shape: Sequence[tuple[str, Sequence[int] | str]]
                 ) -> list[SegmentKV | None]:
        """The KV of each segment of the agent's template prompt (a shared segment replaced by the
        text `{slot}`, whose KV is None), prefilled once per tenant, agent and shape. `shape`: per
        segment ("pf", tokens) or ("ph", slot)."""
        key = (scope.tenant, agent, tuple((kind, tuple(x) if kind == "pf" else x) for kind, x in shape))
        with self._templates_lock:
            held = self.templates.get(key)
            if held is not None:
                self.templates.move_to_end(key)
                return held
        plans = [SegmentPlan(f"{kind}{i}", list(x) if kind == "pf" else self.engine.tokenize("{" + x + "}"),
                             Step.PREFIX) for i, (kind, x) in enumerate(shape)]
        result = self.engine.execute(ExecRequest(plans, SamplingParams(max_tokens=1), owner=REFERENCE, internal=True,
                                                 cache_salt=tenant_salt(scope.tenant)))
        kvs = [outcome.kv if kind == "pf" else None for (kind, _), outcome in zip(shape, result.segments)]
        with self._templates_lock:
            self.templates[key] = kvs
            while len(self.templates) > TEMPLATES_KEPT:
                self.templates.popitem(last=False)
        return kvs

    @staticmethod
    def glue_known(agent: str, decision: PHDecision, tokens: Sequence[int]) -> bool:
        """Whether every anchor of `decision` observed `agent`'s template text `tokens` corrected."""
        wanted = tuple(tokens)
        for anchor in decision.detail.glue.anchors:
            observed = anchor.corrections.get(agent)
            if observed is None or observed.glue_tokens != wanted:
                return False
        return True

    def glue_kv(self, agent: str, decision: PHDecision, tokens: Sequence[int], template: SegmentKV,
                start: int) -> SegmentKV | None:
        """The template text after `decision`'s segment (`tokens`, whose template prefill gave
        `template`) placed at `start` and corrected by the anchors' observed template corrections;
        None when an anchor holds none for these tokens."""
        if not self.glue_known(agent, decision, tokens):
            return None
        weights: GlueWeights = decision.detail.glue
        layout = self.engine.layout
        placed = self.engine.realign(template, start)
        corrected = []
        for part, part_weights in (("keys", weights.keys), ("values", weights.values)):
            rows = as_rows(getattr(placed, part)).float().clone()  # (L, G, F)
            for v, anchor in enumerate(weights.anchors):
                observed = getattr(anchor.corrections[agent], f"glue_{part}")  # (L-1, G, F)
                rows[1:] += part_weights[v, 1:, None, :] * _dense(observed)
            corrected.append(from_rows(rows.to(layout.dtype), layout.num_kv_heads))
        if not all_finite(*corrected):
            return None
        return SegmentKV(corrected[0], corrected[1], start)

    # --- after a call ---------------------------------------------------------------------

    def credit_uses(self, decision: PHDecision) -> None:
        """Credited when the gate passes a segment (`_verdict`), not per consumer."""

    def prepare_anchor(self, agent: str, token_ids: Sequence[int], decision: PHDecision, kv: SegmentKV | None,
                       own_tokens_exact: bool, glue: tuple | None = None) -> PreparedAnchor | None:
        """The anchor correction a dense prefill of an anchor segment teaches: the segment's and the
        template text's after it. `glue`: (tokens, their dense KV, their template KV), all empty
        when no text follows the segment before the next one; None (not known) teaches nothing."""
        if not (kv is not None and own_tokens_exact and _learns(decision) and decision.source is not None
                and glue is not None):
            return None
        glue_tokens, glue_real, glue_template = glue
        if glue_tokens and (glue_real is None or not glue_real.exact or glue_template is None):
            return None
        started = time.perf_counter()
        try:
            length = min(common_prefix(decision.source.token_ids, token_ids), kv.length)  # what a reuse covers
            existing = self.bank.anchor((decision.source.scope.tenant, decision.source.slot), decision.source.id)
            if length == 0 or (existing is not None and existing.length != length):
                return None  # an anchor's corrections all cover its base's tokens
            base = self.engine.realign(decision.source.kv.slice(0, length), kv.start)  # where the consumer read it
            dense = kv.slice(0, length)
            base_k, base_v = as_rows(base.keys).float(), as_rows(base.values).float()  # (L, T, F)
            delta_k = as_rows(dense.keys).float()[1:] - base_k[1:]  # (L-1, T, F), at the consumer's positions
            delta_v = as_rows(dense.values).float()[1:] - base_v[1:]
            glue_k = glue_v = None
            if glue_real is not None:
                placed = self.engine.realign(glue_template, glue_real.start)
                glue_k = Factors(as_rows(glue_real.keys).float()[1:] - as_rows(placed.keys).float()[1:], None)
                glue_v = Factors(as_rows(glue_real.values).float()[1:] - as_rows(placed.values).float()[1:], None)
            parts = [delta_k, delta_v] + [f.a for f in (glue_k, glue_v) if f is not None]
            if not all_finite(*parts):
                self.fault("nonfinite_delta", f"the observed correction of slot {decision.source.slot!r} holds NaN or Inf")
                return None
            correction = Correction(Factors(delta_k.clone(), None), Factors(delta_v.clone(), None),
                                    glue_tokens=tuple(glue_tokens), glue_keys=glue_k, glue_values=glue_v)
            anchor = NewAnchor(decision.source.id, decision.source.agent, Factors(base_k.clone(), None),
                               Factors(base_v.clone(), None), agent, correction)
        except Exception as exc:  # noqa: BLE001 - a fault here costs one anchor, never the call
            return PreparedAnchor(None, time.perf_counter() - started, exc)
        return PreparedAnchor(anchor, time.perf_counter() - started)


def _learns(decision: PHDecision) -> bool:
    """The segment is an anchor, and this consumer's dense prefill adds its correction."""
    return isinstance(decision.detail, KVCommDetail) and decision.detail.learn


def _glue_runs(segments: Sequence) -> dict[int, list[int]]:
    """Per PH segment, the PF segments after it up to the next PH segment: its template text."""
    runs: dict[int, list[int]] = {}
    owner = None
    for index, seg in enumerate(segments):
        if seg.kind == "ph":
            owner = index
            runs[index] = []
        elif owner is not None:
            runs[owner].append(index)
    return runs


def _run_tokens(run: Sequence[int], token_lists: Sequence[Sequence[int]]) -> list[int]:
    """The tokens of the segments `run`, in order."""
    return [t for j in run for t in token_lists[j]]


def _template_shape(call: TokenizedCall) -> list[tuple]:
    """Per segment ("pf", tokens) or ("ph", slot): the agent's template with its shared segments as slots."""
    return [("pf", tokens) if seg.kind == "pf" else ("ph", seg.slot) for seg, tokens in zip(call.segments, call.token_lists)]
