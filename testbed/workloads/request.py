"""The request record every backend consumes: token ids in, token ids out, when, and after what.

A request (one LLM call) belongs to a *program*, a DAG of calls: ``after`` names the calls that must
finish before it is submitted (plus ``think_time_s``). Its prompt may splice in earlier calls'
outputs (turn 2 of a chat contains turn 1's answer); ``segments`` records that structure — literal
token spans and `OutputRef`s — so that an engine generating real outputs can rebuild the prompt,
while ``prompt`` holds it materialised with the predetermined outputs the replay and simulator
backends use.

A call may also carry no output at all, only ``max_new_tokens``: then the model must generate it
(the engine backend; a token trace's ``"max_new_tokens"``), and only the engine can serve it; with
``beam_width`` too, by beam search (`testbed.scheduler.beam`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import numpy as np

from testbed.errors import WorkloadRefused

TOKEN_DTYPE = np.int32


@dataclass(frozen=True)
class OutputRef:
    """A prompt segment standing for the whole output of call ``call``."""

    call: str


Segment = Union[np.ndarray, OutputRef]


@dataclass
class Request:
    """One LLM call.

    ``output`` holds the predetermined output tokens (what the replay and simulator backends emit).
    ``max_new_tokens`` set means there are none: the engine generates up to that many (``output``
    is then empty), stopping early at the model's EOS.
    A call is submitted at ``arrival_s`` (its program's arrival, or a trace's own timestamp) or,
    if later, ``think_time_s`` after the last of its ``after`` dependencies finishes. Lower
    ``priority`` values are more urgent. ``answer``, set by tasks with a ground truth
    (`few_shot_text`, `rag_text`, `paraphrase_text`), is the expected answer text; it goes to
    requests.jsonl.
    """

    id: str
    prompt: np.ndarray
    output: np.ndarray
    arrival_s: float = 0.0
    program: str | None = None
    after: list[str] = field(default_factory=list)
    think_time_s: float = 0.0
    priority: int = 0
    segments: tuple[Segment, ...] | None = None
    category: str | None = None  # e.g. a trace's request type and turn (eviction policies)
    max_new_tokens: int | None = None  # generate mode (no predetermined output): the engine's
    answer: str | None = None  # the expected answer text, for tasks with ground truth (text.py)
    # generate mode only (the server's per-request sampling parameters, OpenAI/vLLM names):
    ignore_eos: bool = False  # the model's EOS does not end the call
    min_tokens: int = 0  # a stop token ends the call only after at least this many tokens
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the call (kept in the output)
    # beam search (testbed/scheduler/beam.py): a call with beam_width runs as rounds of requests
    # that each return the top_logprobs most likely next tokens with their log-probs
    beam_width: int | None = None
    top_logprobs: int = 0

    @property
    def program_id(self) -> str:
        """The program the call belongs to: its ``program``, or itself when it names none."""
        return self.program if self.program is not None else self.id

    @property
    def generates(self) -> bool:
        """The model must generate this call's output (it has no predetermined one)."""
        return self.max_new_tokens is not None

    @property
    def output_limit(self) -> int:
        """The most output tokens the call can produce: its output's length, or max_new_tokens."""
        return self.max_new_tokens if self.max_new_tokens is not None else len(self.output)

    @property
    def most_kv_tokens(self) -> int:
        """The most tokens of KV the call can ever hold: prompt and output, and for a beam call
        each of its beams' tokens."""
        return len(self.prompt) + self.output_limit * (self.beam_width or 1)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output)

    def sequence(self) -> np.ndarray:
        """Prompt followed by output: what a finished request leaves in the cache."""
        return np.concatenate([self.prompt, self.output])


def refuse_generating(requests: list[Request], backend: str) -> None:
    """Only the engine generates: one line naming the first call that has no output."""
    call = next((r for r in requests if r.generates), None)
    if call is not None:
        raise WorkloadRefused(f"request {call.id} has 'max_new_tokens' and no 'output': only "
                       f"backend=engine generates outputs; backend={backend} needs concrete "
                       "output ids")


def refuse_beams(requests: list[Request], backend: str) -> None:
    """Only the engine runs beam search: one line naming the first beam call."""
    call = next((r for r in requests if r.beam_width is not None), None)
    if call is not None:
        raise WorkloadRefused(f"request {call.id} has 'beam_width': only backend=engine runs beam "
                              f"search (backend={backend})")


def materialize(segments: tuple[Segment, ...], outputs: dict[str, np.ndarray]) -> np.ndarray:
    """The prompt spelled by ``segments``, with each `OutputRef` replaced by ``outputs[call]``."""
    parts = [outputs[s.call] if isinstance(s, OutputRef) else s for s in segments]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=TOKEN_DTYPE)


def arrival_order(requests: list[Request]) -> list[Request]:
    """Requests by arrival time, ties in their given order (sorted() is stable)."""
    return sorted(requests, key=lambda r: r.arrival_s)


def fresh_token_ids(start: int, n: int) -> np.ndarray:
    """``n`` consecutive ids from ``start``: tokens no other request shares (trace loaders)."""
    if start + n > np.iinfo(TOKEN_DTYPE).max:
        raise ValueError("too many tokens to give unique 32-bit ids")
    return np.arange(start, start + n, dtype=TOKEN_DTYPE)
