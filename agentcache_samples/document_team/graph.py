"""The document team as a LangGraph graph: the reader reads the document and the question first;
the fact-checker and the critic then read both and the reader's notes, side by side; the writer
reads everything and answers.

The nodes are plain functions: each model call runs as the agent its graph node is named after.
Every agent's prompt starts with its own system prompt (PF) and then the same document (PH
`query`, about 3,000 tokens): the long shared context a prefix cache cannot share between agents,
and the one KVCMAS corrects instead of prefilling again.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph

from agentcache_langgraph import AgentCacheChatModel

__all__ = ["AGENTS", "INSTRUCT", "SYSTEM", "READER", "REVIEWERS", "WRITER", "DocumentState", "build_team"]

# Gemma 3 270M is a base model: each system prompt carries a short worked example in the
# transcript's own layout, so the model sees the form of an answer; every agent's example states
# the code, since a small model often repeats the latest note. An instruct model reads it as an
# instruction with an example.
_EXAMPLE = ("Staff directory\n\nLea Silva works in the Graz office on the first floor. The locker code of Lea "
            "Silva is 4417.\n\nQuestion: What is the locker code of Lea Silva?")
READER = "reader"
REVIEWERS = ("fact_checker", "critic")
WRITER = "writer"
AGENTS = (READER, *REVIEWERS, WRITER)
SYSTEM = {
    READER: "You are the Reader. You find the sentence of the document that answers the question and quote "
            f"the number in it.\n\n### user\n{_EXAMPLE}\n\n### reader\nThe locker code of Lea Silva is 4417.",
    "fact_checker": "You are the Fact-Checker. You check the reader's number against the document and state the "
                    f"number the document gives.\n\n### user\n{_EXAMPLE}\n\n### reader\nThe locker code of Lea "
                    "Silva is 4417.\n\n### fact_checker\nThe document says the locker code of Lea Silva is 4417.",
    "critic": "You are the Critic. You say whether the reader's answer is the one the document gives, briefly, "
              f"and restate it.\n\n### user\n{_EXAMPLE}\n\n### reader\nThe locker code of Lea Silva is 4417.\n\n"
              "### critic\nThe reader is right: the locker code of Lea Silva is 4417.",
    WRITER: "You are the Writer. You read the document, the question and your team's notes, and write the final "
            f"answer in one sentence.\n\n### user\n{_EXAMPLE}\n\n### reader\nThe locker code of Lea Silva is 4417."
            "\n\n### fact_checker\nThe document says the locker code of Lea Silva is 4417.\n\n### critic\nThe "
            "reader is right: the locker code of Lea Silva is 4417.\n\n### writer\nThe locker code of Lea Silva is "
            "4417.",
}


# An instruct model (a ChatML one, such as Qwen2.5) is told what to do instead: it would copy an
# example's code.
INSTRUCT = {
    READER: "You are the Reader. Answer the question from the document in one short sentence that states the number.",
    "fact_checker": "You are the Fact-Checker. Check the reader's answer against the document and state the number "
                    "the document gives, in one sentence.",
    "critic": "You are the Critic. Say briefly whether the reader's answer is the one the document gives, and restate "
              "the right number.",
    WRITER: "You are the Writer. From the document, the question and your team's notes, write the final answer in "
            "one sentence that states the number.",
}


class DocumentState(TypedDict, total=False):
    document: str  # the document and the question, one shared message
    notes: Annotated[list[tuple[str, str]], operator.add]  # (agent, text), in the order they finished
    answer: str


def build_team(model: AgentCacheChatModel, writer_model: AgentCacheChatModel | None = None) -> Any:
    """The compiled graph; `writer_model` (e.g. with fewer tokens) defaults to `model`. A model with
    a chat format (it follows instructions) gets the instructions, a base model the worked examples."""
    system = INSTRUCT if model.runtime.chat is not None else SYSTEM

    def read(state: DocumentState) -> dict[str, Any]:
        reply = model.invoke([SystemMessage(system[READER]), HumanMessage(state["document"])])
        return {"notes": [(READER, reply.content)]}

    def review(name: str):
        def node(state: DocumentState) -> dict[str, Any]:
            reader = dict(state["notes"])[READER]
            reply = model.invoke([SystemMessage(system[name]), HumanMessage(state["document"]),
                                  AIMessage(reader, name=READER)])
            return {"notes": [(name, reply.content)]}
        return node

    def write(state: DocumentState) -> dict[str, Any]:
        notes = dict(state["notes"])
        messages = [SystemMessage(system[WRITER]), HumanMessage(state["document"])]
        # a fixed order, whichever reviewer finished first: the same prompt for every run
        messages += [AIMessage(notes[name], name=name) for name in (READER, *REVIEWERS)]
        return {"answer": (writer_model or model).invoke(messages).content}

    graph = StateGraph(DocumentState)
    graph.add_node(READER, read)
    for name in REVIEWERS:
        graph.add_node(name, review(name))
        graph.add_edge(READER, name)
        graph.add_edge(name, WRITER)
    graph.add_node(WRITER, write)
    graph.add_edge(START, READER)
    graph.add_edge(WRITER, END)
    return graph.compile()
