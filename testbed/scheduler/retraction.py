"""Retraction and room: what the scheduler does when a step's KV does not fit (SGLang's
``retract_decode``, ``_evict_tree_cache_if_needed`` / ``evict_to_free_tokens``).

`Retraction` is the room of `Scheduler` (`testbed.scheduler.scheduler`) that gives KV back: a
decode step that does not fit retracts requests (the order ``scheduler.retract_order`` names)
until the rest have room, then re-estimates ``new_token_ratio``; a retracted or preempted request
frees its KV beyond the cached prefix and rejoins the queue. The eviction every step makes before
it allocates (`_evict_for`, with the split of what it evicted among the step's requests) is here
too, as the rule retraction stops by.
"""

from __future__ import annotations

from testbed.scheduler.request_state import Req


class Retraction:
    def _retract(self) -> None:
        """SGLang's ``retract_decode``: retract one request, then more until the rest have room
        (0.4.10: for ``retract_decode_steps`` tokens each; 0.5.23: for their next step,
        ``check_decode_mem``), evicting the tree for ``retract_decode_steps`` tokens each at once
        (``release_req``); one is always kept. Then ``new_token_ratio`` is re-estimated from the
        requests left (0.5.23's ``estimate_new_token_ratio_after_retract`` divides by the budget
        plus one)."""
        order = {
            "newest": lambda r: (len(r.output), -len(r.prompt)),
            "longest_prompt": lambda r: (-len(r.prompt), r.seq),
            "most_remaining": lambda r: (-r.remaining_new_tokens, r.seq),
        }[self.config.retract_order]
        candidates = sorted(self.running, key=order, reverse=True)
        steps = self.config.retract_decode_steps
        first = True
        while first or not self._retracted_enough(candidates, steps):
            if len(candidates) == 1:
                break
            first = False
            req = candidates.pop()
            self.running.remove(req)
            self._requeue(req)
            req.preemptions += 1
            self.preemptions += 1
            self._evict_for(steps * len(candidates))  # to use the freed room at once
        decoded = sum(len(r.output) for r in self.running)
        budget = sum(r.max_new_tokens for r in self.running)
        if self.rules.retract_until_step_fits:
            self.new_token_ratio = min(1.0, (decoded + steps * len(self.running)) / (budget + 1))
        elif budget:
            self.new_token_ratio = min(1.0, (decoded + steps * len(self.running)) / budget)

    def _retracted_enough(self, kept: list[Req], steps: int) -> bool:
        """Whether ``retract_decode`` may stop with ``kept`` running."""
        if self.rules.retract_until_step_fits:  # check_decode_mem: the next step fits
            need = self._decode_cost(kept)
            self._evict_for(need)
            return self.cache.available_size >= need
        return self.cache.available_size >= steps * len(kept)

    def _evict_for(self, num_tokens: int) -> int:
        """When fewer than ``num_tokens`` slots are free, evict: 0.4.10's
        ``_evict_tree_cache_if_needed`` asks the tree for all ``num_tokens``, 0.5.23's
        ``evict_to_free_tokens`` for the shortfall only. Slot-pool caches only; returns the
        tokens evicted."""
        pool = self.cache.pool
        if pool is not None and not pool.unbounded and pool.num_free < num_tokens:
            short = num_tokens - pool.num_free if self.rules.evict_shortfall else num_tokens
            return self.cache.evict(short)
        return 0

    @staticmethod
    def _attribute(evicted: int, needs: list[int]) -> list[int]:
        """Split tokens evicted for a whole step among its requests, in order, each up to its
        need; the rest (whole nodes overshoot) goes to the last."""
        out = []
        for need in needs:
            out.append(min(need, evicted))
            evicted -= out[-1]
        if out:
            out[-1] += evicted
        return out

    def _decode_cost(self, reqs: list[Req]) -> int:
        """KV capacity one more decode step of ``reqs`` takes."""
        return self.cache.step_cost([r.lease for r in reqs], 1)

    def _requeue(self, req: Req) -> None:
        """Free the request's KV beyond its cached prefix and append it to the queue (SGLang's
        ``_extend_requests_to_queue``); it will re-prefill prompt and outputs so far."""
        self._release_kv(req)
        self._enqueue(req)

    def _release_kv(self, req: Req) -> None:
        """A retracted or preempted request gives its KV beyond the cached prefix back."""
        self.cache.release(req.lease, req.fill(), insert=False)
        req.lease, req.computed = None, 0
        if self.reuse is not None:  # donors unlocked; readmission plans anew
            self.reuse.release(req)
            req.reuse_plan = None
        if self.chunked is req:
            self.chunked = None

    def _enqueue(self, req: Req) -> None:
        """_add_request_to_queue: it enters the queue anew (HRRN's and priority's marks)."""
        req.queued_s, req.queued_tokens = self._now, self.processed_tokens
        self.waiting.append(req)
