"""smolagents against `agentcache serve` (tested in tests/test_serve_recipes.py).

Settings for a server that is not OpenAI: `api_base` and any `api_key` (the server checks keys only
with --api-keys). The agent is named by its system prompt's fingerprint unless the client names it:
one header on the model's client (`client_kwargs`) does it.
"""

import os

from smolagents import OpenAIServerModel, ToolCallingAgent

model = OpenAIServerModel(
    model_id=os.environ.get("AGENTCACHE_MODEL", "qwen2.5-coder-0.5b"),
    api_base=os.environ.get("AGENTCACHE_URL", "http://127.0.0.1:8000/v1"),
    api_key=os.environ.get("AGENTCACHE_KEY", "unused"),
    client_kwargs={"default_headers": {"X-Agentcache-Agent": "researcher"}},  # optional: the agent's name
    max_tokens=96,
)
agent = ToolCallingAgent(tools=[], model=model, max_steps=2)
print(agent.run("Name three sights in Lisbon."))
