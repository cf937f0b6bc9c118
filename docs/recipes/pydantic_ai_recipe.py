"""Pydantic AI against `agentcache serve` (tested in tests/test_serve_recipes.py).

Settings for a server that is not OpenAI: an `OpenAIProvider` with `base_url` and any `api_key`
(the server checks keys only with --api-keys), and `OpenAIChatModel` (Chat Completions, which the
server speaks). The agent is named by its instructions' fingerprint (the first system message;
a retry's added system message keeps the name) unless the client names it: one header in the
model settings does it.
"""

import os

from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

provider = OpenAIProvider(base_url=os.environ.get("AGENTCACHE_URL", "http://127.0.0.1:8000/v1"),
                          api_key=os.environ.get("AGENTCACHE_KEY", "unused"))
model = OpenAIChatModel(os.environ.get("AGENTCACHE_MODEL", "qwen2.5-coder-0.5b"), provider=provider)
planner = Agent(model, instructions="You plan trips day by day.",
                model_settings={"max_tokens": 96,
                                "extra_headers": {"X-Agentcache-Agent": "planner"}})  # optional: the agent's name
print(planner.run_sync("Three days in Lisbon, in May.").output)
