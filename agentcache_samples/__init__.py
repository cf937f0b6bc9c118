"""Sample multi-agent apps on agentcache, installed beside it as a package of their own (they import
LangGraph or AutoGen, which core never does): `python -m agentcache_samples.<name>`."""
