"""Travel planner (AutoGen SelectorGroupChat): planner, local guide, language and summary agents.
`python -m agentcache_samples.travel_planner` runs it under KVCMAS and NonShared and compares the hops."""
