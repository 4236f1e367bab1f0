"""`PrefillAdder`: the token budgets of one prefill batch, and what one admission may take of
them, as SGLang's ``PrefillAdder`` (``managers/schedule_policy.py``; in 0.5.23 its KV budgets
are a ``PrefillBudget``, ``mem_cache/prefill_budget.py``).

All budgets are in tokens:

- ``rem_total``: KV the cache could hand out now (`PrefixCache.available_size`: free plus
  evictable) minus reservations: ``min(max_new - generated, clip) × new_token_ratio`` for every
  request in the running batch (SGLang's ``__init__``), and each admitted request's extend plus
  ``min(max_new, clip)`` (``_update_prefill_budget``);
- ``cur_rem``: the same KV minus the admitted extends only;
- ``rem_input``: ``max_prefill_tokens`` minus the admitted extends;
- ``rem_chunk``: ``chunked_prefill_size`` minus the admitted extends (None: chunking off).

Extends count in whole pages (``ceil_paged_tokens``). Where the releases differ (`ReleaseRules`)
the methods below follow the scheduler's: under 0.5.23 each admission also takes a page from both
KV budgets. `budget_state` says whether admission may go on after a request was added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable

from testbed.cache.base import PrefixCache
from testbed.scheduler.release_rules import ReleaseRules
from testbed.scheduler.request_state import Req


class AddResult(Enum):
    """SGLang's ``AddReqResult``: go on, stop for lack of KV (the batch is full), or stop for a
    step budget."""

    CONTINUE = "continue"
    NO_TOKEN = "no_token"
    OTHER = "other"


@dataclass
class PrefillAdder:
    cache: PrefixCache
    page_size: int
    rem_input: float
    rem_chunk: float | None
    rem_total_offset: float
    cur_rem_offset: float = 0.0
    rules: ReleaseRules = field(default_factory=lambda: ReleaseRules.of("0.5.23"))

    @classmethod
    def for_step(cls, cache: PrefixCache, running: Iterable[Req], new_token_ratio: float,
                 clip: int, max_prefill_tokens: int, chunked_prefill_size: int | None,
                 page_size: int, rules: ReleaseRules) -> "PrefillAdder":
        reserved = sum(min(r.max_new_tokens - len(r.output), clip) * new_token_ratio
                       for r in running)
        return cls(cache, page_size, max_prefill_tokens, chunked_prefill_size, reserved,
                   rules=rules)

    @property
    def rem_total(self) -> float:
        return self.cache.available_size - self.rem_total_offset

    @property
    def cur_rem(self) -> float:
        return self.cache.available_size - self.cur_rem_offset

    @property
    def per_request(self) -> int:
        """KV each admission takes beyond its extend: 0.5.23's ``PrefillBudget.reserve`` adds a
        page (``per_req_token_overhead``: the paged allocator may use one more per request)."""
        return self.page_size if self.rules.page_per_request else 0

    def ceil_paged(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def take(self, extend: int, reserve: int) -> None:
        """Count an admitted extend (and the output it reserves) against the budgets."""
        extend = self.ceil_paged(extend)
        self.rem_total_offset += extend + self.per_request + reserve
        self.cur_rem_offset += extend + self.per_request
        self.rem_input -= extend
        if self.rem_chunk is not None:
            self.rem_chunk -= extend

    def refusal(self, req: Req, extend: int, clip: int, locked: int,
                first: bool) -> AddResult | None:
        """``add_one_req``'s budget checks for a request whose prefix is locked (``locked``:
        what the lock took from ``available_size``): NO_TOKEN when its extend and reserved
        outputs do not fit the KV, OTHER when it would pass the input cap (``first``: no
        request admitted yet, which may), None when it may be admitted."""
        input_tokens = self.ceil_paged(extend)
        if self.rules.check_once_locked:
            # 0.5.23 _select_prefill_admission -> PrefillBudget.check_prefill, under _lock_node;
            # the outputs a retracted request has made are not reserved again (add_one_req).
            outputs = len(req.output) if self.rules.reserve_outputs_left else 0
            total = extend + min(max(req.max_new_tokens - outputs, 0), clip) + self.per_request
            if total >= self.rem_total:
                return AddResult.NO_TOKEN
            capped = self.rem_chunk is None or not self.rules.input_cap_unchunked_only
            if capped and not first and input_tokens >= self.rem_input:
                return AddResult.OTHER  # without chunking, the first may pass the input cap
            return None
        total = extend + min(req.max_new_tokens, clip)  # 0.4.10 add_one_req
        if total >= self.rem_total + locked:  # checked once before locking ...
            return AddResult.NO_TOKEN
        if input_tokens >= self.rem_input and not first:
            return AddResult.OTHER
        if total >= self.rem_total:  # ... and again after
            return AddResult.NO_TOKEN
        return None

    def first_chunk(self, prefix: int) -> int:
        """The tokens a request cut at the chunk budget computes now (<= 0: none; it waits).
        0.5.23's ``_select_prefill_admission`` ends the chunk on a page boundary of the whole
        fill (prefix and chunk); 0.4.10's ``add_one_req`` cuts ``rem_chunk - page_size + 1``."""
        if self.rules.chunk_on_page_boundary:
            limit = int(self.rem_chunk) // self.page_size * self.page_size
            return (prefix + limit) // self.page_size * self.page_size - prefix
        return int(self.rem_chunk) - self.page_size + 1

    def next_chunk(self, todo: int) -> int:
        """The tokens a continued chunked request computes now (``add_chunked_req``): the chunk
        budget, in 0.5.23 also at most the KV left (``PrefillBudget.available_chunk_tokens``)
        unless none is left, as the request must make progress to release its KV."""
        limit = self.rem_chunk
        if self.rules.chunk_within_kv:
            within = min(limit, int(self.rem_total))
            limit = within if within > 0 else limit
        return int(min(todo, limit))

    def budget_state(self) -> AddResult:
        if self.rem_total <= 0 or self.cur_rem <= 0:
            return AddResult.NO_TOKEN
        if self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0):
            return AddResult.OTHER
        return AddResult.CONTINUE
