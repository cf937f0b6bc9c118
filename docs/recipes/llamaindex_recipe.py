"""LlamaIndex against `agentcache serve` (tests/test_serve_recipes.py runs it where LlamaIndex is
installed: its dependencies are not in agentcache's pinned set, see the test).

Settings for a server that is not OpenAI: `OpenAILike` with `api_base`, any `api_key`,
`is_chat_model=True` (the server speaks Chat Completions), `is_function_calling_model=True` (it
takes `tools`) and the model's `context_window`. A `FunctionAgent` with a `system_prompt` is
named by that prompt's fingerprint; without one, by the tools it offers; `default_headers` names it.
"""

import asyncio
import os

from llama_index.core.agent.workflow import FunctionAgent
from llama_index.llms.openai_like import OpenAILike

llm = OpenAILike(model=os.environ.get("AGENTCACHE_MODEL", "qwen2.5-coder-0.5b"),
                 api_base=os.environ.get("AGENTCACHE_URL", "http://127.0.0.1:8000/v1"),
                 api_key=os.environ.get("AGENTCACHE_KEY", "unused"), is_chat_model=True,
                 is_function_calling_model=True, context_window=4096, max_tokens=96,
                 default_headers={"X-Agentcache-Agent": "calculator"})  # optional: the agent's name


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def main() -> None:
    agent = FunctionAgent(tools=[add], llm=llm, system_prompt="You add numbers with the add tool.")
    print(await agent.run("What is 2 + 3?", max_iterations=3))


asyncio.run(main())
