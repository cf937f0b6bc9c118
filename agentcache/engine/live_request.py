"""A request admitted by the embedded engine's scheduler, from admission to its result: what the
scheduler and its prefill passes both read and write."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from agentcache.engine.cache_manager import Lease
from agentcache.engine.grammar import GrammarState
from agentcache.engine.kv import CallCache
from agentcache.engine.loop import Job
from agentcache.engine.prefill import PrefillLayout
from agentcache.engine.protocol import ExecRequest
from agentcache.engine.recompute import HiddenRecord

__all__ = ["LiveRequest", "job_order"]


@dataclass(eq=False)
class LiveRequest:
    """An admitted request, from admission to its result."""

    job: Job
    prompt: list[int]  # the request's tokens, joined once
    lease: Lease
    cache: CallCache
    digests: dict[int, bytes]  # position -> digest of the tokens before it (what KV ending there is exact for)
    layout: PrefillLayout  # where each prompt token comes from, and the passes computing the rest
    prefill: Iterator[None] | None = None  # one prefill chunk per next(); None once the prompt is in
    logits: torch.Tensor | None = None  # (V,) at the last prompt position
    first_approx: int | None = None  # first position whose KV is not exact for this prompt
    recomputed: dict[int, float] = field(default_factory=dict)  # segment -> tokens' worth recomputed
    probed: dict[int, float] = field(default_factory=dict)  # segment -> CacheBlend probe work, in tokens
    hidden: HiddenRecord | None = None  # the hidden states entering `request.hidden_layer`, when asked
    generator: torch.Generator | None = None
    grammar: GrammarState | None = None  # the output constraint's matcher, when the request has one
    grammar_s: float = 0.0  # time its matcher took since the last decode step was counted
    generated: list[int] = field(default_factory=list)
    ttft: float = 0.0
    text: str = ""
    finish: str = "length"
    decoding: bool = False  # in the decode rows
    admitted: float = field(default_factory=time.perf_counter)
    overtaken: int = 0  # prefill passes shorter requests ran before it, in a row (the scheduler bounds it)

    @property
    def request(self) -> ExecRequest:
        return self.job.request

    @property
    def order(self) -> tuple:
        return job_order(self.job)


def job_order(job: Job) -> tuple:
    return (job.request.warmup, job.request.priority, job.seq)
