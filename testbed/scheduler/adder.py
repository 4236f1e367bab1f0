"""`PrefillAdder`: the token budgets of one prefill batch, as SGLang 0.4.10's ``PrefillAdder``
(``managers/schedule_policy.py``).

All budgets are in tokens:

- ``rem_total``: KV the cache could hand out now (`PrefixCache.available_size`: free plus
  evictable) minus reservations: ``min(max_new - generated, clip) × new_token_ratio`` for every
  request in the running batch (SGLang's ``__init__``), and each admitted request's extend plus
  ``min(max_new, clip)`` (``_update_prefill_budget``);
- ``cur_rem``: the same KV minus the admitted extends only;
- ``rem_input``: ``max_prefill_tokens`` minus the admitted extends;
- ``rem_chunk``: ``chunked_prefill_size`` minus the admitted extends (None: chunking off).

Extends count in whole pages (``ceil_paged_tokens``). `budget_state` says whether admission may
go on after a request was added.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable

from testbed.cache.base import PrefixCache
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

    @classmethod
    def for_step(cls, cache: PrefixCache, running: Iterable[Req], new_token_ratio: float,
                 clip: int, max_prefill_tokens: int, chunked_prefill_size: int | None,
                 page_size: int) -> "PrefillAdder":
        reserved = sum(min(r.max_new_tokens - len(r.output), clip) * new_token_ratio
                       for r in running)
        return cls(cache, page_size, max_prefill_tokens, chunked_prefill_size, reserved)

    @property
    def rem_total(self) -> float:
        return self.cache.available_size - self.rem_total_offset

    @property
    def cur_rem(self) -> float:
        return self.cache.available_size - self.cur_rem_offset

    def ceil_paged(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def take(self, extend: int, reserve: int) -> None:
        """Count an admitted extend (and the output it reserves) against the budgets."""
        extend = self.ceil_paged(extend)
        self.rem_total_offset += extend + reserve
        self.cur_rem_offset += extend
        self.rem_input -= extend
        if self.rem_chunk is not None:
            self.rem_chunk -= extend

    def budget_state(self) -> AddResult:
        if self.rem_total <= 0 or self.cur_rem <= 0:
            return AddResult.NO_TOKEN
        if self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0):
            return AddResult.OTHER
        return AddResult.CONTINUE
