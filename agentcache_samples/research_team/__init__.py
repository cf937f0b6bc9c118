"""Research team (LangGraph, tools): a searcher calls a directory lookup tool whose long result
(a staff directory of about 1,300 tokens) an analyst, a checker and a writer then read in turn.
`python -m agentcache_samples.research_team` runs a batch of questions under KVCMAS and NonShared and reports
tool calls, their validity, accuracy, and the TTFT of the agents after the tool result."""
