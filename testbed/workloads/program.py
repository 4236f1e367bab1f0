"""Building programs: DAGs of calls whose prompts splice literal spans and earlier outputs.

`ProgramBuilder` is what every generator writes with: ``call(segments, output_len, after=...)``
draws the call's predetermined output tokens, materialises its prompt (an `OutputRef` becomes the
referenced call's output) and records the segments so a generating engine can rebuild it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from testbed.errors import BadInput
from testbed.workloads.request import TOKEN_DTYPE, OutputRef, Request, Segment, materialize


class TokenSource:
    """Seeded uniform token ids in ``[0, vocab_size)`` (sharing comes from copied spans)."""

    def __init__(self, rng: np.random.Generator, vocab_size: int) -> None:
        if vocab_size < 1:
            raise BadInput(f"workload.vocab_size must be >= 1, got {vocab_size}")
        self.rng = rng
        self.vocab_size = vocab_size

    def __call__(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.vocab_size, size=n, dtype=TOKEN_DTYPE)

    def length(self, low: int, high: int) -> int:
        """A length drawn uniformly from ``[low, high]``."""
        return int(self.rng.integers(low, high + 1))


class ProgramBuilder:
    """Collects the calls of one program, in submission-compatible (topological) order."""

    def __init__(self, program: str, tokens: TokenSource) -> None:
        self.program = program
        self.tokens = tokens
        self.calls: list[Request] = []
        self._outputs: dict[str, np.ndarray] = {}
        self._waits_for: dict[str, set[str]] = {}  # call -> every call it transitively waits for

    def call(self, name: str, segments: Sequence[Segment], output_len: int,
             after: Sequence[str] = (), think_time_s: float = 0.0, priority: int = 0) -> Request:
        """Add a call ``{program}/{name}``; OutputRefs and ``after`` use full call ids."""
        call_id = f"{self.program}/{name}"
        waits_for = set(after).union(*(self._waits_for[a] for a in after))
        for seg in segments:
            if isinstance(seg, OutputRef) and seg.call not in waits_for:
                raise ValueError(f"{call_id}: references {seg.call} without waiting for it")
        segments = tuple(segments)
        output = self.tokens(output_len)
        req = Request(id=call_id, prompt=materialize(segments, self._outputs), output=output,
                      program=self.program, after=list(after), think_time_s=think_time_s,
                      priority=priority, segments=segments)
        self._outputs[call_id] = output
        self._waits_for[call_id] = waits_for
        self.calls.append(req)
        return req


def questions_on_prefixes(tokens: TokenSource, prefixes: Sequence[np.ndarray], rounds: int,
                          question_len: int, output_len: int, label: str) -> list[Request]:
    """``rounds`` rounds of one question per shared prefix, round-robin over the prefixes (as a
    server sees such groups interleaved): program ``{label}{i}/q{r}`` is one call ``answer``,
    prefix ``i`` then ``question_len`` fresh tokens, with ``output_len`` tokens out."""
    calls = []
    for q in range(rounds):
        for i, prefix in enumerate(prefixes):
            program = ProgramBuilder(f"{label}{i}/q{q}", tokens)
            calls.append(program.call("answer", [prefix, tokens(question_len)], output_len))
    return calls


def check_nonnegative(**sizes: int | float) -> None:
    """Raise BadInput naming the first ``workload.KEY`` that is negative."""
    for key, value in sizes.items():
        if value < 0:
            raise BadInput(f"workload.{key} must be >= 0, got {value}")


def check_range(low_key: str, low: int, high_key: str, high: int) -> None:
    check_nonnegative(**{low_key: low, high_key: high})
    if low > high:
        raise BadInput(f"workload.{low_key} ({low}) must be <= workload.{high_key} ({high})")
