"""Travel planner: an AutoGen SelectorGroupChat (planner, local guide, language and summary agents)
on the default model (embedded engine, or `--engine vllm`), run under KVCMAS and under NonShared, and
compared hop by hop and over all trips: mean TTFT, the wall time and the prefill work of a trip's workflow.

The selector is the model itself (an agent of its own, `selector`) where there is a choice: who
opens. A candidate function then keeps each agent to one turn and the summary agent last, so a
run is the selector's call and four agent hops.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any, Sequence

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.teams import SelectorGroupChat

from agentcache.engine.choice import ENGINE_KINDS
from agentcache.metrics import CallResult
from agentcache_autogen import AgentCacheChatCompletionClient
from agentcache_samples._compare import StrategyRuns, figures, format_table, write_report

__all__ = ["AGENTS", "TRIPS", "build_team", "run_trips", "main"]

BASELINE = "nonshared"

# Gemma 3 270M is a base model: each system message ends with one example answer in the
# transcript's layout, so the model sees the form of a reply.
_EXAMPLE_TASK = "Two friends want a weekend in Porto in June. They like wine, old streets and the sea."
AGENTS = {
    "Planner": ("Plans the trip day by day.",
                "You are the planner of a travel team. You split the trip into days and list the visits of each "
                f"day in order.\n\n### user\n{_EXAMPLE_TASK}\n\n### Planner\n"
                "Day 1: Ribeira and the Luis I bridge, a boat trip on the Douro. Day 2: Livraria Lello in the "
                "morning, the port cellars of Gaia in the afternoon, sunset at Foz."),
    "Guide": ("Knows the city: neighbourhoods, transport, food.",
              "You are the local guide. You suggest neighbourhoods, food and how to get around."
              f"\n\n### user\n{_EXAMPLE_TASK}\n\n### Guide\n"
              "Stay in Ribeira. Take tram 1 to Foz. Eat a francesinha at Cafe Santiago and grilled sardines "
              "in Matosinhos."),
    "Linguist": ("Teaches useful phrases in the local language.",
                 "You are the language expert. You give a few short phrases in the local language with their "
                 f"meaning.\n\n### user\n{_EXAMPLE_TASK}\n\n### Linguist\n"
                 "Obrigado (thank you). Bom dia (good morning). A conta, por favor (the bill, please)."),
    "Summary": ("Writes the final plan from the team's notes.",
                "You are the summary writer. You merge the notes of the team into one short final plan."
                f"\n\n### user\n{_EXAMPLE_TASK}\n\n### Summary\n"
                "Weekend in Porto: day 1 Ribeira, the bridge and a Douro boat trip; day 2 Lello, Gaia's "
                "cellars and sunset at Foz. Say obrigado and bom dia."),
}
# Worded for a base model: it tends to answer with the first role named ("Planner: ...").
SELECTOR_PROMPT = "Team roles:\n{roles}\n\nConversation:\n{history}\n\nThe next speaker, one of {participants}, is"
TRIPS = (
    "A family of four wants three days in Lisbon in May. They like museums, parks and seafood, dislike long "
    "walks uphill, and have 1200 euros for hotel, food, transport and tickets.",
    "Two students want a weekend in Kyoto in autumn on a small budget. They like temples, gardens and street "
    "food, and want to see the maple leaves.",
    "A couple wants four days in Rome in October. They like ancient history, good coffee and long dinners, and "
    "want one day trip outside the city.",
)


def _candidates(messages: Sequence[Any]) -> list[str]:
    """The model chooses who opens (planner, guide or linguist); then the others follow in team
    order and the summary closes. Gemma 3 270M, a base model, cannot pick a speaker from a
    conversation (it copies the prompt), and AutoGen's fallback is to repeat the previous speaker."""
    spoken = {m.source for m in messages}
    left = [name for name in AGENTS if name not in spoken and name != "Summary"]
    if len(spoken) <= 1:  # only the user's task so far
        return left
    return left[:1] or ["Summary"]


def build_team(agent_client: AgentCacheChatCompletionClient, selector_client: AgentCacheChatCompletionClient):
    participants = [AssistantAgent(name, model_client=agent_client, system_message=system, description=about)
                    for name, (about, system) in AGENTS.items()]
    return SelectorGroupChat(participants, model_client=selector_client, candidate_func=_candidates,
                             selector_prompt=SELECTOR_PROMPT,
                             termination_condition=MaxMessageTermination(len(AGENTS) + 1),
                             max_selector_attempts=2)


def run_trips(
    model: str = "gemma3-270m",
    trips: int = 3,
    strategies: Sequence[str] = ("kvcmas", "nonshared"),
    agent_tokens: int = 64,
    progress: bool = True,
    engine: str = "embedded",
) -> dict[str, Any]:
    """Each trip runs once per strategy (rotated); the last trip's hops are compared one by one, and
    each strategy's calls over all trips give its row, with the mean wall time and prefill work of a trip."""
    from tqdm import tqdm

    if BASELINE not in strategies:
        strategies = (*strategies, BASELINE)
    baseline = BASELINE
    started = time.perf_counter()
    runs = StrategyRuns(model, strategies, progress, engine=engine)
    calls: dict[str, list[list[CallResult]]] = {s: [] for s in strategies}
    walls: dict[str, list[float]] = {s: [] for s in strategies}  # each trip's workflow wall time
    transcripts: dict[str, list[tuple[str, str]]] = {}
    bar = tqdm(total=trips * len(strategies), desc="travel planner", unit="run", disable=not progress)
    for index, task in enumerate(TRIPS[:trips]):
        for name in runs.order(index):
            bar.set_postfix_str(f"trip {index + 1}, {name}")
            runtime = runs.runtimes[name]
            agent_client = AgentCacheChatCompletionClient(runtime, max_tokens=agent_tokens)
            selector_client = AgentCacheChatCompletionClient(runtime, max_tokens=8)
            before = len(runtime.results)
            began = time.perf_counter()
            result = asyncio.run(build_team(agent_client, selector_client).run(task=task))
            walls[name].append(time.perf_counter() - began)
            calls[name].append(runtime.results[before:])
            transcripts[name] = [(m.source, m.content) for m in result.messages]
            bar.update(1)
    bar.close()

    main_strategy = strategies[0]
    last = {name: calls[name][-1] for name in strategies}
    hops = []
    for i, (mine, theirs) in enumerate(zip(last[main_strategy], last[baseline])):
        hops.append({"hop": i + 1, "agent": mine.agent, "baseline_agent": theirs.agent,
                     "prompt_tokens": mine.prompt_tokens, "ttft_s": mine.ttft_s, "baseline_ttft_s": theirs.ttft_s,
                     "ratio": mine.ttft_s / theirs.ttft_s if theirs.ttft_s else None,
                     "cached_tokens": mine.cached_tokens, "reused_tokens": mine.reused_tokens,
                     "decisions": " ".join(f"{s.name}={s.decision}" for s in mine.segments if s.kind == "ph")})
    flat = {name: [r for run in calls[name] for r in run] for name in strategies}
    base_wall = sum(walls[baseline])
    rows = []
    for name in strategies:
        paired = flat[baseline] if name != baseline and _same_agents(flat[name], flat[baseline]) else None
        rows.append({"strategy": name, **figures(flat[name], paired),
                     "workflow_wall_s": sum(walls[name]) / len(walls[name]),
                     "wall_vs_baseline": sum(walls[name]) / base_wall if base_wall else None,
                     "prefill_tokens_per_workflow": sum(r.prefill_tokens for r in flat[name]) / len(walls[name]),
                     "refusal": runs.runtimes[name].refusal})
    return {
        "model": model, "engine": engine, "trips": trips, "agent_tokens": agent_tokens, "total_s": time.perf_counter() - started,
        "same_hops": _same_agents(last[main_strategy], last[baseline]), "hops": hops, "strategies": rows,
        "transcript": transcripts[main_strategy], "baseline_transcript": transcripts[baseline],
    }


def _same_agents(a: Sequence[CallResult], b: Sequence[CallResult]) -> bool:
    return [r.agent for r in a] == [r.agent for r in b]


HOP_COLUMNS = (("hop", "hop", ""), ("agent", "agent", ""), ("prompt_tokens", "prompt", ""),
               ("ttft_s", "TTFT s", ".3f"), ("baseline_ttft_s", "nonshared s", ".3f"), ("ratio", "ratio", ".2f"),
               ("cached_tokens", "cached", ""), ("reused_tokens", "reused", ""), ("decisions", "shared segments", ""))
SUMMARY_COLUMNS = (("strategy", "strategy", ""), ("calls", "calls", ""), ("ttft_mean_s", "mean TTFT s", ".3f"),
                   ("ttft_vs_baseline", "vs nonshared", ".2f"), ("workflow_wall_s", "wall s per trip", ".2f"),
                   ("wall_vs_baseline", "vs nonshared", ".2f"),
                   ("prefill_tokens_per_workflow", "prefill tokens/trip", ".0f"), ("reuse_ratio", "reuse ratio", ".2f"),
                   ("hit_rate", "hit rate", ".2f"))


def print_report(report: dict[str, Any]) -> None:
    print("\nThe plan (last trip, first strategy):")
    for source, content in report["transcript"]:
        print(f"--- {source}\n{content.strip()}")
    print(f"\nPer hop, last trip ({report['model']}):")
    print(format_table(report["hops"], HOP_COLUMNS))
    if not report["same_hops"]:
        print("(the two runs chose different speakers: hops are paired by position)")
    print(f"\nAll {report['trips']} trips ({report['total_s']:.0f} s):")
    print(format_table(report["strategies"], SUMMARY_COLUMNS))
    for row in report["strategies"]:
        if row["refusal"]:
            print(f"note: {row['strategy']} ran as NonShared: {row['refusal']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentcache_samples.travel_planner", description=__doc__)
    parser.add_argument("--model", default="gemma3-270m", help="preset name or local HF model directory")
    parser.add_argument("--engine", default="embedded", choices=ENGINE_KINDS,
                        help="embedded (PyTorch, the default) or vllm (in-process vLLM, the `vllm` extra)")
    parser.add_argument("--trips", type=int, default=3, choices=range(1, len(TRIPS) + 1))
    parser.add_argument("--agent-tokens", type=int, default=64)
    parser.add_argument("--results", default="results")
    args = parser.parse_args(argv)
    report = run_trips(args.model, args.trips, agent_tokens=args.agent_tokens, engine=args.engine)
    print_report(report)
    for path in write_report(report, Path(args.results), "travel_planner"):
        print(f"wrote {path}")
    return 0
