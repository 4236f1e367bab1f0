"""`Batch`: one step of work the scheduler hands to an executor.

A prefill batch computes, for each entry, a run of ``new`` tokens of the request's fill (prompt,
plus tokens generated before a retraction) on top of ``context`` tokens of KV it already has (the
cached prefix, or earlier chunks). A decode batch computes one token per running request. Entries
that finish their fill produce the request's next token. Executors read token ids and KV slots
from here; nothing in a batch is decided by them.

Reuse beyond exact prefixes (`testbed.cache.reuse`): a prefill entry's ``reuse`` are the
`ReusedSpan`s inside its positions, whose KV the executor copies from donor slots, re-rotates and
partly recomputes (positions outside them are computed as usual); the batch's ``kv_copies`` are
`KVCopy`s (chunk stores) the executor runs after the step's forward pass, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from testbed.cache.reuse import KVCopy, ReusedSpan
from testbed.scheduler.request_state import Req


@dataclass
class BatchEntry:
    req: Req
    context: int  # tokens with KV before this step
    new: int  # tokens computed in this step
    produces_token: bool  # False for a chunk that does not reach the end of the fill
    gen: int = 0  # the request's retraction count when formed: a stale entry's token is dropped
    slots: np.ndarray | None = None  # KV slots when formed (the lease may end before it runs)
    reuse: tuple[ReusedSpan, ...] = ()  # spans inside [context, context+new): KV not computed

    @property
    def computed(self) -> int:
        """Tokens the step computes for this entry: ``new`` less the reused ones (a span's
        recomputed tokens are computed)."""
        return self.new - sum(s.reused for s in self.reuse)

    def bind(self) -> "BatchEntry":
        """Fix the entry to the request's state now, once its KV room is allocated."""
        self.gen = self.req.preemptions
        self.slots = self.req.lease.slots
        return self

    def input_ids(self) -> np.ndarray:
        """Token ids fed in this step (positions context .. context+new-1)."""
        if self.new == 1 and self.req.output and self.context == self.req.fill_len - 1:
            return np.asarray(self.req.output[-1:], dtype=np.int32)
        return self.req.fill()[self.context : self.context + self.new]

    def kv_slots(self) -> np.ndarray:
        """KV slots of positions 0 .. context+new-1: read for attention, the last ``new`` written."""
        slots = self.slots if self.slots is not None else self.req.lease.slots
        return slots[: self.context + self.new]


@dataclass
class Batch:
    kind: str  # "prefill" or "decode"
    entries: list[BatchEntry]
    kv_copies: list[KVCopy] = field(default_factory=list)  # run after the forward, in order
    # cascade decoding: ``(shared tokens, entry indices)`` of the requests that read a cached
    # prefix once (`testbed.scheduler.decode_groups`); None where the scheduler formed none
    decode_groups: list[tuple[int, list[int]]] | None = None

    @property
    def num_new_tokens(self) -> int:
        return sum(e.new for e in self.entries)

    def shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(new tokens, context) per entry: what a cost model needs."""
        return tuple(e.new for e in self.entries), tuple(e.context for e in self.entries)


@dataclass(frozen=True)
class StepOutcome:
    """What an executor (the simulator's or the engine's) returns for one `Batch`: how long the
    step took and the token each entry produced (None where an entry produces none). An entry
    whose request asks for ``top_logprobs`` (a beam search's, `testbed.scheduler.beam`) and ends
    its fill gets the most likely next tokens and their log-probs in ``logprobs`` (the engine's
    only; None elsewhere)."""

    duration_s: float
    tokens: list[int | None]
    logprobs: list[tuple[np.ndarray, np.ndarray] | None] | None = None
