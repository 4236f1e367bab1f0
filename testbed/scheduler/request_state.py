"""`Req`: the scheduler's view of one request while it is served (SGLang's ``Req``).

It pairs the workload's `Request` with what serving adds: the cache lease, the tokens generated so
far, how much of the sequence has KV, and the times and counts that become its record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from testbed.cache.base import Lease
from testbed.cache.eviction import Requester
from testbed.cache.radix import TreeNode
from testbed.cache.reuse import ReusedSpan
from testbed.workloads.request import TOKEN_DTYPE, Request


@dataclass
class ReusePlan:
    """One admission's reuse: spans in fill positions (sorted, disjoint) and the locked donors."""

    spans: tuple[ReusedSpan, ...] = ()
    donors: list[TreeNode] = field(default_factory=list)

    @property
    def exact_until(self) -> int | None:
        """The first position whose KV is approximate (a span not wholly recomputed), or None."""
        return next((s.dst for s in self.spans if s.reused), None)


@dataclass(eq=False)
class Req:
    request: Request
    prompt: np.ndarray  # as submitted (rebuilt from actual outputs when the engine generates)
    submitted_s: float
    seq: int  # submission order: FCFS and tie breaks
    queued_s: float = 0.0  # when it last entered the waiting queue (priority scheduling's tie)
    queued_tokens: int = 0  # the scheduler's prefill tokens run by then (HRRN's arrival mark)
    matched: int = 0  # its cached prefix at its last look-up (SGLang's req.prefix_len)
    output: list[int] = field(default_factory=list)
    lease: Lease | None = None
    computed: int = 0  # tokens of prompt + output whose KV exists
    cached_tokens: int | None = None  # prompt tokens hit at first admission
    approx_hit_tokens: int = 0  # at first admission: prompt tokens reused inexactly, not recomputed
    recomputed_tokens: int = 0  # at first admission: tokens of reused spans that are recomputed
    reuse_plan: ReusePlan | None = None  # the current admission's reuse (beyond prefixes)
    evicted_tokens: int = 0  # evicted to make room for this request
    inserted: bool = False
    preemptions: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    aborted: bool = False
    max_new_tokens: int = -1  # set from the request: its output's length, or its max_new_tokens
    stop_token_ids: frozenset[int] = frozenset()  # a generated one of these ends it (EOS)
    #: speculative decoding: the drafts it accepted at each of its verification steps, in order
    #: (None: it never verified); requests.jsonl ``spec_accepted``
    spec_accepted: list[int] | None = None
    #: the workload's output tokens as an array of the token dtype, made at the first read
    #: (`testbed.sim.executor.predetermined_tokens`, which reads one per decode step)
    recorded_output: Sequence[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.max_new_tokens = self.request.output_limit
        r = self.request
        self.requester = Requester(r.id, r.priority, r.category)  # what eviction policies see

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_s is not None

    def use_stop_tokens(self, eos_token_ids: frozenset[int]) -> None:
        """A request the model generates stops at the model's EOS (unless ``ignore_eos``) and at
        its own ``stop_token_ids``."""
        eos = frozenset() if self.request.ignore_eos else eos_token_ids
        self.stop_token_ids = eos | frozenset(int(t) for t in self.request.stop_token_ids)

    def take_token(self, token: int | None, now: float) -> bool:
        """The token the step that completed its fill produced (a prefill-only call, with
        ``max_new_tokens`` 0, makes none): appended to its output, the first one's time noted.
        Returns whether the request is done: its output is as long as allowed, or the token is
        one of its stop tokens (EOS or its own, kept in the output) once ``min_tokens`` came
        before it (SGLang's ``check_finished``, vLLM's ``check_stop``)."""
        output = self.output  # (once per decoded token: no properties on this path)
        n = len(output)
        if n >= self.max_new_tokens:
            return n == self.max_new_tokens
        if token is None:
            raise ValueError(f"request {self.id}: the executor produced no token")
        token = int(token)
        output.append(token)
        n += 1
        if self.first_token_s is None:
            self.first_token_s = now
        if self.stop_token_ids and token in self.stop_token_ids and n > self.request.min_tokens:
            return True
        return n == self.max_new_tokens

    def fill(self) -> np.ndarray:
        """The tokens whose KV a prefill computes: prompt plus what was generated before a
        retraction (re-prefilled rather than lost)."""
        if not self.output:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.output, dtype=TOKEN_DTYPE)])

    def kv_tokens(self) -> np.ndarray:
        """The tokens that have KV now (``computed`` of them), for the cache."""
        return self.fill()[: self.computed]

    @property
    def fill_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def kv_needed(self) -> int:
        """KV slots the whole request occupies at its end: the last output token never gets KV."""
        return len(self.prompt) + max(self.max_new_tokens - 1, 0)
