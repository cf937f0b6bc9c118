"""The swarm as a LangGraph graph: three experts fan out on a question (`Send`), a final
decision agent fans in and reads the question and their three answers.

Every node is an `@agent_node`, so the model calls it makes are that agent's: the experts'
prompts are [PF system][PH query][PF cue], the decision agent's
[PF system][PH query][PF][PH out:math_solver][PF][PH out:math_analyst][PF][PH out:programmer][PF cue].
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from agentcache_langgraph import AgentCacheChatModel, agent_node

__all__ = ["EXPERTS", "DECISION", "INSTRUCT_EXPERTS", "SwarmPrompts", "INSTRUCT_NUMBER", "INSTRUCT_CHOICE",
           "SwarmState", "build_swarm"]

# Gemma 3 270M is a base model: each system prompt carries one worked example in the transcript's
# own layout, so the model sees the form of an answer. The examples are the agents' fixed prefixes.
_EXAMPLE = ("Mia has 4 bags of 6 apples and eats 5 apples. How many apples does Mia have left?")
EXPERTS = {
    "math_solver": "You are the Math Solver. You solve grade-school math word problems step by step.\n\n"
                   f"### user\n{_EXAMPLE}\n\n### math_solver\n"
                   "Mia has 4 * 6 = 24 apples. After eating 5 she has 24 - 5 = 19. The answer is 19.",
    "math_analyst": "You are the Mathematical Analyst. You list the quantities in a word problem and how they "
                    "combine.\n\n"
                    f"### user\n{_EXAMPLE}\n\n### math_analyst\n"
                    "Quantities: 4 bags, 6 apples per bag, 5 eaten. Total is 4 * 6 = 24, minus 5 gives 19. "
                    "The answer is 19.",
    "programmer": "You are the Programming Expert. You compute the answer to a word problem with one Python "
                  "expression.\n\n"
                  f"### user\n{_EXAMPLE}\n\n### programmer\n"
                  "answer = 4 * 6 - 5  # 19. The answer is 19.",
}
DECISION = "decision"
DECISION_SYSTEM = ("You are the Final Decision agent. You read a word problem and three experts' answers and "
                   "give the final answer.\n\n"
                   f"### user\n{_EXAMPLE}\n\n### math_solver\nThe answer is 19.\n\n### math_analyst\n"
                   "The answer is 19.\n\n### programmer\nThe answer is 21.\n\n### decision\n"
                   "The answer is 19.")


# An instruct model (a ChatML one, such as Qwen2.5) is told what to do instead, and would copy an
# example's answer.
_END = " End with 'The answer is N.', where N is a number."
INSTRUCT_EXPERTS = {
    "math_solver": "You are the Math Solver. Solve the grade-school math word problem step by step, briefly." + _END,
    "math_analyst": "You are the Mathematical Analyst. List the quantities in the word problem and how they "
                    "combine, then compute the result, briefly." + _END,
    "programmer": "You are the Programming Expert. Write one Python expression that computes the answer to the "
                  "word problem, then state its value." + _END,
}
INSTRUCT_DECISION = ("You are the Final Decision agent. Read the word problem and three experts' answers, work out "
                     "which answer is right, and reply with only 'The answer is N.', where N is a number.")


@dataclass(frozen=True)
class SwarmPrompts:
    """The experts' system prompts (one per name of EXPERTS) and the decision agent's."""

    experts: dict[str, str]
    decision: str


INSTRUCT_NUMBER = SwarmPrompts(INSTRUCT_EXPERTS, INSTRUCT_DECISION)
# multiple choice (ARC): the same three roles, answering with a letter
_END_CHOICE = " End with 'The answer is X.', where X is the letter of one choice."
INSTRUCT_CHOICE = SwarmPrompts(
    {"math_solver": "You are the Step-by-step Solver. Reason about the question step by step, briefly." + _END_CHOICE,
     "math_analyst": "You are the Analyst. Weigh each choice against what the question asks, briefly." + _END_CHOICE,
     "programmer": "You are the Fact Expert. Recall the fact the question tests and pick the choice it supports, "
                   "briefly." + _END_CHOICE},
    "You are the Final Decision agent. Read the question and three experts' answers, work out which choice is "
    "right, and reply with only 'The answer is X.', where X is the letter of that choice.")


class SwarmState(TypedDict, total=False):
    question: str
    answers: Annotated[list[tuple[str, str]], operator.add]  # (expert, text), in the order they finished
    final: str


def build_swarm(model: AgentCacheChatModel, decision_model: AgentCacheChatModel | None = None,
                prompts: SwarmPrompts | None = None) -> Any:
    """The compiled graph; `decision_model` (e.g. with fewer tokens) defaults to `model`. The
    prompts default to the word-problem ones: instructions for a chat model, worked examples for
    a base model."""
    decide_with = decision_model or model
    if prompts is None:
        instruct = model.runtime.chat is not None  # the model has a chat format: it follows instructions
        prompts = INSTRUCT_NUMBER if instruct else SwarmPrompts(EXPERTS, DECISION_SYSTEM)
    experts, decision_system = prompts.experts, prompts.decision

    def expert(name: str):
        @agent_node(name)
        def node(state: dict[str, Any]) -> dict[str, Any]:
            reply = model.invoke([SystemMessage(experts[name]), HumanMessage(state["question"])])
            return {"answers": [(name, reply.content)]}
        return node

    @agent_node(DECISION)
    def decide(state: SwarmState) -> dict[str, Any]:
        by_expert = dict(state["answers"])
        messages = [SystemMessage(decision_system), HumanMessage(state["question"])]
        # A fixed order, whatever order the experts finished in: the same prompt for every run.
        messages += [AIMessage(by_expert[name], name=name) for name in EXPERTS if by_expert.get(name)]
        return {"final": decide_with.invoke(messages).content}

    def fan_out(state: SwarmState) -> list[Send]:
        return [Send(name, {"question": state["question"]}) for name in EXPERTS]

    graph = StateGraph(SwarmState)
    for name in EXPERTS:
        graph.add_node(name, expert(name))
        graph.add_edge(name, DECISION)
    graph.add_node(DECISION, decide)
    graph.add_conditional_edges(START, fan_out, list(EXPERTS))
    graph.add_edge(DECISION, END)
    return graph.compile()
