"""CrewAI against `agentcache serve` (tests/test_serve_recipes.py runs it where CrewAI is installed:
its dependencies are not in agentcache's pinned set, see the test).

Settings for a server that is not OpenAI: `LLM(model="openai/<served model>", base_url=...,
api_key=...)`; the "openai/" prefix picks CrewAI's OpenAI-compatible client, which takes any model
name. Each CrewAI agent's system prompt holds its role, goal and backstory, so each agent is its own
agent on the server (`agent-<fingerprint>`) with no extra code; `default_headers` names it.
"""

import os

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")  # no calls home from a closed network
os.environ.setdefault("OTEL_SDK_DISABLED", "true")

from crewai import LLM, Agent, Crew, Task  # noqa: E402 - after the settings above

llm = LLM(model="openai/" + os.environ.get("AGENTCACHE_MODEL", "qwen2.5-coder-0.5b"),
          base_url=os.environ.get("AGENTCACHE_URL", "http://127.0.0.1:8000/v1"),
          api_key=os.environ.get("AGENTCACHE_KEY", "unused"), max_tokens=96,
          default_headers={"X-Agentcache-Agent": "guide"})  # optional: the agent's name
guide = Agent(role="Travel guide", goal="Suggest sights", backstory="You know Lisbon well.", llm=llm)
task = Task(description="Name three sights in Lisbon.", expected_output="Three sights, one per line.", agent=guide)
print(Crew(agents=[guide], tasks=[task]).kickoff())
