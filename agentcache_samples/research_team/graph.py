"""The research team as a LangGraph graph over one message list:

    searcher (calls lookup_directory) -> tools -> analyst -> checker -> writer

The searcher's model is bound to the tool with `tool_choice="lookup_directory"`: its first
answer is a call, written under the model's tool-call grammar. `ToolNode` runs the tool; its
`ToolMessage` (the directory) joins the shared messages, where every later agent reads it: PH
`tool:lookup_directory`, the long shared context KVCMAS corrects instead of prefilling again.
Each reader answers after the others: the analyst reads the result first (it is new to the
session, so it prefills it under any strategy), the checker and the writer after it.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, TypedDict

from langchain_core.messages import AnyMessage, SystemMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from pydantic import BaseModel, Field

from agentcache.runtime import Runtime
from agentcache_langgraph import AgentCacheChatModel

__all__ = ["AGENTS", "READERS", "SEARCHER", "SYSTEM", "ResearchState", "build_team"]

SEARCHER = "searcher"
READERS = ("analyst", "checker", "writer")
AGENTS = (SEARCHER, *READERS)
SYSTEM = {
    SEARCHER: "You are the searcher. Call the lookup_directory tool to find the person asked about.",
    "analyst": "You are the analyst. Read the directory and give the locker code asked for.",
    "checker": "You are the checker. Check the directory again and state the correct locker code.",
    "writer": "You are the writer. Give the final answer: the locker code, as a number.",
}


class LookupArgs(BaseModel):
    person: str = Field(description="the person's full name", max_length=64)


class ResearchState(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]


def build_team(runtime: Runtime, directory: Callable[[str], str], *, call_tokens: int = 48,
               answer_tokens: int = 16) -> Any:
    """The compiled graph on `runtime`; `directory(person)` is what the lookup tool returns."""

    @tool(args_schema=LookupArgs)
    def lookup_directory(person: str) -> str:
        """Fetch the staff directory page that lists a person: office, team and locker code."""
        return directory(person)

    def model(agent: str, tokens: int) -> AgentCacheChatModel:
        return AgentCacheChatModel(runtime=runtime, agent=agent, max_tokens=tokens)

    caller = model(SEARCHER, call_tokens).bind_tools([lookup_directory], tool_choice="lookup_directory")

    def call(state: ResearchState) -> dict[str, Any]:
        return {"messages": [caller.invoke([SystemMessage(SYSTEM[SEARCHER]), *state["messages"]])]}

    def answer(agent: str, chat: AgentCacheChatModel):
        def node(state: ResearchState) -> dict[str, Any]:
            return {"messages": [chat.invoke([SystemMessage(SYSTEM[agent]), *state["messages"]])]}
        return node

    graph = StateGraph(ResearchState)
    graph.add_node("search", call)
    graph.add_node("tools", ToolNode([lookup_directory]))
    previous = "tools"
    for reader in READERS:
        graph.add_node(reader, answer(reader, model(reader, answer_tokens)))
        graph.add_edge(previous, reader)
        previous = reader
    graph.add_edge(START, "search")
    graph.add_edge("search", "tools")
    graph.add_edge(previous, END)
    return graph.compile()
