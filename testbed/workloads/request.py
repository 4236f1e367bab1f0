"""The request record every backend consumes: token ids in, token ids out, when, and after what."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TOKEN_DTYPE = np.int32


@dataclass
class Request:
    """One LLM call.

    ``output`` holds the predetermined output tokens (what the replay and simulator backends emit);
    ``after`` lists ids of requests that must finish before this one is submitted.
    """

    id: str
    prompt: np.ndarray
    output: np.ndarray
    arrival_s: float = 0.0
    program: str | None = None
    after: list[str] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output)

    def sequence(self) -> np.ndarray:
        """Prompt followed by output: what a finished request leaves in the cache."""
        return np.concatenate([self.prompt, self.output])


def as_tokens(ids, where: str) -> np.ndarray:
    """Token ids as the project's dtype; ``where`` names the source in the error message."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{where}: token ids must be a flat list of integers")
    if arr.size == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{where}: token ids must be integers, got {arr.dtype}")
    if arr.min() < 0 or arr.max() > np.iinfo(TOKEN_DTYPE).max:
        raise ValueError(f"{where}: token ids must lie in [0, 2^31)")
    return arr.astype(TOKEN_DTYPE, copy=False)


def arrival_order(requests: list[Request]) -> list[Request]:
    """Requests by arrival time, ties in their given order (sorted() is stable)."""
    return sorted(requests, key=lambda r: r.arrival_s)
