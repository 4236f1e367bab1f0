"""``backend=server``: the testbed's workloads driven against a live OpenAI-compatible server (the
testbed's own, vLLM, SGLang) by an asyncio client, recorded as the other backends record."""
