"""Decode and speculative steps: the running batch's next token each (SGLang's
``update_running_batch``), or its drafts to verify.

`DecodeSteps` is the room of `Scheduler` (`testbed.scheduler.scheduler`) that forms a decode step:
the running batch drops its finished requests, and under overlap those whose in-flight token is
their last (0.5.23); the step's KV is made room for, or requests are retracted
(`testbed.scheduler.retraction`), or the step waits for results in flight that free KV; then
every running request gets one slot, or with ``speculative`` its last token and drafts
(`testbed.scheduler.spec_steps` drafts them and applies a verification).

`_decode_batch`'s loop over the running batch runs once per decoded token: it stays inline, its
calls counted by tests/test_loop_speed_guard.py, and forms a plain step as columns
(`DecodeBatch`), not an entry object a request.
"""

from __future__ import annotations

import numpy as np

from testbed.scheduler.batch import Batch, BatchEntry, DecodeBatch


class DecodeSteps:
    def _decode_batch(self) -> Batch | None:
        """SGLang's ``update_running_batch``: filter out the finished, retract if the step does
        not fit, then one token each."""
        initial = len(self.running)
        self._filter_finished()
        finishing = self._finishing_in_flight()
        if finishing:  # their last token is in flight: no step more for them
            self.running = [r for r in self.running if id(r) not in finishing]
        if not self.running:
            self.batch_is_full = False
            return None
        drafts, early = None, 0
        if self.spec is not None:  # the drafts' room, if it can be had; else none this step
            drafts = dict(zip(map(id, self.running), self.spec.drafts(self.running)))
            early = self._evict_for(self.spec.cost(self.running, list(drafts.values())))
            if self.cache.available_size < self.spec.cost(self.running, list(drafts.values())):
                drafts = {key: (d[:0], None) for key, (d, _) in drafts.items()}
        need = self._decode_cost(self.running)
        if drafts is not None:
            need = self.spec.cost(self.running, [drafts[id(r)] for r in self.running])
        early += self._evict_for(need)  # check_decode_mem
        if self.cache.available_size < need and (finishing or self._donors_in_flight()):
            # their results free KV (a last token; the donors a prefill in flight reads, locked
            # until it is applied): decode the rest next step
            self.batch_is_full = False
            return None
        if self.cache.available_size < need:
            self._retract()
            if self.cache.available_size < need and self.loads.loading:
                # one request is always kept, and a lower-tier load-back in flight holds the KV
                # it needs (the fuzzer, seed 7007 #1379): the copy's end unlocks that KV, so
                # the kept requests decode once it is done
                self.batch_is_full = False
                return None
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay,
                                       self.min_new_token_ratio)
        if len(self.running) < initial:
            self.batch_is_full = False
        if drafts is not None:
            return self._verify_batch([drafts[id(r)] for r in self.running], early)
        running = self.running
        leases = [req.lease for req in running]
        evicted = self.cache.extend_each(leases, 1)
        if early or any(evicted):
            for req, ev, ev_early in zip(running, evicted,
                                         self._attribute(early, [1] * len(running))):
                req.evicted_tokens += ev + ev_early
        contexts = []
        append = contexts.append
        for req in running:  # once per running request per step: its slot taken
            computed = req.computed
            append(computed)
            req.computed = computed + 1
        # (a copy of the running list: the scheduler grows and cuts it in place)
        return DecodeBatch(running[:], contexts, [req.preemptions for req in running],
                           [lease.buffer for lease in leases])

    def _verify_batch(self, drafts: list[tuple[np.ndarray, tuple[int, ...] | None]],
                      early: int) -> Batch:
        """A speculative decode step: each running request's last token and its drafts (a
        chain, or a token tree's branches one after another), their KV slots taken now
        (`testbed.scheduler.spec_steps`)."""
        early_each = self._attribute(early, [1 + len(d) for d, _ in drafts])
        entries = []
        for req, (draft, branches), evicted_early in zip(self.running, drafts, early_each):
            evicted = self.cache.extend(req.lease, 1 + len(draft))
            if evicted is None:
                raise RuntimeError("a verification step's room vanished after it was checked")
            req.evicted_tokens += evicted + evicted_early
            entries.append(BatchEntry(req, req.computed, 1 + len(draft), produces_token=True,
                                      draft=draft, branches=branches).bind())
            req.computed += 1 + len(draft)
        return Batch("decode", entries)

    def _finishing_in_flight(self) -> set[int]:
        """Under overlap, 0.5.23's ``event_loop_overlap`` (``enable_skip_finishing_decode``;
        ``update_running_batch`` -> ``_reqs_finishing_inflight``): the running requests whose
        token still in flight is their last by length (``next_output_finishes_by_length``).
        0.4.10 decodes them one step more and drops that token."""
        if not (self.rules.skip_finishing_decode and self._unapplied):
            return set()
        batch = self._unapplied[-1]
        if isinstance(batch, DecodeBatch):  # (its columns: every entry produces a token)
            return {id(req) for req, gen in zip(batch.reqs, batch.gens)
                    if gen == req.preemptions and req.finish_s is None
                    and len(req.output) + 1 >= req.max_new_tokens}
        return {id(e.req) for e in batch.entries
                if e.produces_token and e.gen == e.req.preemptions and not e.req.finished
                and len(e.req.output) + 1 >= e.req.max_new_tokens}

    def _donors_in_flight(self) -> bool:
        """Under overlap, whether a batch in flight holds a prefill whose reuse donors stay
        locked until its results are applied (approximate reuse only)."""
        return self.reuse is not None and any(
            e.req.reuse_plan is not None and e.req.reuse_plan.donors
            for batch in self._unapplied for e in batch.entries)

    def _filter_finished(self) -> None:
        """ScheduleBatch.filter_batch: the running batch drops its finished requests; a smaller
        batch is not full."""
        before = len(self.running)
        self.running = [r for r in self.running if r.finish_s is None]  # (not finished)
        if len(self.running) < before:
            self.batch_is_full = False
