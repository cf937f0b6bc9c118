"""Sample multi-agent apps on agentcache: run them from the repository root with `python -m samples.<name>`."""
