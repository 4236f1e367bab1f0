"""The checks against vLLM 0.32: its own scheduler from its wheel (`scheduler`, `spec_blocks`,
through `wheel`); a live vLLM served on this CPU (`live`: its venv and server) against
``backend=server`` (`caching`: cached tokens and hit rates) and the simulator (`latency`); its
n-gram drafter (`ngram`, run in vLLM's own environment)."""
