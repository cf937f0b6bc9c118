"""The chained corrector: decides how each shared (PH) segment of a call is materialized.

Before a call, `plan` looks up the segment's source cache, re-aligns it to canonical positions,
and either hands back KV to inject (corrected, or raw for FullShared) or asks for dense prefill.
After the call, `commit` records what the segment became (the source of the next edge) and,
after a dense fallback, inserts the observed correction Δ = C_dense − Align(C_source) as an
anchor. Any fault (any exception while planning, a corrupt anchor or source, NaN) falls back to
dense and is counted in `faults`; a corrupt anchor or source is removed so that it stops poisoning
later calls. A fault while building an anchor after the call loses only that anchor.

Sources are looked up in the caller's scope (its tenant's session) only; anchor pools are per
tenant and slot, shared by the tenant's sessions.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from agentcache.correction.anchors import Anchor, AnchorBank, Correction
from agentcache.correction.lowrank import as_rows, factorize, from_rows
from agentcache.correction.calibration import CALIBRATION_WINDOW, ReuseController
from agentcache.correction.matching import gate_distances, gate_weights, interpolated_correction, normalized_entropy
from agentcache.correction.selective import LayerProfile, layer_count, token_plan
from agentcache.correction.store import Materialization, SegmentStore, common_prefix
from agentcache.correction.strategies import Strategy
from agentcache.engine.kv import SegmentKV
from agentcache.engine.protocol import (Engine, ExecRequest, LayerRecompute, SamplingParams, SegmentPlan, Step,
                                       TokenRecompute)
from agentcache.isolation import Scope, tenant_salt

__all__ = ["Corrector", "PHDecision", "PreparedAnchor", "REFERENCE", "NEUTRAL_LEAD_IN"]

log = logging.getLogger(__name__)

REFERENCE = "<reference>"  # the pseudo-agent of context-free reference prefills
NEUTRAL_LEAD_IN = "\n"  # what precedes a segment in its reference prefill (then dropped)
TOKEN_WEIGHT_TEMPERATURE = 1.0  # softmax temperature of the token-wise interpolation weights (App. A.3)
GATE_LOG = 512  # the latest planned segments kept for calibrating the gate


@dataclass(frozen=True)
class PreparedAnchor:
    """An anchor built for a commit: `AnchorBank.add`'s arguments (less the pool key), or the error."""

    args: tuple | None
    seconds: float
    error: BaseException | None = None


@dataclass
class PHDecision:
    """How one PH segment is materialized in a call."""

    # "first" (no source: dense), "corrected", "reused" (raw), "recomputed" (selective), "fallback" (dense), "off"
    decision: str
    reason: str | None = None  # why it fell back
    source: Materialization | None = None
    covered: int = 0  # leading tokens served by `inject`
    inject: SegmentKV | None = None  # canonical positions (start 0); the engine re-aligns it
    entropy: float | None = None
    anchors: list[Anchor] = field(default_factory=list, repr=False)  # the anchors a correction used
    plan_s: float = 0.0  # time spent planning (inside TTFT)
    recompute: TokenRecompute | LayerRecompute | None = None  # what the engine rebuilds of `inject`
    # KVCOMM's procedure (`correction.kvcomm`): how the template text after the segment is corrected
    glue: object | None = field(default=None, repr=False)
    learn: bool = False  # KVCOMM: the segment is an anchor; this consumer's dense prefill adds its correction
    setup_s: float = 0.0  # inside TTFT: reference and template prefills and the gate (KVCOMM leaves them out)

    @property
    def reused(self) -> bool:
        return self.inject is not None


class Corrector:
    def __init__(self, engine: Engine, strategy: Strategy, anchor_bytes: int, store_bytes: int) -> None:
        self.engine = engine
        self.strategy = strategy
        self.bank = AnchorBank(strategy.max_anchors, anchor_bytes)
        self.store = SegmentStore(store_bytes)
        self.faults: Counter[str] = Counter()  # real faults only: each one fell back to dense prefill
        self.profiles: dict[str | None, LayerProfile] = {}  # DroidSpeak: per tenant
        self.tau = strategy.tau  # the gate's threshold; `reuse_control` sets it for a target reuse ratio
        # planned segments that had a source: (gate entropy, or None when the gate was not reached; tokens)
        self.gate_log: deque[tuple[float | None, int]] = deque(maxlen=GATE_LOG)
        self.reuse_control: ReuseController | None = None  # from the first calibration on
        self.planned = 0  # segments ever logged in gate_log
        self.anchor_build_s = 0.0
        self.reference_s = 0.0  # context-free reference prefills (non-chained), on consumers' critical paths

    def fault(self, kind: str, what: str, exc: BaseException | None = None) -> None:
        """Count and log one fault (`kind` is what summary()["faults"] reports)."""
        self.faults[kind] += 1
        log.warning("%s: %s%s", kind, what, f" ({type(exc).__name__}: {exc})" if exc is not None else "")

    # --- before the call -------------------------------------------------------------------

    def plan(self, scope: Scope, agent: str, slot: str, token_ids: Sequence[int],
             source: str | None = None, *, start: int = 0, lead_in: Sequence[int] | None = None) -> PHDecision:
        """How `agent` should materialize this PH segment; `source` pins the edge's source agent.
        `start`: where the segment sits in the call; `lead_in`: tokens (BOS first) a context-free
        reference prefill puts before the segment (default: BOS and a neutral newline)."""
        started, references_before = time.perf_counter(), self.reference_s
        try:
            decision = self._plan(scope, agent, slot, token_ids, source, start, lead_in)
        except Exception as exc:  # noqa: BLE001 - never serve a cache a fault touched: prefill
            self.fault("plan_error", f"planning slot {slot!r} for agent {agent!r}; prefilling densely", exc)
            decision = PHDecision("fallback", reason="error")
        decision.plan_s = time.perf_counter() - started
        decision.setup_s += self.reference_s - references_before
        if decision.source is not None and self.strategy.correct:
            self._log_gate(decision, len(token_ids))
        return decision

    def _log_gate(self, decision: PHDecision, tokens: int) -> None:
        """Log an eligible segment's gate entropy; a controlled gate follows it, and a target reuse
        ratio starts being controlled after `calibrate_after` segments with gate evaluations."""
        self.gate_log.append((decision.entropy, tokens))
        self.planned += 1
        if self.reuse_control is not None:
            self.tau = self.reuse_control.record(decision.entropy, tokens, decision.covered if decision.reused else 0)
            return
        target = self.strategy.target_reuse
        if (target is not None and self.planned >= self.strategy.calibrate_after
                and any(entropy is not None for entropy, _ in self.gate_log)):
            self.calibrate(target, CALIBRATION_WINDOW)

    def calibrate(self, target: float, recent: int | None = None) -> float:
        """Hold the gate at reuse ratio `target` from now on (the papers tune τ per workload): τ is
        read from the gate entropies of the latest `recent` eligible segments (all that are kept by
        default) and then follows every segment planned (`calibration.ReuseController`); returns τ.
        Needs gate evaluations."""
        history = list(self.gate_log)[-recent:] if recent else list(self.gate_log)
        self.reuse_control = ReuseController(target, history)
        self.tau = self.reuse_control.tau
        log.info("gate held at reuse %.2f: tau = %.4f from %d segments", target, self.tau, len(history))
        return self.tau

    @property
    def calibrated(self) -> dict | None:
        """How τ is set, once a target reuse ratio holds it."""
        return self.reuse_control.report() if self.reuse_control is not None else None

    def _plan(self, scope: Scope, agent: str, slot: str, token_ids: Sequence[int],
              source_agent: str | None, start: int = 0, lead_in: Sequence[int] | None = None) -> PHDecision:
        if not self.strategy.reuse:
            return PHDecision("off")
        found = self._source(scope, slot, token_ids, source_agent, lead_in)
        if found is None:
            return PHDecision("first") if self.strategy.chained else PHDecision("fallback", reason="no_source")
        source, shared = found
        if not self.engine.supports_realignment:
            return PHDecision("fallback", reason="not_realignable", source=source)
        if not self._source_is_sound(source):
            return PHDecision("fallback", reason="bad_source")
        try:
            aligned = self.engine.realign(source.kv.slice(0, shared), 0)
        except Exception:
            self.store.remove(source.id)  # a source that cannot be re-aligned is not used again
            raise
        if self.strategy.recompute is not None:
            return self._selective(scope, source, shared, aligned)
        if not self.strategy.correct:
            return PHDecision("reused", source=source, covered=shared, inject=aligned)
        try:
            return self._correct(scope, agent, slot, source, aligned, start)
        except Exception:
            # Not knowing which part was bad, use none of what the fault touched again: the source and
            # the anchors of this edge (they are learned anew from the next fallbacks).
            self.store.remove(source.id)
            for anchor in self.bank.candidates((scope.tenant, slot), source.agent, agent):
                self.bank.drop((scope.tenant, slot), anchor)
            raise

    def _selective(self, scope: Scope, source: Materialization, shared: int, aligned: SegmentKV) -> PHDecision:
        """CacheBlend or DroidSpeak: reuse the aligned source, the engine rebuilding 1 − ρ of it."""
        s = self.strategy
        if s.recompute == "tokens":
            return PHDecision("recomputed", source=source, covered=shared, inject=aligned,
                              recompute=token_plan(s.rho, s.probe_layer))
        profile = self._profile(scope)
        if not profile.ready:
            return PHDecision("fallback", reason="profiling", source=source)
        if layer_count(s.rho, profile.num_layers) == 0:
            return PHDecision("reused", source=source, covered=shared, inject=aligned)
        hidden = source.hidden
        if hidden is None or hidden.shape[0] < shared:
            return PHDecision("fallback", reason="no_hidden_states", source=source)
        return PHDecision("recomputed", source=source, covered=shared, inject=aligned,
                          recompute=profile.recompute(s.rho, hidden[:shared]))

    def _profile(self, scope: Scope) -> LayerProfile:
        profile = self.profiles.get(scope.tenant)
        if profile is None:
            profile = LayerProfile(self.engine.layout.num_layers, self.strategy.profile_transitions)
            self.profiles[scope.tenant] = profile
        return profile

    def hidden_layer(self, scope: Scope) -> int | None:
        """The decoder layer whose input hidden states a call should hand back (DroidSpeak's E cache,
        once its layer group is known); None when the strategy needs none."""
        s = self.strategy
        if s.recompute != "layers" or not s.reuse:
            return None
        profile = self._profile(scope)
        count = layer_count(s.rho, profile.num_layers)
        return profile.group(count)[0] if profile.ready and count else None

    def _source_is_sound(self, source: Materialization) -> bool:
        """The stored KV fits the model and is finite; otherwise it is removed from the store."""
        kv = source.kv
        try:
            kv.check(self.engine.layout, len(source.token_ids), f"source cache {source.id}")
            sound = bool(torch.isfinite(kv.keys).all() and torch.isfinite(kv.values).all())
        except Exception:  # noqa: BLE001 - a mis-shaped, mistyped or missing KV: not a source
            sound = False
        if not sound:
            self.faults["bad_source"] += 1
        if not sound:
            log.warning("removing source cache %s of slot %r: wrong shape or NaN/Inf", source.id, source.slot)
            self.store.remove(source.id)
        return sound

    def _source(self, scope: Scope, slot: str, token_ids: Sequence[int],
                agent: str | None, lead_in: Sequence[int] | None = None) -> tuple[Materialization, int] | None:
        if self.strategy.chained:
            return self.store.find(scope, slot, token_ids, agent=agent)
        if slot.startswith("out:"):  # non-chained: an output's reference is its generator's cache
            return self.store.find(scope, slot, token_ids, agent=slot[4:])
        found = self.store.find(scope, slot, token_ids, agent=REFERENCE)
        if found is None or found[1] < len(token_ids):
            entry = self._reference_prefill(scope, slot, token_ids, lead_in)
            found = (entry, len(token_ids)) if entry is not None else found
        return found

    def _reference_prefill(self, scope: Scope, slot: str, token_ids: Sequence[int],
                           lead_in: Sequence[int] | None = None) -> Materialization | None:
        """Prefill the segment after `lead_in` (BOS and a neutral newline by default), outside the
        workflow (non-chained)."""
        started = time.perf_counter()
        lead = list(lead_in) if lead_in else self.engine.tokenize(NEUTRAL_LEAD_IN, bos=True)
        request = ExecRequest(
            [SegmentPlan("lead-in", lead, Step.PREFIX), SegmentPlan(slot, list(token_ids), Step.PREFIX)],
            # on the first consumer's critical path: a real request's priority and chunks, but no
            # agent dispatch and no hit in the statistics
            SamplingParams(max_tokens=1), owner=REFERENCE, internal=True,
            cache_salt=tenant_salt(scope.tenant),  # the tenant's text: cached in the tenant's namespace only
        )
        result = self.engine.execute(request)
        self.reference_s += time.perf_counter() - started
        return self.store.put(scope, slot, REFERENCE, token_ids, result.segments[1].kv, "reference")

    def _correct(self, scope: Scope, agent: str, slot: str, source: Materialization, aligned: SegmentKV,
                 start: int = 0) -> PHDecision:
        layout = self.engine.layout
        features = layout.num_kv_heads * layout.head_dim
        pool_key = (scope.tenant, slot)
        candidates = self.bank.candidates(pool_key, source.agent, agent)
        for anchor in candidates:
            if not _fits(anchor, layout.num_layers, features):
                self.fault("bad_anchor", f"dropping anchor {anchor.source_id} of slot {slot!r}: its shapes do not "
                           f"fit {self.engine.model_name}")
                self.bank.drop(pool_key, anchor)
                return PHDecision("fallback", reason="bad_anchor", source=source)
        length = aligned.length
        if self.strategy.max_anchors == 1 and len(candidates) == 1:  # V = 1: the sole anchor, no gate
            compatible, k, entropy = candidates, min(length, candidates[0].length), None
        elif len(candidates) < 2:
            return PHDecision("fallback", reason="few_anchors", source=source)
        else:
            # Compare over the longest prefix at least two anchors cover (App. A.3, Eq. 9-11).
            k = min(length, sorted((a.length for a in candidates), reverse=True)[1])
            compatible = [a for a in candidates if a.length >= k]
            values = as_rows(aligned.values[:, :, :k]).float()  # (L, k, F)
            distances = gate_distances(values, [a.values for a in compatible], k)
            if not bool(torch.isfinite(distances).all()):
                self._drop_non_finite(pool_key, compatible)
                return PHDecision("fallback", reason="nonfinite", source=source)
            entropy = normalized_entropy(gate_weights(distances, self.strategy.temperature, self.strategy.gate_scale))
            if not entropy <= self.tau:
                return PHDecision("fallback", reason="gate", source=source, entropy=entropy)
            if self.reuse_control is not None and not self.reuse_control.allows(entropy, length):
                return PHDecision("fallback", reason="budget", source=source, entropy=entropy)
        corrected = []
        for part in ("keys", "values"):
            rows = as_rows(getattr(aligned, part)).float().clone()  # (L, S, F); a copy: the source stays intact
            delta, _ = interpolated_correction(
                rows[1:, :k],  # rows past k stay the aligned source: no extrapolation past the anchors
                [getattr(a, part) for a in compatible],
                [getattr(a.corrections[agent], part) for a in compatible],
                TOKEN_WEIGHT_TEMPERATURE,
                base_layer_offset=1,
            )
            rows[1:, :k] += delta  # layer 0 depends on position only: exact after alignment
            corrected.append(from_rows(rows.to(layout.dtype), layout.num_kv_heads))
        if not all(bool(torch.isfinite(t).all()) for t in corrected):
            self._drop_non_finite(pool_key, compatible)
            return PHDecision("fallback", reason="nonfinite", source=source, entropy=entropy)
        return PHDecision("corrected", source=source, covered=length, inject=SegmentKV(corrected[0], corrected[1], 0),
                          entropy=entropy, anchors=compatible)

    def _drop_non_finite(self, pool_key: tuple, anchors: list[Anchor]) -> None:
        self.faults["nonfinite"] += 1
        for anchor in anchors:
            if not anchor.is_finite():
                log.warning("dropping anchor %s of slot %r: it holds NaN or Inf", anchor.source_id, pool_key[1])
                self.bank.drop(pool_key, anchor)

    # --- after the call --------------------------------------------------------------------

    def prepare_anchor(self, agent: str, token_ids: Sequence[int], decision: PHDecision, kv: SegmentKV | None,
                       own_tokens_exact: bool, glue: tuple | None = None) -> "PreparedAnchor | None":
        """The anchor a commit of this segment would insert, built without changing anything (so the
        runtime can factorize outside its lock, off other calls' critical path); None when the
        segment teaches nothing. A fault while building is returned, to be counted at the commit.
        Only a dense fallback teaches the pool (accepted corrections are never inserted), and only
        when its tokens were prefilled or exact prefix hits (not the lineage's maybe corrected blocks).
        `glue` is for KVCOMM's procedure (`KVCommCorrector`)."""
        if not (kv is not None and self.strategy.reuse and self.strategy.correct and own_tokens_exact
                and decision.decision == "fallback" and decision.source is not None):
            return None
        started = time.perf_counter()
        try:
            args = self._build_anchor(agent, decision.source, token_ids, kv)
        except Exception as exc:  # noqa: BLE001 - a fault here costs one anchor, never the call
            return PreparedAnchor(None, time.perf_counter() - started, exc)
        return PreparedAnchor(args, time.perf_counter() - started)

    def commit(self, scope: Scope, agent: str, slot: str, token_ids: Sequence[int], decision: PHDecision,
               kv: SegmentKV | None, how: str, *, own_tokens_exact: bool = True,
               hidden: torch.Tensor | None = None, prepared: "PreparedAnchor | None | bool" = False) -> None:
        """Record what the segment became in the call (`how`), with its KV `kv`: the next edge's source
        and, after a dense fallback, a new anchor (`prepared` by `prepare_anchor`, or built here when
        False). A fault while building it loses only the anchor. `own_tokens_exact`: none of the
        segment's tokens came from the lineage's approximate blocks."""
        if kv is None or not self.strategy.reuse:
            return
        if prepared is False:
            prepared = self.prepare_anchor(agent, token_ids, decision, kv, own_tokens_exact)
        anchor = None
        if prepared is not None:
            self.anchor_build_s += prepared.seconds
            anchor = prepared.args
            if prepared.error is not None:
                self.fault("anchor_build_error", f"no anchor from agent {agent!r}'s fallback on slot {slot!r}",
                           prepared.error)
        if decision.reason == "profiling" and decision.source is not None and own_tokens_exact:
            self._observe_layers(scope, decision.source, token_ids, kv)
        self._credit_uses(decision)
        if self.strategy.chained:
            self.store.put(scope, slot, agent, token_ids, kv, how, hidden=hidden)
        if anchor is not None:
            held = self.bank.anchor((scope.tenant, slot), anchor[0])
            if held is None or held.length == anchor[2].length:  # another call may have added one since
                self.bank.add((scope.tenant, slot), *anchor)

    def _credit_uses(self, decision: PHDecision) -> None:
        """A reused segment credits every anchor its correction used."""
        for used in decision.anchors if decision.reused else ():
            used.uses += 1

    def record_output(self, scope: Scope, agent: str, token_ids: Sequence[int], kv: SegmentKV | None,
                      hidden: torch.Tensor | None = None) -> None:
        """An agent's decoded output becomes the source of its `out:<agent>` slot."""
        if kv is not None and token_ids and self.strategy.reuse:
            self.store.put(scope, f"out:{agent}", agent, token_ids, kv, "decoded", hidden=hidden)

    def _observe_layers(self, scope: Scope, source: Materialization, token_ids: Sequence[int],
                        dense: SegmentKV) -> None:
        """DroidSpeak's profiling: how far each layer of the re-aligned source is from the dense target."""
        shared = common_prefix(source.token_ids, token_ids)
        profile = self._profile(scope)
        if shared == 0 or profile.ready:
            return
        try:
            profile.observe(self.engine.realign(source.kv.slice(0, shared), 0),
                            self.engine.realign(dense.slice(0, shared), 0))
        except Exception as exc:  # noqa: BLE001 - a transition lost to profiling, never the call
            self.fault("profile_error", f"profiling the layers of slot {source.slot!r}", exc)

    def _build_anchor(self, agent: str, source: Materialization, token_ids: Sequence[int],
                      dense: SegmentKV) -> tuple | None:
        """The arguments of `AnchorBank.add` for the correction this fallback observed (without the
        pool key), or None when there is nothing to learn. Changes nothing."""
        shared = common_prefix(source.token_ids, token_ids)
        existing = self.bank.anchor((source.scope.tenant, source.slot), source.id)
        if shared == 0 or (existing is not None and existing.length != shared):
            return None  # an anchor's corrections all cover its base's tokens
        aligned = self.engine.realign(source.kv.slice(0, shared), 0)
        target = self.engine.realign(dense.slice(0, shared), 0)
        src_k, src_v = as_rows(aligned.keys).float(), as_rows(aligned.values).float()  # (L, S, F)
        tgt_k, tgt_v = as_rows(target.keys).float(), as_rows(target.values).float()
        delta_k, delta_v = tgt_k[1:] - src_k[1:], tgt_v[1:] - src_v[1:]  # (L-1, S, F)
        if not (torch.isfinite(delta_k).all() and torch.isfinite(delta_v).all()):
            self.fault("nonfinite_delta", f"the observed correction of slot {source.slot!r} holds NaN or Inf")
            return None
        s = self.strategy
        if existing is not None:
            base_k, base_v = existing.keys, existing.values
        else:
            base_k, base_v = factorize(src_k, s.base_rank), factorize(src_v, s.base_rank)
        correction = Correction(factorize(delta_k, s.delta_rank), factorize(delta_v, s.delta_rank))
        return source.id, source.agent, base_k, base_v, agent, correction


def _fits(anchor: Anchor, num_layers: int, features: int) -> bool:
    """The anchor's shapes fit the model; an anchor too corrupt to say does not."""
    try:
        return anchor.fits(num_layers, features)
    except Exception:  # noqa: BLE001 - factors that are not even tensors
        return False
