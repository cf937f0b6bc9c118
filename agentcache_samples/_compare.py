"""What both samples share: one runtime per strategy over one set of weights, run interleaved,
and the figures, table and JSON/PNG report that compare them."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from agentcache import Runtime, check_model
from agentcache.engine.choice import open_engine
from agentcache.engine.precision import dtype_name
from agentcache.metrics import CallResult, summarize

__all__ = ["StrategyRuns", "agent_means", "answer_scores", "figures", "format_table", "progress", "runtime_figures",
           "write_report"]


@dataclass
class StrategyRuns:
    """One Runtime per strategy, each on its own block pool (embedded: over the same model weights;
    vLLM: an engine each). The model self-check runs once and is shared (it does not depend on the
    strategy). With `anchors_dir`, each strategy's anchor pools persist in a folder of its own
    there, and `restart()` starts new runtimes from what the old ones saved."""

    model: str
    strategies: Sequence[str]
    progress: bool = True
    engine: str = "embedded"  # or "vllm": each strategy then has a vLLM engine of its own
    anchors_dir: Path | None = None
    dtype: str = "auto"  # the engines' weights and KV (auto: float32 on a CPU, bfloat16 on CUDA)
    # the strategy of a runtime whose name is none (a control: a second runtime of one strategy)
    strategy_of: dict[str, str] = field(default_factory=dict)
    runtimes: dict[str, Runtime] = field(init=False)
    setup_s: float = field(init=False)  # loading and checking the model

    def __post_init__(self) -> None:
        from tqdm import tqdm

        started = time.perf_counter()
        with tqdm(total=2, desc=f"loading {self.model}", unit="step", disable=not self.progress) as bar:
            self._base = open_engine(self.engine, self.model, instance="check", **self._placement)
            bar.set_description(f"checking {self.model} (agentcache check)")
            bar.update(1)
            self._check = check_model(self._base)
            bar.update(1)
        self.runtimes = self._new_runtimes()
        self.setup_s = time.perf_counter() - started

    def _new_runtimes(self) -> dict[str, Runtime]:
        engines = {s: self._base.fresh() if self.engine == "embedded"
                   else open_engine(self.engine, self.model, instance=s, **self._placement) for s in self.strategies}
        return {s: Runtime(engines[s], strategy=self.strategy_of.get(s, s), check=self._check,
                           anchors_dir=None if self.anchors_dir is None else Path(self.anchors_dir) / s)
                for s in self.strategies}

    @property
    def kv_dtype(self) -> str:
        """The dtype the engines run in, by name."""
        return dtype_name(self._base.layout.dtype)

    @property
    def _placement(self) -> dict[str, str]:
        return {} if self.dtype == "auto" else {"dtype": self.dtype}

    def restart(self) -> dict[str, dict[str, int]]:
        """Close every runtime (saving its anchor pools) and start new ones on empty caches, from
        the saved pools; what each new runtime loaded (anchors, verified edges)."""
        for runtime in self.runtimes.values():
            runtime.close()
        self.runtimes = self._new_runtimes()
        return {s: {"anchors": rt.summary().get("anchors_loaded", 0), "verified_edges": rt.summary().get("verified_edges", 0)}
                for s, rt in self.runtimes.items()}

    def invoke(self, name: str, graph: Any, inputs: dict, thread_id: str,
               agents: Sequence[str]) -> tuple[dict, list[CallResult], float]:
        """Run a compiled graph once on strategy `name`'s runtime: its final state, the calls it
        made in `agents`' order (siblings that ran side by side finish in any order), and its wall time."""
        runtime = self.runtimes[name]
        before = runtime.log.figures.calls  # every call counted: `results` keeps only the newest
        began = time.perf_counter()
        state = graph.invoke(inputs, {"configurable": {"thread_id": thread_id}})
        wall = time.perf_counter() - began
        made = runtime.log.figures.calls - before
        calls = runtime.results[-made:] if made else []
        return state, sorted(calls, key=lambda r: list(agents).index(r.agent)), wall

    def order(self, round_index: int) -> list[str]:
        """The strategies rotated by round, so none always runs first on a warm machine."""
        names = list(self.strategies)
        shift = round_index % len(names)
        return names[shift:] + names[:shift]


def progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", disable=not enabled)


def agent_means(results: Sequence[CallResult], agents: Sequence[str], *, queued: bool = False) -> dict[str, float | None]:
    """Each agent's mean TTFT: less the wait behind other calls (what the call itself cost; a
    fan-out's siblings share one engine), or with it when `queued`."""
    out = {}
    for agent in agents:
        times = [r.ttft_s if queued else r.ttft_s - r.queued_s for r in results if r.agent == agent]
        out[agent] = sum(times) / len(times) if times else None
    return out


def answer_scores(answers: Sequence[Any], truth: Sequence[Any], baseline: Sequence[Any]) -> dict[str, float]:
    """`accuracy` (answers equal to the truth) and `agree` (answers equal to the baseline's)."""
    return {"accuracy": sum(a == t for a, t in zip(answers, truth)) / len(truth),
            "agree": sum(a == b for a, b in zip(answers, baseline)) / len(truth)}


def runtime_figures(runtime: Runtime) -> dict[str, Any]:
    """What a strategy's runtime holds at the end: anchor bytes, faults, and why it refused to correct."""
    summary = runtime.summary()
    return {"anchor_bytes": summary["anchor_bytes"], "faults": summary["faults"], "refusal": runtime.refusal}


def figures(results: Sequence[CallResult], baseline: Sequence[CallResult] | None) -> dict[str, Any]:
    """Aggregate figures of one strategy's calls; TTFT against the baseline's same calls."""
    summary = summarize(list(results))
    out = {key: summary[key] for key in ("calls", "prompt_tokens", "hit_rate", "reuse_ratio", "ttft_mean_s",
                                         "ttft_p50_s", "ttft_p90_s", "service_ttft_mean_s", "queued_mean_s",
                                         "ph_decisions", "fallback_reasons")}
    if baseline:
        theirs = summarize(list(baseline))
        for key in ("ttft_mean_s", "service_ttft_mean_s"):
            ratio_key = key.replace("_mean_s", "_vs_baseline")
            out[ratio_key] = summary[key] / theirs[key] if summary[key] and theirs[key] else None
        pairs = [(a.ttft_s - a.queued_s, b.ttft_s - b.queued_s) for a, b in zip(results, baseline)]
        out["service_ratio_median"] = statistics.median(a / b for a, b in pairs if b > 0) if pairs else None
    return out


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A plain-text table; columns are (key, header, format spec)."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([_cell(row.get(key), spec) for key, _, spec in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(text.ljust(w) if i == 0 else text.rjust(w) for i, (text, w) in enumerate(zip(line, widths)))
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and spec:
        return format(value, spec)
    return str(value)


def write_report(report: dict[str, Any], directory: Path, name: str, plot: Any = None) -> list[Path]:
    """`<name>.json`, and `<name>.png` drawn by `plot(axes_figure)` when matplotlib is installed."""
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / f"{name}.json"]
    written[0].write_text(json.dumps(report, indent=2, default=str))
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed (pip install 'agentcache[bench]'): no plot written")
            return written
        fig = plot(plt)
        path = directory / f"{name}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
