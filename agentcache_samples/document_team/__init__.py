"""Document team (LangGraph): a reader, a fact-checker, a critic and a writer answer a question
about a long shared document (a staff directory of about 3,000 tokens). `python -m
agentcache_samples.document_team` runs a batch of documents under KVCMAS, NonShared and FullShared and
compares per-agent TTFT and accuracy."""
