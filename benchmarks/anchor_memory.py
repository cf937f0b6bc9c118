"""Anchor-pool memory: low-rank (KVCMAS) against full-dimensional (KVComm-style) anchors.

One slot's pool with V anchors, each holding a base cache and corrections for N consumers,
built through the real `AnchorBank` and `factorize` and counted in bytes from the tensors held.
The layout is the model's (layers, KV heads x head dim); the formula

    full     = V * (2*Ly*L*F + N * 2*(Ly-1)*L*F) * 4
    low-rank = V * (2*Ly*r*(L+F) + N * 2*(Ly-1)*r*(L+F)) * 4     (float32, r = 32)

is checked against the measured bytes and then gives the 32K row. A pool's V anchors all have
the same shapes, so its bytes are V times those of one anchor built and measured (a full pool
of V anchors is built at a short length to check that the bank adds up the same way). Full mode takes the KV and the
correction from real prefills of the model; `--quick` uses random tensors of the same layout
(bytes depend on shapes only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from agentcache.correction.anchors import AnchorBank, Correction
from agentcache.correction.lowrank import Factors, as_rows, factorize
from agentcache.engine import EmbeddedEngine, ExecRequest, SamplingParams, SegmentPlan, Step
from agentcache.models import DEFAULT_MODEL

FLOAT_BYTES = 4


def formula(length: int, layers: int, features: int, anchors: int, consumers: int, rank: int | None) -> int:
    if rank is None:
        per_base, per_delta = 2 * layers * length * features, 2 * (layers - 1) * length * features
    else:
        r = min(rank, length, features)
        per_base, per_delta = 2 * layers * r * (length + features), 2 * (layers - 1) * r * (length + features)
    return anchors * (per_base + consumers * per_delta) * FLOAT_BYTES


def _copy(f: Factors) -> Factors:
    return Factors(f.a.clone(), None if f.b is None else f.b.clone())


def anchor_bytes(kv: dict[str, torch.Tensor], consumers: int, rank: int | None, anchors: int = 1) -> tuple[int, float]:
    """Build `anchors` anchors of one slot's pool, each a base plus `consumers` corrections, through
    the real bank; kv: source rows and observed corrections, (Ly, L, F) and (Ly-1, L, F). Every
    anchor and correction holds its own tensors (copies of one factorization: the shapes, hence
    the bytes, are the same). Returns (bytes the bank holds, seconds to factorize one base and
    one correction)."""
    started = time.perf_counter()
    base = (factorize(kv["keys"], rank), factorize(kv["values"], rank))
    observed = (factorize(kv["delta_keys"], rank), factorize(kv["delta_values"], rank))
    build_s = time.perf_counter() - started
    bank = AnchorBank(capacity=anchors, byte_budget=2**62)
    for v in range(anchors):
        base_k, base_v = (_copy(f) for f in base)
        for n in range(consumers):
            delta = Correction(*(_copy(f) for f in observed))
            bank.add("query", f"source-{v}", "agent-0", base_k, base_v, f"agent-{n + 1}", delta)
    assert bank.num_anchors == anchors
    return bank.nbytes, build_s


def source_kv(engine: EmbeddedEngine, length: int, real: bool) -> dict[str, torch.Tensor]:
    """A source cache of `length` tokens and the correction to another agent's cache of it.

    Real: the same text prefilled after two different system prompts, keys re-aligned to position
    0, Δ = target − source. Quick: random tensors of the model's layout."""
    layout = engine.layout
    if not real:
        gen = torch.Generator().manual_seed(length)
        shape = (layout.num_layers, layout.num_kv_heads, length, layout.head_dim)
        rows = {name: as_rows(torch.randn(shape, generator=gen)) for name in ("keys", "values")}
        return rows | {f"delta_{name}": 0.1 * rows[name][1:] for name in ("keys", "values")}
    words = "the shared query lists every record and each agent reads it again".split()
    text = engine.tokenize(" " + " ".join(words[i % len(words)] for i in range(length)))[:length]
    caches = []
    for system in ("You are the planner.\n", "You are the critic and you check every claim.\n"):
        plan = [SegmentPlan("system", engine.tokenize(system, bos=True), Step.DENSE), SegmentPlan("context", text, Step.DENSE)]
        kv = engine.execute(ExecRequest(plan, SamplingParams(max_tokens=1))).segments[1].kv
        caches.append(engine.realign(kv, 0))
    source, target = caches
    rows = {name: as_rows(getattr(source, name)).float() for name in ("keys", "values")}
    return rows | {f"delta_{name}": as_rows(getattr(target, name)).float()[1:] - rows[name][1:]
                   for name in ("keys", "values")}


def effective_rank(rows: torch.Tensor, energy: float = 0.9) -> list[int]:
    """Per layer, the fewest singular values holding `energy` of the squared singular-value mass."""
    s2 = torch.linalg.svdvals(rows.double()).pow(2)  # (Ly, K)
    share = s2.cumsum(-1) / s2.sum(-1, keepdim=True)
    return [int((row < energy).sum()) + 1 for row in share]


# The paper's model (Llama-3.1-8B: 32 layers, 8 KV heads x 128), by the formula.
PAPER_LAYOUT = {"model": "llama-3.1-8b (formula)", "layers": 32, "features": 1024}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--anchors", type=int, default=10)
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=32)
    args = parser.parse_args(argv)

    engine = EmbeddedEngine(args.model)
    layout = engine.layout
    features = layout.num_kv_heads * layout.head_dim
    short = source_kv(engine, 256, real=False)
    one, _ = anchor_bytes(short, args.consumers, args.rank)
    pool, _ = anchor_bytes(short, args.consumers, args.rank, anchors=args.anchors)
    if pool != args.anchors * one:
        raise SystemExit(f"a pool of {args.anchors} anchors holds {pool} bytes, not {args.anchors} x {one}")
    rows = []
    for length in (2048, 8192):
        kv = source_kv(engine, length, real=not args.quick)
        low_one, low_s = anchor_bytes(kv, args.consumers, args.rank)
        full_one, _ = anchor_bytes(kv, args.consumers, None)
        low, full = args.anchors * low_one, args.anchors * full_one
        expected_low = formula(length, layout.num_layers, features, args.anchors, args.consumers, args.rank)
        expected_full = formula(length, layout.num_layers, features, args.anchors, args.consumers, None)
        rows.append({
            "L": length, "lowrank_bytes": low, "full_bytes": full, "ratio": full / low, "measured": True,
            "formula_matches": low == expected_low and full == expected_full,
            "lowrank_factorize_s": round(low_s, 3),
        })
        if not args.quick:
            rows[-1]["delta_effective_rank_90"] = {
                "keys": effective_rank(kv["delta_keys"]), "values": effective_rank(kv["delta_values"])}
    if all(r["formula_matches"] for r in rows):
        length = 32768
        low = formula(length, layout.num_layers, features, args.anchors, args.consumers, args.rank)
        full = formula(length, layout.num_layers, features, args.anchors, args.consumers, None)
        rows.append({"L": length, "lowrank_bytes": low, "full_bytes": full, "ratio": full / low, "measured": False})
    paper_rows = []
    for length in (2048, 8192, 32768):
        low = formula(length, PAPER_LAYOUT["layers"], PAPER_LAYOUT["features"], args.anchors, args.consumers, args.rank)
        full = formula(length, PAPER_LAYOUT["layers"], PAPER_LAYOUT["features"], args.anchors, args.consumers, None)
        paper_rows.append({"L": length, "lowrank_bytes": low, "full_bytes": full, "ratio": full / low})
    print(json.dumps({
        "model": engine.model_name,
        "layers": layout.num_layers, "kv_features_per_layer": features,
        "V": args.anchors, "N": args.consumers, "rank": args.rank,
        "max_ratio_F_over_r": features / args.rank,
        "source": "random tensors of the model's KV layout" if args.quick else
                  "KV of a real prefill and the observed correction to a second agent's prefill",
        "rows": rows,
        "paper_layout": {**PAPER_LAYOUT, "rows": paper_rows},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
