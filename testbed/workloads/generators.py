"""Synthetic workload generators. Deterministic: the same seed gives the same token ids.

Token ids are drawn uniformly from ``[0, vocab_size)``: sharing in these workloads is by
construction (copied spans), not by chance collisions, which are negligible at 32k+ vocabularies.
"""

from __future__ import annotations

import numpy as np

from testbed.workloads.request import TOKEN_DTYPE, Request


def shared_prefix(num_groups: int = 64, prompts_per_group: int = 16, system_prompt_len: int = 2048,
                  question_len: int = 128, output_len: int = 256, vocab_size: int = 32000,
                  seed: int = 0) -> list[Request]:
    """SGLang's generated-shared-prefix benchmark: ``num_groups`` system prompts, each followed by
    ``prompts_per_group`` distinct questions. Requests arrive at t=0, grouped by question index
    across groups (so consecutive requests never share a system prompt, the hard case for LRU)."""
    for name, value in [("num_groups", num_groups), ("prompts_per_group", prompts_per_group),
                        ("system_prompt_len", system_prompt_len), ("question_len", question_len),
                        ("output_len", output_len)]:
        if value < 0:
            raise ValueError(f"workload.{name} must be >= 0, got {value}")
    if vocab_size < 1:
        raise ValueError(f"workload.vocab_size must be >= 1, got {vocab_size}")
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, vocab_size, size=n, dtype=TOKEN_DTYPE)

    systems = [tokens(system_prompt_len) for _ in range(num_groups)]
    requests = []
    for q in range(prompts_per_group):
        for g in range(num_groups):
            prompt = np.concatenate([systems[g], tokens(question_len)])
            requests.append(Request(id=f"g{g}-q{q}", prompt=prompt, output=tokens(output_len),
                                    program=f"g{g}"))
    return requests
