"""The scheduler shared by the simulator and the engine (SGLang's policy, step by step).

Each step is either a prefill batch or a decode batch, prefill first whenever one can be formed:

- **Prefill.** A request being chunked continues first; then waiting requests in the queue
  policy's order are admitted while the batch has room (``max_running_requests``), the step's
  token budget (``max_prefill_tokens``) and the KV budget allow. The KV budget is what the cache
  could free plus hold, minus reservations for future output: ``min(remaining, clip) ×
  new_token_ratio`` for each running request and ``min(max_new, clip)`` for each admitted one. A
  request longer than what is left of ``chunked_prefill_size`` is cut into chunks; each chunk's KV
  is committed to the cache so others can share it. Admission stops at the first request that
  does not fit (no skipping ahead), except deferred ones (in-batch prefix caching).
- **Decode.** One token for every running request. When the KV pool cannot hold one more token
  for each, requests are retracted (SGLang's order: fewest outputs, then longest prompt), their
  KV beyond the cached prefix freed, and re-queued; they later re-prefill prompt + outputs so far.
  ``new_token_ratio`` is then re-estimated, and otherwise decays by one step towards its minimum.

The scheduler never looks at time: the driver passes ``now`` in, so the simulator and the engine
make the same decisions whenever their step durations do not change the order of events.

With lower cache tiers (host, disk), a request whose match continues below the GPU has that run
loaded back when it is considered for admission, unless the cache's planner finds recomputing it
faster: it leaves the queue, its lease protecting the run, until the driver reports the copy done
(`load_done`); then it rejoins the queue, its prefix now a GPU hit (most recently used, so the last
to be evicted again), and is admitted as usual.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from testbed.cache.base import PrefixCache
from testbed.scheduler.batch import Batch, BatchEntry
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.policy import QueuePolicy
from testbed.scheduler.request_state import Req
from testbed.workloads.request import Request


class Scheduler:
    def __init__(self, cache: PrefixCache, config: SchedulerConfig | None = None,
                 seed: int = 0) -> None:
        self.cache = cache
        self.config = config or SchedulerConfig()
        c = self.config
        self.policy = QueuePolicy(c.name, cache, np.random.default_rng(seed),
                                  lpm_fallback_threshold=c.lpm_fallback_threshold,
                                  in_batch_prefix_caching=c.in_batch_prefix_caching,
                                  check_threshold=c.in_batch_check_threshold,
                                  deprioritize_threshold=c.in_batch_deprioritize_threshold)
        capacity = cache.available_size
        self.max_running = c.max_running_requests or (
            4096 if math.isinf(capacity) else max(1, min(int(capacity) // 2, 4096)))
        self.waiting: list[Req] = []  # in submission order
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self._in_flight: Batch | None = None
        self.min_new_token_ratio = c.init_new_token_ratio * c.min_new_token_ratio_factor
        self.new_token_ratio_decay = (c.init_new_token_ratio - self.min_new_token_ratio) / c.new_token_ratio_decay_steps
        self.new_token_ratio = c.init_new_token_ratio
        self.preemptions = 0
        self._seq = 0
        self.loading: list[Req] = []  # load-back from a lower tier in flight; they hold leases
        self._new_loads: list[Req] = []  # issued since the driver last took them
        # with lower tiers, per request id at first admission: (hit, loaded per tier, load wait)
        self.tier_hits: dict[str, tuple[int, dict[str, int] | None, float | None]] = {}
        self._loaded: dict[str, tuple[dict[str, int], float]] = {}  # before first admission

    # ------------------------------------------------------------------ requests in
    def submit(self, request: Request, now: float, prompt: np.ndarray | None = None) -> Req:
        """Queue a request. One that could never fit in the KV cache is aborted at once."""
        req = Req(request=request, prompt=request.prompt if prompt is None else prompt,
                  submitted_s=now, seq=self._seq)
        self._seq += 1
        if not self.cache.fits(req.kv_needed):
            req.aborted = True
            req.finish_s = now
            return req
        self.waiting.append(req)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.loading)

    # ------------------------------------------------------------------ the next step
    def next_batch(self) -> Batch | None:
        batch = self._prefill_batch() if (self.waiting or self.chunked) else None
        if batch is None and self.running:
            batch = self._decode_batch()
            if not batch.entries:  # everything was retracted: start over with prefill
                batch = self._prefill_batch()
        if batch is None and not self.has_work:
            self.new_token_ratio = self.config.init_new_token_ratio
        self._in_flight = batch
        return batch

    def _reserved(self) -> float:
        clip = self.config.clip_max_new_tokens
        return sum(min(r.remaining_new_tokens, clip) for r in self.running) * self.new_token_ratio

    def _prefill_batch(self) -> Batch | None:
        c = self.config
        if len(self.running) >= self.max_running and self.chunked is None:
            return None
        offset = self._reserved()
        if self.chunked is None and self.cache.available_size - offset <= 0:
            return None  # no KV budget: not worth ordering the queue
        rem_input = c.max_prefill_tokens
        rem_chunk = c.chunked_prefill_size if c.chunked_prefill_size is not None else math.inf
        admitted: list[BatchEntry] = []

        def rem_total() -> float:
            return self.cache.available_size - offset

        if self.chunked is not None:  # the request being chunked continues first
            req = self.chunked
            todo = req.fill_len - req.computed
            new = int(min(todo, rem_chunk, max(rem_total(), 1)))
            last = new == todo
            admitted.append(BatchEntry(req, req.computed, new, produces_token=last))
            offset += new + (min(req.remaining_new_tokens, c.clip_max_new_tokens) if last else 0)
            rem_input -= new
            rem_chunk -= new
            self.chunked = None if last else req

        ordering = self.policy.order(self.waiting) if self.waiting else None
        for req in ordering.queue if ordering else []:
            if rem_total() <= 0 or rem_input <= 0 or rem_chunk <= 0:
                break
            if len(self.running) + len(admitted) >= self.max_running:
                break
            if id(req) in ordering.deferred:
                continue
            fill = req.fill()
            lease = self.cache.acquire(fill, limit=len(fill) - 1, requester=req.requester)
            if lease.lower and self._load_back(req, lease):
                continue  # it waits for the copy; the loaded slots already count against the KV
            extend = len(fill) - lease.hit
            reserve = min(req.remaining_new_tokens, c.clip_max_new_tokens)
            budget = rem_total()
            alone = not self.running and not admitted  # nothing else could make progress
            over_budget = (min(extend, rem_chunk) > budget) if alone else (extend + reserve >= budget)
            if over_budget or (extend > rem_input and admitted):
                self.cache.release(lease, fill, insert=False)
                break
            req.lease, req.computed = lease, lease.hit
            if req.cached_tokens is None:
                req.cached_tokens = min(lease.hit, len(req.prompt))
                if self.cache.lower_tiers:
                    self._record_tier_hit(req)
            if extend <= rem_chunk:
                admitted.append(BatchEntry(req, lease.hit, extend, produces_token=True))
                offset += extend + reserve
            else:
                new = int(rem_chunk)
                admitted.append(BatchEntry(req, lease.hit, new, produces_token=False))
                offset += new
                self.chunked = req
                extend = new
            rem_input -= extend
            rem_chunk -= extend
            self.waiting.remove(req)

        entries = []
        for entry in admitted:
            evicted = self.cache.extend(entry.req.lease, entry.new)
            if evicted is None:  # reservations are estimates: put it back for a later step
                self._requeue(entry.req)
                continue
            entry.req.evicted_tokens += evicted
            entries.append(entry)
        return Batch("prefill", entries) if entries else None

    def _load_back(self, req: Req, lease) -> bool:
        """Start loading the lease's lower-tier run back to the GPU; False when the cache gives it
        up instead (recomputing is faster, or no room): the lease then covers the GPU part."""
        evicted = self.cache.load_back(lease)
        if evicted is None:
            return False
        req.evicted_tokens += evicted
        req.lease = lease
        self.waiting.remove(req)
        self.loading.append(req)
        self._new_loads.append(req)
        if req.cached_tokens is None:
            loads, waited = self._loaded.get(req.id, ({}, 0.0))
            self._loaded[req.id] = ({k: loads.get(k, 0) + v for k, v in lease.loaded.items()},
                                    waited)
        return True

    def _record_tier_hit(self, req: Req) -> None:
        """At first admission: how much of the hit was loaded from each tier (what was loaded for
        it, capped by the hit: a loaded run evicted again before admission is not counted)."""
        loads, waited = self._loaded.pop(req.id, (None, None))
        left = req.cached_tokens
        if loads:
            loads = dict(loads)
            for tier in loads:
                loads[tier] = min(loads[tier], left)
                left -= loads[tier]
        self.tier_hits[req.id] = (req.cached_tokens, loads, waited)

    def take_loads(self) -> list[Req]:
        """Requests whose load-back was started since the last call (their leases say how many
        tokens come from each tier: ``req.lease.loaded``)."""
        out, self._new_loads = self._new_loads, []
        return out

    def load_done(self, req: Req, waited_s: float = 0.0) -> None:
        """The load-back of ``req`` finished after ``waited_s``: its prefix is on the GPU now; it
        rejoins the queue (and gives its lease up: nothing holds KV while waiting)."""
        self.loading.remove(req)
        self.cache.release(req.lease, req.fill(), insert=False)
        req.lease = None
        if req.id in self._loaded:
            loads, waited = self._loaded[req.id]
            self._loaded[req.id] = (loads, waited + waited_s)
        bisect.insort(self.waiting, req, key=lambda r: r.seq)

    def _decode_batch(self) -> Batch:
        if self.cache.available_size < self._decode_cost(self.running):
            self._retract()
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay,
                                       self.min_new_token_ratio)
        leases = [req.lease for req in self.running]
        for req, evicted in zip(self.running, self.cache.extend_each(leases, 1)):
            req.evicted_tokens += evicted
        return Batch("decode", [BatchEntry(req, req.computed, 1, produces_token=True)
                                for req in self.running])

    def _retract(self) -> None:
        """Free KV by sending requests back to the queue until one token each fits."""
        order = {
            "newest": lambda r: (len(r.output), -len(r.prompt)),
            "longest_prompt": lambda r: (-len(r.prompt), r.seq),
            "most_remaining": lambda r: (-r.remaining_new_tokens, r.seq),
        }[self.config.retract_order]
        candidates = sorted(self.running, key=order, reverse=True)
        first = True
        while candidates and (first or self.cache.available_size < self._decode_cost(candidates)):
            if len(candidates) == 1 and self.cache.available_size >= self._decode_cost(candidates):
                break
            first = False
            req = candidates.pop()
            self.running.remove(req)
            self._requeue(req)
            req.preemptions += 1
            self.preemptions += 1
        decoded = sum(len(r.output) for r in self.running)
        budget = sum(r.max_new_tokens for r in self.running)
        if budget:
            steps = self.config.retract_decode_steps
            self.new_token_ratio = min(1.0, (decoded + steps * len(self.running)) / budget)

    def _decode_cost(self, reqs: list[Req]) -> int:
        """KV capacity one more decode step of ``reqs`` takes."""
        return sum(self.cache.extension_cost(r.lease, 1) for r in reqs)

    def _requeue(self, req: Req) -> None:
        self.cache.release(req.lease, req.fill(), insert=False)
        req.lease, req.computed = None, 0
        if self.chunked is req:
            self.chunked = None
        bisect.insort(self.waiting, req, key=lambda r: r.seq)  # the queue stays in FCFS order

    # ------------------------------------------------------------------ results in
    def complete(self, batch: Batch, tokens: list[int | None], now: float) -> list[Req]:
        """Apply a step's outcome (the token each entry produced, or None); returns the requests
        that finished in it."""
        self._in_flight = None
        finished = []
        for entry, token in zip(batch.entries, tokens):
            req = entry.req
            req.computed = entry.context + entry.new
            if entry.produces_token and req.remaining_new_tokens > 0:
                if token is None:
                    raise ValueError(f"request {req.id}: the executor produced no token")
                req.output.append(int(token))
                if req.first_token_s is None:
                    req.first_token_s = now
            elif not entry.produces_token:
                self.cache.commit(req.lease, req.kv_tokens())  # a chunk: share it right away
                continue
            if req.remaining_new_tokens == 0:
                self._finish(req, now)
                finished.append(req)
            elif batch.kind == "prefill":
                self.running.append(req)
        return finished

    def _finish(self, req: Req, now: float) -> None:
        released = self.cache.release(req.lease, req.kv_tokens(), insert=True)
        req.inserted = released.inserted
        req.lease = None
        req.finish_s = now
        if req in self.running:
            self.running.remove(req)

    def leases(self):
        """Leases of every request holding KV, the batch in flight included (invariant checks)."""
        holders = self.running + ([self.chunked] if self.chunked else []) + self.loading
        holders += [e.req for e in self._in_flight.entries] if self._in_flight else []
        return list({id(r.lease): r.lease for r in holders if r.lease is not None}.values())
