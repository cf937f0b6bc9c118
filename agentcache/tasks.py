"""Synthetic tasks with checkable answers, and the four-agent workflow the benchmarks run.

Nothing is downloaded: problems are generated from a seed. `fact_problem` hides one code among
several records (retrieval a small base model can do from context), `document_problem` one among
a long staff directory (2-4K tokens: the long shared context of a document team);
`arithmetic_problem` is a GSM8K-style word problem with a known integer answer.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

from agentcache.engine.protocol import SamplingParams
from agentcache.metrics import CallResult
from agentcache.segments import AgentCall, Segment, output_slot

__all__ = ["Problem", "fact_problem", "document_problem", "filler_tokens", "arithmetic_problem", "gsm8k_style_problem", "first_number", "FourAgentWorkflow"]

_NAMES = ["Alice", "Bruno", "Chen", "Dana", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kofi", "Lena",
          "Marco", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wes", "Yara"]
_THINGS = ["locker code", "room number", "badge number", "parcel code", "seat number", "ticket code"]


@dataclass(frozen=True)
class Problem:
    text: str  # the shared query (PH `query`)
    answer: int
    subject: str  # what the final agent completes, e.g. "the locker code of Dana is"


def fact_problem(seed: int, records: int = 8) -> Problem:
    rng = random.Random(seed)
    thing = rng.choice(_THINGS)
    names = rng.sample(_NAMES, records)
    codes = rng.sample(range(1000, 10000), records)
    lines = [f"- The {thing} of {name} is {code}." for name, code in zip(names, codes)]
    target = rng.randrange(records)
    text = "Records:\n" + "\n".join(lines) + f"\nQuestion: What is the {thing} of {names[target]}?"
    return Problem(text, codes[target], f"the {thing} of {names[target]} is")


_TEAMS = ["billing", "logistics", "support", "research", "design", "security", "payroll", "sales"]
_FLOORS = ["first", "second", "third", "fourth", "fifth"]


def document_problem(seed: int, people: int = 60, *, distinct_names: bool = False) -> Problem:
    """A long staff directory (about 50 tokens per person: 60 people are about 3,000 Gemma tokens)
    and a question about one person's locker code: retrieval from a long shared document, with
    other numbers about everyone around it. By default first names repeat with distinct surnames,
    so only the full name identifies the person (hard for a small base model); with
    `distinct_names` every person has a first name of their own (at most 60 people)."""
    rng = random.Random(seed)
    surnames = ["Silva", "Moreau", "Rossi", "Novak", "Berg", "Costa", "Weber", "Nowak", "Lund", "Ortiz"]
    if distinct_names:
        if people > len(_DISTINCT_FIRST_NAMES):
            raise ValueError(f"distinct_names allows at most {len(_DISTINCT_FIRST_NAMES)} people, got {people}")
        full_names = [f"{first} {rng.choice(surnames)}" for first in rng.sample(_DISTINCT_FIRST_NAMES, people)]
    else:
        full_names = rng.sample([f"{first} {last}" for first in _NAMES for last in surnames], people)
    codes = rng.sample(range(1000, 10000), people)
    paragraphs = []
    for name, code in zip(full_names, codes):
        city, team, floor = rng.choice(_CITIES), rng.choice(_TEAMS), rng.choice(_FLOORS)
        paragraphs.append(
            f"{name} works in the {city} office on the {floor} floor and has been on the {team} team for "
            f"{rng.randint(2, 19)} years. The locker code of {name} is {code}. {name.split()[0]} takes "
            f"{rng.randint(10, 60)} minutes to get to work.")
    target = rng.randrange(people)
    text = ("Staff directory\n\n" + "\n".join(paragraphs)
            + f"\n\nQuestion: What is the locker code of {full_names[target]}?")
    return Problem(text, codes[target], f"the locker code of {full_names[target]} is")


def filler_tokens(tokenize: Callable[..., list[int]], tokens: int, salt: int) -> list[int]:
    """Exactly `tokens` token ids of filler prose, BOS first (`tokenize(text, bos=True)`), varied by
    `salt`: timing prompts with no prefix in common between salts."""
    words = "the travel planner reads every hotel review and each agent adds its notes".split()
    ids = tokenize(" ".join(words[(i * 7 + salt) % len(words)] for i in range(tokens)), bos=True)
    if len(ids) < tokens:
        raise ValueError(f"filler text gave {len(ids)} tokens, wanted {tokens}")
    return ids[:tokens]


def directory_people(tokenize: Callable[[str], list[int]], tokens: int, minimum: int = 1) -> int:
    """People in a `document_problem` of about `tokens` tokens on this tokenizer (at least
    `minimum`, at most 240): the directory's length is linear in its people."""
    small, large = (len(tokenize(document_problem(0, people=p).text)) for p in (2, 6))
    per_person = (large - small) / 4
    return int(min(240, max(minimum, round(2 + (tokens - small) / per_person))))


def arithmetic_problem(seed: int) -> Problem:
    rng = random.Random(seed)
    name = rng.choice(_NAMES)
    start, bought, given = rng.randint(5, 40), rng.randint(2, 30), rng.randint(1, 5)
    price = rng.randint(2, 9)
    text = (f"{name} has {start} marbles. {name} buys {bought} more marbles and then gives away {given} marbles. "
            f"Each marble is worth {price} dollars. How many dollars are {name}'s marbles worth now?")
    return Problem(text, (start + bought - given) * price, "the answer is")


_DISTINCT_FIRST_NAMES = _NAMES + [
    "Anna", "Boris", "Carla", "David", "Emma", "Felix", "Gina", "Henri", "Ivan", "Julia", "Karim", "Laura",
    "Mateo", "Nina", "Oscar", "Paula", "Rafael", "Sara", "Tomas", "Ursula", "Victor", "Wanda", "Xavier", "Zoe",
    "Amir", "Bianca", "Cyril", "Daria", "Emil", "Fatima", "Gustav", "Hanna", "Igor", "Jana", "Leon", "Mira"]
_CITIES = ["Lisbon", "Porto", "Lyon", "Turin", "Ghent", "Malmo", "Bergen", "Krakow", "Seville", "Graz"]
# (question, answer) templates over three drawn numbers a, b, c and a name n, GSM8K-style (two steps)
_WORD_PROBLEMS: tuple[tuple[str, Callable[[int, int, int], int]], ...] = (
    ("{n} bakes {a} cookies in the morning and {b} cookies in the afternoon, then gives {c} cookies to friends. "
     "How many cookies does {n} have left?", lambda a, b, c: a + b - c),
    ("A box holds {a} pencils. A teacher buys {b} boxes and hands out {c} pencils to the class. "
     "How many pencils does the teacher have left?", lambda a, b, c: a * b - c),
    ("{n} earns {a} dollars per hour and works {b} hours on Monday and {c} hours on Tuesday. "
     "How many dollars does {n} earn on the two days?", lambda a, b, c: a * (b + c)),
    ("A train travels at {a} kilometres per hour for {b} hours and then {c} more kilometres. "
     "How many kilometres does the train travel in total?", lambda a, b, c: a * b + c),
    ("{n} has {a} stickers and buys {b} packs of {c} stickers each. How many stickers does {n} have now?",
     lambda a, b, c: a + b * c),
)


def gsm8k_style_problem(seed: int, background: int = 2) -> Problem:
    """A two-step word problem with a known integer answer, after `background` sentences of
    irrelevant detail (as GSM8K problems carry), so the shared question is a few lines long."""
    rng = random.Random(seed)
    name, city = rng.choice(_NAMES), rng.choice(_CITIES)
    template, solve = rng.choice(_WORD_PROBLEMS)
    a, b = rng.randint(3, 12), rng.randint(2, 9)
    c = rng.randint(1, min(a + b - 1, 9))  # keeps every template's answer positive
    facts = [f"{name} lives in {city} with {rng.randint(2, 5)} cats.",
             f"On weekends {name} walks {rng.randint(2, 9)} kilometres along the river.",
             f"{name}'s favourite number is {rng.randint(10, 99)}, but it plays no part here.",
             f"The local market opens at {rng.randint(6, 9)} in the morning."]
    text = " ".join(facts[:background] + [template.format(n=name, a=a, b=b, c=c)])
    return Problem(text, solve(a, b, c), "the answer is")


def first_number(text: str) -> int | None:
    match = re.search(r"-?\d[\d,]*", text)
    return int(match.group().replace(",", "")) if match else None


@dataclass(frozen=True)
class _Role:
    name: str
    system: str
    glue: str  # after the query, before the agent writes; "{subject}" is the problem's subject


_ROLES = (
    _Role("retriever", "You are a retriever. You find the record that answers the question and quote its value.\n\n",
          "\nFound in the records: {subject}"),
    _Role("reader", "You are a careful reader. You answer questions about the records with the exact number.\n\n",
          "\nAnswer: {subject}"),
    _Role("verifier", "You are a verifier. You check the records twice and state the correct value.\n\n",
          "\nChecked against the records, {subject}"),
)
_FINAL = "final"


class FourAgentWorkflow:
    """Three role agents read the shared query in turn; a final agent reads the query and their
    outputs (fan-in) and gives the answer. The query's chain is retriever -> reader -> verifier ->
    final; each output's source is the agent that wrote it."""

    agents = tuple(r.name for r in _ROLES) + (_FINAL,)

    def __init__(self, role_tokens: int = 16, final_tokens: int = 8) -> None:
        self.role_sampling = SamplingParams(max_tokens=role_tokens, stop=("\n",))
        self.final_sampling = SamplingParams(max_tokens=final_tokens, stop=("\n",))

    def role_call(self, role: _Role, problem: Problem) -> AgentCall:
        return AgentCall(agent=role.name, segments=(
            Segment.pf(role.system), Segment.ph("query", problem.text),
            Segment.pf(role.glue.format(subject=problem.subject))))

    def final_call(self, problem: Problem, outputs: dict[str, str]) -> AgentCall:
        segments = [Segment.pf("You are the final judge. Read the question and what the other agents said, "
                               "then give the final answer.\n\n"),
                    Segment.ph("query", problem.text)]
        for role in _ROLES:
            segments.append(Segment.pf(f"\nThe {role.name} said:"))
            segments.append(Segment.ph(output_slot(role.name), outputs[role.name] or " (nothing)"))
        segments.append(Segment.pf(f"\nFinal answer: {problem.subject}"))
        return AgentCall(agent=_FINAL, segments=tuple(segments))

    def run(self, execute: Callable[[AgentCall, SamplingParams], CallResult], problem: Problem) -> list[CallResult]:
        """Run the four calls through `execute` (for example `Runtime.run`) and return their results."""
        results, outputs = [], {}
        for role in _ROLES:
            result = execute(self.role_call(role, problem), self.role_sampling)
            outputs[role.name] = result.text
            results.append(result)
        results.append(execute(self.final_call(problem, outputs), self.final_sampling))
        return results

    @staticmethod
    def correct(results: list[CallResult], problem: Problem) -> bool:
        return first_number(results[-1].text) == problem.answer
