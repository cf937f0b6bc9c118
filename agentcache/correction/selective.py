"""Selective recomputation (CacheBlend, DroidSpeak): what a reused segment rebuilds.

Both reuse the aligned source cache of a shared segment and rebuild a fixed share 1 − ρ of it
under the consumer's own context, through the engine's `recompute` step:

- CacheBlend (token-wise, Yao et al. 2025) rebuilds the tokens whose KV deviates most at an early
  layer: `token_plan`.
- DroidSpeak (layer-wise, Liu et al.) rebuilds a contiguous group of layers for every token,
  starting from the hidden states that entered the group's first layer when the source computed
  the segment (its "E cache"). The group is the one whose KV deviates most, found by profiling:
  `LayerProfile` averages the per-layer deviation of the first dense transitions, then fixes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from agentcache.correction.plan import PHDecision
from agentcache.correction.records import PreparedAnchor
from agentcache.correction.sourced import SourcedStrategy, raw_reuse
from agentcache.correction.store import Materialization
from agentcache.correction.strategies import Strategy
from agentcache.engine.kv import SegmentKV
from agentcache.engine.protocol import Engine, LayerRecompute, SegmentPlan, TokenRecompute
from agentcache.engine.tokens import common_prefix
from agentcache.isolation import Scope

__all__ = ["Selective", "LayerProfile", "layer_count", "token_plan"]


def token_plan(rho: float, probe_layer: int) -> TokenRecompute:
    """CacheBlend's step: rebuild 1 − ρ of the tokens, picked at `probe_layer`."""
    return TokenRecompute(1.0 - rho, probe_layer)


def layer_count(rho: float, num_layers: int) -> int:
    """Layers DroidSpeak rebuilds to reuse the share ρ of a segment's KV (whole layers, nearest)."""
    return min(num_layers, max(0, round((1.0 - rho) * num_layers)))


class Selective(SourcedStrategy):
    """CacheBlend or DroidSpeak: a reused segment's `PHDecision.detail` is the engine's recompute
    step (`TokenRecompute` or `LayerRecompute`) for its covered tokens."""

    def __init__(self, engine: Engine, settings: Strategy, anchor_bytes: int, store_bytes: int) -> None:
        super().__init__(engine, settings, anchor_bytes, store_bytes)
        self.profiles: dict[str | None, LayerProfile] = {}  # DroidSpeak: per tenant

    def reuse(self, scope: Scope, agent: str, slot: str, source: Materialization, shared: int,
              start: int) -> PHDecision:
        """Reuse the source (the engine moves it where the call reads it), the engine rebuilding 1 − ρ of it."""
        kv = source.kv.slice(0, shared)
        s = self.strategy
        if s.recompute == "tokens":
            return PHDecision("recomputed", source=source, covered=shared, inject=kv,
                              detail=token_plan(s.rho, s.probe_layer))
        profile = self._profile(scope)
        if not profile.ready:
            return PHDecision("fallback", reason="profiling", source=source)
        if layer_count(s.rho, profile.num_layers) == 0:
            return raw_reuse(source, shared)
        hidden = source.hidden
        if hidden is None or hidden.shape[0] < shared:
            return PHDecision("fallback", reason="no_hidden_states", source=source)
        return PHDecision("recomputed", source=source, covered=shared, inject=kv,
                          detail=profile.recompute(s.rho, hidden[:shared]))

    def engine_segments(self, slot: str, tokens: Sequence[int], decision: PHDecision) -> list[SegmentPlan]:
        plans = super().engine_segments(slot, tokens, decision)
        step = decision.detail
        if isinstance(step, LayerRecompute):  # its hidden states cut to the injected tokens
            step = replace(step, hidden=step.hidden[:decision.covered])
        return [replace(plans[0], recompute=step), *plans[1:]]

    def hidden_layer(self, scope: Scope) -> int | None:
        """DroidSpeak's E cache: the first layer of its group, once profiling fixed the group."""
        s = self.strategy
        if s.recompute != "layers":
            return None
        profile = self._profile(scope)
        count = layer_count(s.rho, profile.num_layers)
        return profile.group(count)[0] if profile.ready and count else None

    def commit(self, scope: Scope, agent: str, slot: str, token_ids: Sequence[int], decision: PHDecision,
               kv: SegmentKV | None, how: str, *, own_tokens_exact: bool = True,
               hidden: torch.Tensor | None = None, prepared: PreparedAnchor | None = None) -> None:
        if kv is not None and decision.reason == "profiling" and decision.source is not None and own_tokens_exact:
            self._observe_layers(scope, decision.source, token_ids, kv)
        super().commit(scope, agent, slot, token_ids, decision, kv, how, own_tokens_exact=own_tokens_exact,
                       hidden=hidden, prepared=prepared)

    def _profile(self, scope: Scope) -> LayerProfile:
        profile = self.profiles.get(scope.tenant)
        if profile is None:
            profile = LayerProfile(self.engine.layout.num_layers, self.strategy.profile_transitions, self.engine.layout.device)
            self.profiles[scope.tenant] = profile
        return profile

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


class LayerProfile:
    """Per-layer KV deviation of reused sources against dense targets, over the first transitions."""

    def __init__(self, num_layers: int, needed: int, device: torch.device | str = "cpu") -> None:
        self.num_layers = num_layers
        self.needed = needed
        self.observed = 0
        self.deviation = torch.zeros(num_layers, dtype=torch.float64, device=device)  # summed relative error per layer

    @property
    def ready(self) -> bool:
        return self.observed >= self.needed

    def observe(self, aligned: SegmentKV, dense: SegmentKV) -> None:
        """One transition: the source re-aligned to canonical positions and the dense target there."""
        for part in ("keys", "values"):
            got, want = getattr(aligned, part).double(), getattr(dense, part).double()  # (L, H, T, D)
            error = (got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1).clamp_min(1e-30)  # (L,)
            self.deviation += error / 2
        self.observed += 1

    def group(self, count: int) -> tuple[int, int]:
        """The `count` consecutive layers with the largest summed deviation: (first, last)."""
        if not 1 <= count <= self.num_layers:
            raise ValueError(f"a layer group needs 1..{self.num_layers} layers, got {count}")
        sums = self.deviation.unfold(0, count, 1).sum(-1)  # (L - count + 1,)
        first = int(sums.argmax())
        return first, first + count - 1

    def recompute(self, rho: float, hidden: torch.Tensor) -> LayerRecompute | None:
        """DroidSpeak's step for a segment whose source left `hidden` (T, hidden size) at the group's
        first layer; None when ρ leaves no layer to rebuild."""
        count = layer_count(rho, self.num_layers)
        if count == 0:
            return None
        first, last = self.group(count)
        return LayerRecompute(first, last, hidden)
