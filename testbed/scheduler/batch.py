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

A plain decode step (one token for each running request, no drafts) is a `DecodeBatch`: the same
`Batch`, formed as columns (its requests, contexts, retraction counts and slot buffers), whose
`BatchEntry`s are made only when something reads ``entries``. The simulator reads the columns
and never makes them: most of a simulation's steps are decode steps, one entry a running request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from itertools import repeat
from operator import is_not

import numpy as np

from testbed.cache.reuse import KVCopy, ReusedSpan
from testbed.scheduler.request_state import Req


@dataclass(slots=True)  # one per request per step: slots make it cheaper to make and read
class BatchEntry:
    req: Req
    context: int  # tokens with KV before this step
    new: int  # tokens computed in this step
    produces_token: bool  # False for a chunk that does not reach the end of the fill
    gen: int = 0  # the request's retraction count when formed: a stale entry's token is dropped
    # KV slots when formed (the lease may end before it runs): positions 0 .. context+new-1
    # are `kv_slots`; a decode entry holds the lease's whole buffer (`Lease.buffer`), whose
    # first slots never change, rather than a view cut per step
    slots: np.ndarray | None = None
    reuse: tuple[ReusedSpan, ...] = ()  # spans inside [context, context+new): KV not computed
    # a decode: its input is the token its request's last step produced (on the engine's
    # device, where that step left it; its results may not be applied yet under overlap)
    decode: bool = False
    # speculative decoding: the drafted tokens this step verifies (``new`` = 1 + len(draft):
    # the request's last token, then the drafts); None for every other entry. Its token in a
    # `StepOutcome` is the tuple of tokens the step verified (accepted drafts, then the bonus)
    draft: np.ndarray | None = None
    # a token tree (``speculative.tree_width`` > 1): the lengths of its branches, which ``draft``
    # holds one after another, each hanging from the last token (None: ``draft`` is one chain)
    branches: tuple[int, ...] | None = None

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

    @property
    def output_index(self) -> int:
        """Which output token of its request this entry produces (if it produces one): the one
        at fill position ``context + new``. Read from the entry alone, so it holds whether or
        not the results of the step before have been applied yet (overlap). A verification's:
        the first token it produces."""
        return self.context + (1 if self.draft is not None else self.new) - len(self.req.prompt)

    @property
    def makes_output(self) -> bool:
        """Whether the token this entry produces is one its request can take: it ends the fill
        and the request's output is not full by then (a request decoded once more under
        overlap after its last token is in flight makes none)."""
        return self.output_made is not None

    @property
    def output_made(self) -> int | None:
        """`output_index` where the entry `makes_output`, else None (one read of both)."""
        if not self.produces_token:
            return None
        req = self.req  # (`output_index`, inline: read for every entry of every step)
        at = self.context + (1 if self.draft is not None else self.new) - len(req.prompt)
        return at if 0 <= at < req.max_new_tokens else None

    def input_ids(self) -> np.ndarray:
        """Token ids fed in this step (positions context .. context+new-1), from the host: a
        prefill's. A decode step's input is the token its request's last step produced, which
        the engine reads on the device (`testbed.engine.slot_table`); here it is the
        request's last output, so only once that step's results are applied."""
        if self.draft is not None:  # the last token (its KV written now), then the drafts
            last = self.req.fill()[self.context : self.context + 1]
            return np.concatenate([last, self.draft]).astype(last.dtype)
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
    _shape: tuple[tuple[int, ...], tuple[int, ...]] | None = field(default=None, repr=False,
                                                                  compare=False)
    _verifies: bool | None = field(default=None, repr=False, compare=False)

    @property
    def verifies(self) -> bool:
        """A speculative decode step: its entries carry drafts (possibly none) to verify.
        (Read once, as `shape`: a step's entries keep their drafts.)"""
        if self._verifies is None:
            self._verifies = any(map(is_not, [e.draft for e in self.entries], repeat(None)))
        return self._verifies

    @property
    def size(self) -> int:
        """Requests in the step (one entry each)."""
        return len(self.entries)

    def columns(self) -> tuple[list[Req], list[int]]:
        """Each entry's request and its retraction count when formed (``gen``), in order."""
        return [e.req for e in self.entries], [e.gen for e in self.entries]

    @property
    def num_new_tokens(self) -> int:
        return sum(self.shape()[0])

    def shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(new tokens, context) per entry: what a cost model needs. Read once: the executor,
        the step record and the totals all ask, and a batch's entries do not change."""
        if self._shape is None:
            entries = self.entries
            self._shape = (tuple([e.new for e in entries]),
                           tuple([e.context for e in entries]))
        return self._shape


class DecodeBatch(Batch):
    """A plain decode step as columns: request ``reqs[i]`` computes one token on top of
    ``contexts[i]`` tokens of KV, formed at its retraction count ``gens[i]``, its slots the
    lease's buffer ``buffers[i]`` then (`BatchEntry`'s ``gen`` and ``slots``): the step of the
    `Batch` of those entries, whose `entries` it makes on first read and keeps."""

    def __init__(self, reqs: list[Req], contexts: list[int], gens: list[int],
                 buffers: list[np.ndarray]) -> None:
        self.kind = "decode"
        self.kv_copies = []
        self.decode_groups = None
        self.reqs, self.contexts, self.gens, self.buffers = reqs, contexts, gens, buffers
        self._shape = ((1,) * len(reqs), tuple(contexts))
        self._verifies = False

    @cached_property
    def entries(self) -> list[BatchEntry]:  # type: ignore[override]
        return [BatchEntry(req, context, 1, True, gen, buffer, (), True)
                for req, context, gen, buffer in zip(self.reqs, self.contexts, self.gens,
                                                     self.buffers)]

    @property
    def size(self) -> int:
        return len(self.reqs)

    def columns(self) -> tuple[list[Req], list[int]]:
        return self.reqs, self.gens

    @property
    def num_new_tokens(self) -> int:
        return len(self.reqs)


@dataclass(frozen=True)
class StepOutcome:
    """What an executor (the simulator's or the engine's) returns for one `Batch`: how long the
    step took and the token each entry produced (None where an entry produces none). An entry
    whose request asks for ``top_logprobs`` (a beam search's, `testbed.scheduler.beam`) and ends
    its fill gets the most likely next tokens and their log-probs in ``logprobs`` (the engine's
    only; None elsewhere).

    The step's time, split (docs/design.md §4, "Launch and result"): ``gpu_s``, what it cost the
    device (CUDA events on a GPU; on a synchronous device, the CPU, the launch's whole work; the
    cost model's price in the simulator; None: ``duration_s``); ``host_s``, the host work the
    executor added around it (launching; the simulator's priced host time); ``wait_s``, how
    long reading the result back waited for the device. ``duration_s`` is the step as the
    executor alone timed it, launch to result (what `testbed.calibrate` measured before)."""

    duration_s: float
    tokens: list[int | None]
    logprobs: list[tuple[np.ndarray, np.ndarray] | None] | None = None
    gpu_s: float | None = None
    host_s: float = 0.0
    wait_s: float = 0.0

    @property
    def device_s(self) -> float:
        """``gpu_s``, or ``duration_s`` where the executor did not split its time."""
        return self.duration_s if self.gpu_s is None else self.gpu_s
