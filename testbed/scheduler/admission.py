"""Admission: forming a prefill batch (SGLang's ``get_new_batch_prefill``).

`Admission` is the room of `Scheduler` (`testbed.scheduler.scheduler`) that admits requests: a
chunked request continues first (``add_chunked_req``), then the waiting queue in the policy's
order, each request's prefix locked and its extend checked against the step's budgets
(`PrefillAdder`, ``add_one_req``) until one does not fit; a request past the chunk budget is cut
there and becomes the chunked one; with priority preemption a full batch may make room by
preempting (`testbed.scheduler.preemption`); a request whose match continues below the GPU may
leave the queue to be loaded back (`testbed.scheduler.loadback`). The admitted then take their
slots (``prepare_for_extend``) and, with approximate reuse, their planned spans.
"""

from __future__ import annotations

from testbed.errors import BadInput
from testbed.scheduler.adder import AddResult, PrefillAdder
from testbed.scheduler.batch import Batch, BatchEntry
from testbed.scheduler.policy import Ordering
from testbed.scheduler.preemption import reservation, to_preempt
from testbed.scheduler.request_state import Req, ReusePlan

_LOADING = "loading"  # `_add_one`: the request left the queue to have its prefix loaded back


class Admission:
    def _prefill_batch(self, now: float) -> Batch | None:
        c = self.config
        preempt = c.enable_priority_scheduling and not c.disable_priority_preemption
        if preempt:  # a full batch may still make room by preempting (testbed.scheduler.preemption)
            self.batch_is_full = False
        if self.rules.full_needs_work and not self.running:
            self.batch_is_full = False  # an empty running batch is never full
        if (self.batch_is_full or not self.waiting) and self.chunked is None:
            return None
        running_bs = len(self.running)
        if self.max_running - running_bs <= 0 and self.chunked is None and not preempt:
            self.batch_is_full = True
            return None
        held: set[int] = set()
        if self.waiting:
            self.policy.processed_tokens = self.processed_tokens
            ordering = self.policy.order(self.waiting, now)
            if c.target is not None:  # a user's policy: check what the built-ins guarantee
                ordering = self._checked(ordering)
            if ordering.queue is not self.waiting:
                self.waiting[:] = ordering.queue
            held = ordering.deferred if ordering.held else set()
        adder = PrefillAdder.for_step(self.cache, self.running, self.new_token_ratio,
                                      c.clip_max_new_tokens, c.max_prefill_tokens,
                                      c.chunked_prefill_size, self.page_size, self.rules)
        admitted: list[BatchEntry] = []
        continued = self.chunked is not None  # its entry comes first, not from the queue
        if continued:  # add_chunked_req: no KV check, as in SGLang
            req = self.chunked
            todo = req.fill_len - req.computed
            new = adder.next_chunk(todo)
            last = new == todo
            admitted.append(BatchEntry(req, req.computed, new, produces_token=last))
            adder.take(new, min(req.max_new_tokens, c.clip_max_new_tokens) if last else 0)
            self.chunked = None if last else req

        preempted: list[Req] = []
        # The queue in order, read in place: admission stops after a few requests, and the only
        # change to the queue meanwhile is a request leaving it to load (then the next one is in
        # its place), so this visits what a copy would without copying thousands every step.
        queue, at = self.waiting, 0
        while at < len(queue):
            req = queue[at]
            at += 1
            if self.rules.other_stops_first and adder.budget_state() is AddResult.OTHER:
                break  # the continued chunk used up a step budget
            if len(admitted) >= self.max_running - running_bs:
                self.batch_is_full = True
            if self.batch_is_full:  # SGLang 0.5.23: each request past here must preempt
                victims = to_preempt(req, self.running, adder, c.clip_max_new_tokens,
                                     self.new_token_ratio, c.priority_preemption_threshold
                                     ) if preempt else []
                if not victims:
                    break
                for victim in victims:
                    self.running.remove(victim)
                    adder.rem_total_offset -= reservation(victim, c.clip_max_new_tokens,
                                                          self.new_token_ratio)
                    self._release_kv(victim)
                    victim.preemptions += 1
                    self.preemptions += 1
                preempted += victims
                running_bs = len(self.running)
            if id(req) in held:
                continue
            result = self._add_one(req, adder, admitted)
            if result == _LOADING:
                at -= 1  # it left the queue
                continue
            if result is not AddResult.CONTINUE:
                if result is AddResult.NO_TOKEN:  # 0.5.23: full only if something else can run
                    self.batch_is_full = (not self.rules.full_needs_work or bool(admitted)
                                          or bool(self.running))
                break
        for victim in preempted:  # back into the queue after the step's admissions
            self._enqueue(victim)
        if not admitted:
            return None
        self._leave_queue([e.req for e in admitted[continued:]])

        news = [e.new for e in admitted]
        paged = self.page_size * len(admitted) if self.page_size > 1 else 0
        early = self._attribute(self._evict_for(sum(news) + paged), news)  # prepare_for_extend
        entries = []
        for entry, evicted_early in zip(admitted, early):
            req = entry.req
            evicted = self.cache.extend(req.lease, entry.new)
            if evicted is None:  # SGLang would run out of memory here; put it back instead
                self._requeue(req)
                continue
            req.evicted_tokens += evicted + evicted_early
            req.computed = entry.context + entry.new
            entries.append(entry.bind())
            if self.reuse is not None:
                self.reuse.attach(entries[-1])
        if not entries:
            return None
        self.processed_tokens += sum(e.new for e in entries)  # run_batch: extend_num_tokens
        return Batch("prefill", entries,
                     kv_copies=self.reuse.stores(entries) if self.reuse is not None else [])

    def _leave_queue(self, taken: list[Req]) -> None:
        """The requests admitted from the waiting queue leave it. They were admitted in queue
        order, so they are usually its head: cut it off (the queue may hold thousands under
        overload, and this runs every prefill step); else, where a held request was skipped
        among them, keep the rest in order."""
        head = self.waiting[: len(taken)]
        if len(head) == len(taken) and all(a is b for a, b in zip(head, taken)):
            del self.waiting[: len(taken)]
            return
        chosen = {id(r) for r in taken}
        self.waiting = [r for r in self.waiting if id(r) not in chosen]

    def _checked(self, ordering: Ordering | list[Req]) -> Ordering:
        """A user queue policy's answer as an `Ordering` (it may return a plain list), refused
        in one line unless it is the waiting requests reordered."""
        if not isinstance(ordering, Ordering):
            ordering = Ordering(list(ordering))
        if len(ordering.queue) != len(self.waiting) or \
                {id(r) for r in ordering.queue} != {id(r) for r in self.waiting}:
            raise BadInput(f"scheduler={self.config.target}: order() must return the waiting "
                           f"requests reordered ({len(self.waiting)} waiting, "
                           f"{len(ordering.queue)} returned)")
        return ordering

    def _add_one(self, req: Req, adder: PrefillAdder, admitted: list[BatchEntry]):
        """SGLang's ``add_one_req`` for one waiting request: admit it (whole or its first chunk)
        or say why not."""
        c = self.config
        fill = req.fill()
        available_before = self.cache.available_size
        lease = self.cache.acquire(fill, limit=len(fill) - 1, requester=req.requester)
        lease.prompt = len(req.prompt)  # the fill holds outputs after a retraction
        req.matched = lease.hit
        if lease.lower and self.loads.start(req, lease):
            self.waiting.remove(req)
            return _LOADING  # it waits for the copy; the loaded slots already count against the KV
        extend = len(fill) - lease.hit
        reserve = min(req.max_new_tokens, c.clip_max_new_tokens)
        input_tokens = adder.ceil_paged(extend)
        locked = available_before - self.cache.available_size  # what the lock took
        result = adder.refusal(req, extend, c.clip_max_new_tokens, locked, not admitted)
        forced = False  # admitted although its reservation does not fit: nothing else can run
        if result is AddResult.NO_TOKEN and self._alone(admitted):
            first = extend if adder.rem_chunk is None else min(extend, adder.rem_chunk)
            if first <= self.cache.available_size:
                result, forced = None, True
        if result is None and not (adder.rem_chunk is None or input_tokens <= adder.rem_chunk):
            new = adder.first_chunk(lease.hit)
            if new <= 0:
                result = AddResult.OTHER
        if result is not None:
            self.cache.release(lease, fill, insert=False)
            return result
        req.lease, req.computed = lease, lease.hit
        plan = self.reuse.plan(req, lease.hit) if self.reuse is not None else None
        if plan is not None and plan.donors and (
                self.cache.extension_cost(lease, extend) > self.cache.available_size or
                not forced and adder.refusal(req, extend, c.clip_max_new_tokens, locked,
                                             not admitted) is not None):
            # The donors' locks leave no room for the request, all its chunks to come (or, not
            # forced, its reservation) included: a chunk that finds no KV is put back and
            # planned the same way again, forever (the fuzzer, seed 6006 #9064). Reusing must
            # not refuse a request that fits without it, so this admission reuses nothing.
            self.reuse.release(req)
            plan = req.reuse_plan = ReusePlan()
        if req.cached_tokens is None:
            req.cached_tokens = min(lease.hit, len(req.prompt))
            if plan is not None:
                req.approx_hit_tokens = sum(s.reused for s in plan.spans)
                req.recomputed_tokens = sum(s.recompute for s in plan.spans)
            if self.cache.lower_tiers:
                self.loads.record_first_admission(req)
        if adder.rem_chunk is None or input_tokens <= adder.rem_chunk:
            admitted.append(BatchEntry(req, lease.hit, extend, produces_token=True))
            adder.take(extend, reserve)
        else:
            admitted.append(BatchEntry(req, lease.hit, new, produces_token=False))
            adder.take(new, 0)
            self.chunked = req
        return adder.budget_state()

    def _alone(self, admitted: list[BatchEntry]) -> bool:
        return not admitted and self.chunked is None and all(r.finished for r in self.running)
