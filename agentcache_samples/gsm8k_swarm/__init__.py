"""GSM8K swarm (LangGraph): Math Solver, Mathematical Analyst and Programming Expert fan out on a
word problem, a final decision agent fans in. `python -m agentcache_samples.gsm8k_swarm` runs a batch of
generated problems under KVCMAS, NonShared and FullShared and compares them."""
