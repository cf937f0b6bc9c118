"""One agent call between the runtime and the engine: its plan, and what it became.

`plan_call` tokenizes a call and asks the corrector how to materialize each shared (PH) segment,
into an immutable `CallPlan` that carries the engine request. `settle_call` reads the engine's
result back into per-segment reports and records with the corrector what the shared segments
became: the sources of the next workflow edges, anchors from dense fallbacks whose KV is exact,
and the agent's decoded output. Neither takes a lock or keeps state of its own: the runtime
calls them under its lock, and the self-check drives them directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch

from agentcache.correction.corrector import Corrector, PHDecision, PreparedAnchor
from agentcache.correction.kvcomm import KVCommCorrector, header_lead_in
from agentcache.engine.kv import SegmentKV
from agentcache.engine.protocol import (
    Engine,
    ExecRequest,
    ExecResult,
    LayerRecompute,
    SamplingParams,
    SegmentOutcome,
    SegmentPlan,
    Step,
    TokenRecompute,
)
from agentcache.errors import PlanError, SegmentError
from agentcache.isolation import Scope
from agentcache.metrics import SegmentReport
from agentcache.segments import AgentCall, Segment

__all__ = ["CallPlan", "Settled", "plan_call", "prepare_anchors", "settle_call", "tokenize_call"]


@dataclass(frozen=True)
class Piece:
    """One engine segment: a whole call segment, or part of a PH segment split at its reuse cover."""

    index: int  # the call segment it belongs to
    plan: SegmentPlan


@dataclass(frozen=True)
class CallPlan:
    """What a call will ask of the engine, decided once and never changed afterwards."""

    call: AgentCall
    scope: Scope
    segments: tuple[Segment, ...]  # the call's segments, BOS segment included
    token_lists: tuple[tuple[int, ...], ...]
    prompt: tuple[int, ...]
    pieces: tuple[Piece, ...]
    decisions: Mapping[int, PHDecision]  # per PH segment index
    request: ExecRequest

    @property
    def injects(self) -> bool:
        return any(p.plan.step is Step.INJECT for p in self.pieces)

    def densely(self) -> CallPlan:
        """The same call with nothing reused: every segment prefilled (the engine refused the reused KV)."""
        decisions = {i: PHDecision("fallback", reason="engine_rejected") if d.reused else d
                     for i, d in self.decisions.items()}
        pieces = tuple(Piece(i, SegmentPlan(s.name, list(t), Step.PREFIX))
                       for i, (s, t) in enumerate(zip(self.segments, self.token_lists)))
        return replace(self, pieces=pieces, decisions=MappingProxyType(decisions),
                       request=replace(self.request, segments=[p.plan for p in pieces]))


@dataclass(frozen=True)
class Settled:
    """A finished call's segments as the engine served them, and each segment's KV."""

    reports: list[SegmentReport]
    kvs: list[SegmentKV | None]


def tokenize_call(engine: Engine, call: AgentCall) -> tuple[list[Segment], list[list[int]]]:
    """The call's segments and their tokens. The prompt starts with BOS: in the first segment when
    it is PF, as a PF segment of its own before a leading PH (whose tokens must match other agents'
    copies of the same content)."""
    segments, ids = list(call.segments), []
    bos, vocab = engine.bos_token_id, engine.vocab_size
    for i, seg in enumerate(segments):
        tokens = list(seg.token_ids) if seg.token_ids is not None else engine.tokenize(seg.text)
        if not tokens:
            raise PlanError(f"segment {i} ({seg.name}) of agent {call.agent!r} tokenizes to nothing")
        if seg.token_ids is not None and max(tokens) >= vocab:
            raise SegmentError(f"segment {i} ({seg.name}) of agent {call.agent!r}: token id {max(tokens)} is "
                               f"not in {engine.model_name}'s vocabulary of {vocab}")
        ids.append(tokens)
    if bos is not None and ids[0][0] != bos:
        if segments[0].kind == "pf":
            ids[0].insert(0, bos)
        else:
            segments.insert(0, Segment(kind="pf", token_ids=(bos,)))
            ids.insert(0, [bos])
    return segments, ids


def plan_call(
    engine: Engine,
    corrector: Corrector,
    call: AgentCall,
    sampling: SamplingParams,
    *,
    lineage: str,
    namespace: str | None,
    session: str | None,
    on_token: Callable[[int], None] | None = None,
    capture_all: bool = False,
) -> CallPlan:
    """Decide every PH segment of `call`. A reused segment is injected whole: the engine serves
    from its prefix cache whatever it holds of it at admission. The prefix cache is asked first
    only as a hint, to skip correcting segments it already covers. `lineage` salts the approximate
    KV the call caches, `namespace` its exact blocks, `session` is the engine's view of the session.
    Only PH segments' KV comes back from the engine (what the corrector keeps), unless `capture_all`."""
    agent = call.agent
    scope = Scope(call.tenant, call.session)
    segments, token_lists = tokenize_call(engine, call)
    prompt = [t for tokens in token_lists for t in tokens]
    if isinstance(corrector, KVCommCorrector):
        pieces, decisions = _kvcomm_pieces(engine, corrector, scope, agent, segments, token_lists, capture_all)
        return _call_plan(corrector, call, scope, segments, token_lists, prompt, pieces, decisions, sampling,
                          lineage, namespace, session, on_token)
    covered = engine.cached_prefix_length(prompt, lineage=lineage, cache_salt=namespace)  # a hint

    decisions: dict[int, PHDecision] = {}
    pieces: list[Piece] = []
    pos = 0
    for index, (seg, tokens) in enumerate(zip(segments, token_lists)):
        end = pos + len(tokens)
        if seg.kind == "ph" and end > covered:
            decision = corrector.plan(scope, agent, seg.slot, tokens, seg.source)
            decisions[index] = decision
            if decision.reused and decision.covered > covered - pos:
                cover = decision.covered
                kv = decision.inject.slice(0, cover)  # canonical start 0; the engine re-aligns it
                pieces.append(Piece(index, SegmentPlan(seg.slot, tokens[:cover], Step.INJECT, kv,
                                                       recompute=_covering(decision.recompute, cover))))
                if cover < len(tokens):
                    pieces.append(Piece(index, SegmentPlan(seg.slot, tokens[cover:], Step.PREFIX)))
                pos = end
                continue
            if decision.reused:  # the prefix cache already serves what the source covers
                decisions[index] = PHDecision("fallback", reason="prefix_covers_source", source=decision.source)
        pieces.append(Piece(index, SegmentPlan(seg.name, tokens, Step.PREFIX, capture=capture_all or seg.kind == "ph")))
        pos = end
    return _call_plan(corrector, call, scope, segments, token_lists, prompt, pieces, decisions, sampling, lineage,
                      namespace, session, on_token)


def _call_plan(corrector: Corrector, call: AgentCall, scope: Scope, segments: list[Segment],
               token_lists: list[list[int]], prompt: list[int], pieces: list[Piece], decisions: dict[int, PHDecision],
               sampling: SamplingParams, lineage: str, namespace: str | None, session: str | None,
               on_token: Callable[[int], None] | None) -> CallPlan:
    request = ExecRequest([p.plan for p in pieces], sampling, lineage=lineage, cache_salt=namespace, owner=call.agent,
                          session=session, on_token=on_token, hidden_layer=corrector.hidden_layer(scope))
    return CallPlan(call, scope, tuple(segments), tuple(map(tuple, token_lists)), tuple(prompt), tuple(pieces),
                    MappingProxyType(decisions), request)


def _glue_runs(segments: Sequence[Segment]) -> dict[int, list[int]]:
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


def _template_shape(segments: Sequence[Segment], token_lists: Sequence[Sequence[int]]) -> list[tuple]:
    return [("pf", tokens) if seg.kind == "pf" else ("ph", seg.slot) for seg, tokens in zip(segments, token_lists)]


def _kvcomm_pieces(engine: Engine, corrector: KVCommCorrector, scope: Scope, agent: str, segments: list[Segment],
                   token_lists: list[list[int]], capture_all: bool) -> tuple[list[Piece], dict[int, PHDecision]]:
    """KVCOMM's call: when every shared segment is reused, everything after the first one is
    injected (shared segments corrected, the template text between them taken from the agent's
    template prefill and corrected) but the last token, which is prefilled, and what no anchor
    covers (a segment's tail past its source, template text no anchor has seen); otherwise the
    whole call is prefilled densely, and the shared segments that are anchors learn from it."""
    starts = [0]
    for tokens in token_lists:
        starts.append(starts[-1] + len(tokens))
    runs = _glue_runs(segments)
    decisions: dict[int, PHDecision] = {}
    for index in runs:
        before = token_lists[index - 1] if index > 0 and segments[index - 1].kind == "pf" else ()
        decisions[index] = corrector.plan(scope, agent, segments[index].slot, token_lists[index], segments[index].source,
                                          start=starts[index], lead_in=header_lead_in(engine, before))
    injected = _kvcomm_injection(corrector, scope, agent, segments, token_lists, starts, runs, decisions)
    if injected is None:
        for index, decision in list(decisions.items()):
            if decision.reused:
                decisions[index] = replace(decision, decision="fallback", reason="call_dense", inject=None, covered=0,
                                           anchors=[], glue=None)
        learning = any(d.learn for d in decisions.values())
        first = min(runs, default=len(segments))
        pieces = [Piece(i, SegmentPlan(seg.name, tokens, Step.PREFIX,
                                       capture=capture_all or seg.kind == "ph" or (learning and i > first)))
                  for i, (seg, tokens) in enumerate(zip(segments, token_lists))]
        return pieces, decisions
    pieces = []
    last = len(segments) - 1
    for i, (seg, tokens) in enumerate(zip(segments, token_lists)):
        kv = injected.get(i)
        name = seg.slot if seg.kind == "ph" else seg.name
        if kv is None:
            pieces.append(Piece(i, SegmentPlan(seg.name, tokens, Step.PREFIX, capture=capture_all)))
            continue
        keep = min(kv.length, len(tokens) - 1 if i == last else len(tokens))  # the call's last token is prefilled
        if keep:
            pieces.append(Piece(i, SegmentPlan(name, tokens[:keep], Step.INJECT, kv.slice(0, keep),
                                               capture=capture_all or seg.kind == "ph")))
        if keep < len(tokens):
            pieces.append(Piece(i, SegmentPlan(name, tokens[keep:], Step.PREFIX, capture=capture_all or seg.kind == "ph")))
        if seg.kind == "pf":
            decisions[i] = PHDecision("corrected", covered=len(tokens), inject=kv)
    return pieces, decisions


def _kvcomm_injection(corrector: KVCommCorrector, scope: Scope, agent: str, segments: list[Segment],
                      token_lists: list[list[int]], starts: list[int], runs: dict[int, list[int]],
                      decisions: dict[int, PHDecision]) -> dict[int, SegmentKV] | None:
    """The KV to inject per segment from the first shared one on, or None when the call runs densely.
    Template text that no anchor has seen corrected (it changes from call to call) is prefilled."""
    if not runs or not all(d.decision == "corrected" and d.covered > 0 for d in decisions.values()):
        return None
    injected: dict[int, SegmentKV] = {index: decisions[index].inject for index in runs}
    glued = {index: tokens for index, run in runs.items()
             if run and corrector.glue_known(agent, decisions[index], tokens := _run_tokens(run, token_lists))}
    if not glued:
        return injected
    started = time.perf_counter()
    template = corrector.template(scope, agent, _template_shape(segments, token_lists))
    decisions[min(runs)].setup_s += time.perf_counter() - started  # KVCOMM makes templates before the workflow
    for index, tokens in glued.items():
        run = runs[index]
        glue = corrector.glue_kv(agent, decisions[index], tokens, _joined([template[j] for j in run]), starts[run[0]])
        if glue is None:
            continue
        offset = 0
        for j in run:
            injected[j] = glue.slice(offset, offset + len(token_lists[j]))
            offset += len(token_lists[j])
    return injected


@dataclass(frozen=True)
class _Served:
    """A finished call's segments as the engine served them."""

    kvs: list[SegmentKV | None]
    hiddens: list[torch.Tensor | None]
    decisions: dict[int, PHDecision]
    reports: list[SegmentReport]

    def shared(self, plan: CallPlan):
        """(index, segment, tokens, decision, how, kv) of every PH segment."""
        for index, (seg, tokens, report) in enumerate(zip(plan.segments, plan.token_lists, self.reports)):
            if seg.kind != "ph":
                continue
            made = _made(report.length, report.cached_tokens, report.lineage_tokens)
            decision = self.decisions.get(index) or PHDecision(made)
            yield index, seg, tokens, decision, decision.decision if decision.reused else made, self.kvs[index]


def _served(plan: CallPlan, result: ExecResult) -> _Served:
    outcomes: list[list[SegmentOutcome]] = [[] for _ in plan.segments]  # engine segments per call segment
    for piece, outcome in zip(plan.pieces, result.segments):
        outcomes[piece.index].append(outcome)
    decisions = _as_served(plan.decisions, outcomes)
    return _Served([_joined([o.kv for o in parts]) for parts in outcomes],
                   [_joined_hidden([o.hidden for o in parts]) for parts in outcomes], decisions,
                   _reports(plan.segments, plan.token_lists, outcomes, decisions))


def prepare_anchors(corrector: Corrector, plan: CallPlan, result: ExecResult) -> dict[int, PreparedAnchor | None]:
    """The anchors `settle_call` would insert, per PH segment, built without changing anything: the
    runtime factorizes them with no lock held, so other calls' planning does not wait for it."""
    served = _served(plan, result)
    glue = _kvcomm_glue(corrector, plan, served) if isinstance(corrector, KVCommCorrector) else {}
    return {index: corrector.prepare_anchor(plan.call.agent, tokens, decision, kv, kv is not None and kv.exact,
                                            glue=glue.get(index))
            for index, _, tokens, decision, _, kv in served.shared(plan)}


def _kvcomm_glue(corrector: KVCommCorrector, plan: CallPlan, served: "_Served") -> dict[int, tuple]:
    """Per anchor segment the call learns from: its template text's tokens, dense KV and template KV."""
    learning = [i for i, d in served.decisions.items() if d.learn]
    if not learning:
        return {}
    runs = _glue_runs(plan.segments)
    template = None
    glue = {}
    for index in learning:
        run = runs.get(index, [])
        if not run:
            glue[index] = ((), None, None)
            continue
        if template is None:
            template = corrector.template(plan.scope, plan.call.agent, _template_shape(plan.segments, plan.token_lists))
        glue[index] = (tuple(_run_tokens(run, plan.token_lists)), _joined([served.kvs[j] for j in run]),
                       _joined([template[j] for j in run]))
    return glue


def settle_call(corrector: Corrector, plan: CallPlan, result: ExecResult,
                prepared: dict[int, PreparedAnchor | None] | None = None) -> Settled:
    """Report how each call segment was materialized and record it with the corrector (with the
    anchors `prepare_anchors` built, when given). A fault while recording is counted and costs only
    what it touched; the call's result stands."""
    served = _served(plan, result)
    agent = plan.call.agent
    for index, seg, tokens, decision, how, kv in served.shared(plan):
        try:  # anchors learn only from KV known exact for this prompt (its digest says so)
            corrector.commit(plan.scope, agent, seg.slot, tokens, decision, kv, how,
                             own_tokens_exact=kv is not None and kv.exact, hidden=served.hiddens[index],
                             prepared=prepared.get(index) if prepared is not None else False)
        except Exception as exc:  # noqa: BLE001
            corrector.fault("commit_error", f"recording agent {agent!r}'s segment {seg.slot!r}", exc)
    try:
        corrector.record_output(plan.scope, agent, result.token_ids[:-1], result.generated_kv, result.generated_hidden)
    except Exception as exc:  # noqa: BLE001
        corrector.fault("commit_error", f"recording agent {agent!r}'s output", exc)
    return Settled(served.reports, served.kvs)


def _reports(
    segments: Sequence[Segment],
    token_lists: Sequence[Sequence[int]],
    outcomes: list[list[SegmentOutcome]],
    decisions: Mapping[int, PHDecision],
) -> list[SegmentReport]:
    """How each call segment was materialized. A segment served whole from the prefix cache is a
    `prefix_hit` when every block was exact, an `own_lineage_hit` when some came from the caller's
    own approximate lineage: never counted as exact."""
    reports = []
    for index, (seg, tokens, parts) in enumerate(zip(segments, token_lists, outcomes)):
        cached = sum(o.cached_tokens for o in parts)
        lineage = sum(o.lineage_tokens for o in parts)
        decision = decisions.get(index)
        reports.append(SegmentReport(
            name=seg.name, kind=seg.kind, start=parts[0].start, length=len(tokens),
            decision=decision.decision if decision is not None else _made(len(tokens), cached, lineage),
            reason=decision.reason if decision else None, cached_tokens=cached,
            computed_tokens=sum(o.computed_tokens for o in parts),
            injected_tokens=sum(o.injected_tokens for o in parts),
            entropy=decision.entropy if decision else None,
            source=decision.source.agent if decision and decision.source else None,
            plan_s=decision.plan_s if decision else 0.0, setup_s=decision.setup_s if decision else 0.0,
            lineage_tokens=lineage,
            recomputed_tokens=sum(o.recomputed_tokens for o in parts),
            prefill_tokens=sum(o.prefill_tokens for o in parts),
        ))
    return reports


def _made(length: int, cached: int, lineage: int) -> str:
    """How the engine materialized a segment it was not asked to inject."""
    return "dense" if cached < length else "own_lineage_hit" if lineage else "prefix_hit"


def _as_served(decisions: Mapping[int, PHDecision], outcomes: list[list[SegmentOutcome]]) -> dict[int, PHDecision]:
    """The plan's decisions as the engine served them: a reused segment the prefix cache covered
    whole at admission (nothing injected) was a prefix hit, not a reuse; one the engine computed
    itself instead (vLLM lost a phase's blocks, or the injected KV failed to load) is exact, and a
    fallback of its own."""
    served = dict(decisions)
    for index, decision in decisions.items():
        if decision.reused and not any(o.injected_tokens for o in outcomes[index]):
            computed = any(o.computed_tokens for o in outcomes[index])
            served[index] = PHDecision("fallback", reason="engine_recomputed" if computed else "prefix_covers_source",
                                       source=decision.source)
    return served


def _covering(recompute: TokenRecompute | LayerRecompute | None, cover: int) -> TokenRecompute | LayerRecompute | None:
    """The recompute step of a segment's first `cover` tokens (a layer step's hidden states cut to them)."""
    if isinstance(recompute, LayerRecompute):
        return replace(recompute, hidden=recompute.hidden[:cover])
    return recompute


def _joined_hidden(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """One segment's hidden states from its engine segments' (None unless every part has them)."""
    if not parts or any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))  # (T, hidden size)


def _joined(parts: Sequence[SegmentKV | None]) -> SegmentKV | None:
    """One segment's KV from the engine segments it was split into (contiguous positions). It is
    exact when every part is: then the last part's digest names the whole prefix through its end."""
    if not parts or any(p is None for p in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    keys = torch.cat([p.keys for p in parts], dim=2)  # (L, H, T, D)
    values = torch.cat([p.values for p in parts], dim=2)
    exact_for = parts[-1].exact_for if all(p.exact for p in parts) else None
    return SegmentKV(keys, values, parts[0].start, exact_for)
