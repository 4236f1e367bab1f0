"""The checks against vLLM 0.32: its own scheduler from its wheel (`scheduler`, `spec_blocks`,
through `wheel`), a live vLLM served on this CPU (`caching`, `latency`), its n-gram drafter
(`ngram`, run in vLLM's own environment)."""
