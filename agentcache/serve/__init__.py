"""`agentcache serve`: an OpenAI-compatible HTTP server over a Runtime, for clients in any process
or language (the openai SDK, LangChain's ChatOpenAI, AutoGen's OpenAIChatCompletionClient, the
OpenAI Agents SDK). Needs the `serve` extra (FastAPI, uvicorn, prometheus-client, openai)."""

from agentcache.serve.app import create_app
from agentcache.serve.config import ServeConfig
from agentcache.serve.identity import ApiKeys
from agentcache.serve.server import ServerThread, check_bind, serve

__all__ = ["create_app", "ServeConfig", "ApiKeys", "serve", "check_bind", "ServerThread"]
