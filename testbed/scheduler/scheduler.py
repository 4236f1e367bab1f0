"""The scheduler shared by the simulator and the engine: SGLang's, step by step.

Each step is a prefill batch or a decode batch, prefill first whenever one can be formed
(``Scheduler.get_next_batch_to_run``); each rule below names the SGLang function it follows.
The rules below are 0.4.10's; where 0.5.23 (the default, ``scheduler.sglang``) changed one, a
`ReleaseRules` flag switches it (`testbed.scheduler.release_rules` names each 0.5.23 function;
the admission checks themselves are in `testbed.scheduler.adder`).

- **Prefill** (``get_new_batch_prefill``, `PrefillAdder`). A request being chunked continues first
  (``add_chunked_req``); then waiting requests in the queue policy's order are admitted
  (``add_one_req``) until one does not fit: ``extend + min(max_new, clip) >= rem_total`` stops
  admission and marks the batch full (``NO_TOKEN``); an extend of at least the remaining
  ``max_prefill_tokens`` stops it when the batch has a request already (``OTHER``); a request
  longer than what is left of ``chunked_prefill_size`` is cut there and becomes the chunked one.
  Admission also stops, batch full, when the running batch plus the admitted reach
  ``max_running_requests``. A full batch tries no prefill until the running batch shrinks (a
  request finishes or is retracted). The running batch keeps requests that finished in a decode
  step until the next decode step filters them out, so they count toward
  ``max_running_requests`` until then, as in SGLang.
- **Insert after prefill.** Once a request's prefill is done its sequence enters the cache
  (``cache_unfinished_req``) and its lock moves to the new deepest node: requests admitted later
  hit it while it decodes. Each chunk of a chunked prefill enters the cache before the next batch
  forms. Decoded tokens enter at finish (``cache_finished_req``).
- **Decode** (``update_running_batch``). One token for every running request. When the KV pool
  cannot hold the step, requests are retracted (``retract_decode``: fewest outputs first, then
  longest prompt), their KV beyond the cached prefix freed, and appended to the queue, until the
  rest have room for ``retract_decode_steps`` tokens each (the tree is evicted to make that room
  at once); ``new_token_ratio`` is then re-estimated, and otherwise decays by one step.
- **Overlap** (``scheduler.overlap``, SGLang's default ``event_loop_overlap``): a batch's results
  (tokens, finishes, the insert after prefill) are applied only after the next batch is formed,
  so that batch decodes requests whose last token is still in flight, and one step more for a
  request that has just finished (its extra token is dropped, as SGLang frees it; 0.5.23
  skips that step when the request finished by length: `_finishing_in_flight`). A
  prefill-only call (no output) is never decoded: there is no token to feed it. When no batch
  forms until those results are applied, the step is formed again at once (SGLang's loop).

  Two orders drive it, to the same decisions. The serving loop's (`testbed.serving.step_cycle`):
  `form` the next batch while the last one runs, launch it, then `complete` the last one (its
  results apply at once, a batch having formed since). The results-first order (SGLang's tests,
  the scheduler's own): `complete` a batch (its results wait, nothing having formed since), then
  `next_batch` forms the next and applies them.

Beyond SGLang: when nothing runs and the first request's reservation does not fit, it is admitted
anyway (SGLang clips ``max_new_tokens`` at submission so that this cannot happen; without the
exception such a run would never end).

The scheduler never reads a clock: the driver passes ``now`` in (used for records and
``lpm_aging``), so the simulator and the engine make the same decisions whenever their step
durations do not change the order of events.

With lower cache tiers (host, disk), a request whose match continues below the GPU has that run
loaded back when it is considered for admission, unless the cache's planner finds recomputing it
faster (`testbed.scheduler.loadback`); it rejoins the queue, in its submission place, when the
driver reports the copy done (`load_done`).

Beyond exact prefixes (``cache.reuse=blend``, ``cache.match=semantic``), a `ReusePlanner`
(`testbed.scheduler.reuse_planner`) plans each admission's reused spans, gives prefill entries
theirs, adds a step's chunk stores to its batch, and keeps approximate KV out of the exact tree.

The class is in rooms, a module each, that `Scheduler` inherits; a reader finds a rule by its
room's name:

- this module: the state (``__init__``), requests in (`submit`, `abort`, a load-back done) and
  the step's forming (`form`, `next_batch`, the overlap's order, the last prefill merged into
  the running batch);
- `testbed.scheduler.admission`: a prefill batch (the adder loop, chunked prefill, preemption);
- `testbed.scheduler.decode_step`: a decode or verification step (finished and finishing
  requests dropped, the step's room, its entries);
- `testbed.scheduler.retraction`: retraction, and the eviction each step makes room by;
- `testbed.scheduler.results`: a step's results applied (tokens, inserts, finishes);
- `testbed.scheduler.release_rules`: the flags by which 0.5.23's rules differ, read in each room.

The rooms are mixins, not objects of their own, because each reads and writes the same state (the
queue, the running batch, the chunked request, ``new_token_ratio``): one `Scheduler` keeps the API
the serving loop, the engine and the tests use, and a method found in a room costs no call more
than one defined here (the loop's calls per token are counted: tests/test_loop_speed_guard.py).
"""

from __future__ import annotations

import math
from typing import Collection

import numpy as np

from testbed.cache.base import Lease, PrefixCache
from testbed.cache.reuse import ReuseConfig
from testbed.errors import BadInput
from testbed.scheduler.admission import Admission
from testbed.scheduler.batch import Batch
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.decode_groups import DecodeGroups, attach_groups
from testbed.scheduler.decode_step import DecodeSteps
from testbed.scheduler.loadback import LoadBacks
from testbed.scheduler.release_rules import ReleaseRules
from testbed.scheduler.request_state import Req
from testbed.scheduler.results import Results
from testbed.scheduler.retraction import Retraction
from testbed.scheduler.reuse_planner import ReusePlanner
from testbed.scheduler.spec_steps import SpecSteps
from testbed.scheduler.speculative import SpeculativeConfig
from testbed.workloads.request import Request


class Scheduler(Admission, DecodeSteps, Retraction, Results):
    def __init__(self, cache: PrefixCache, config: SchedulerConfig | None = None,
                 seed: int = 0, eos_token_ids: Collection[int] = (),
                 eos_for_all: bool = False, reuse: ReuseConfig | None = None,
                 check_invariants: bool = False,
                 speculative: SpeculativeConfig | None = None) -> None:
        """``eos_token_ids``: a generated one ends its request (SGLang's ``check_finished``), for
        requests the model generates: those with ``max_new_tokens`` and no output, or every one
        with ``eos_for_all`` (the engine generating). A replayed output ignores EOS. ``reuse``:
        the cache group's reuse keys (None, or exact prefixes only: no planner).
        ``check_invariants``: check the cache's bookkeeping against the held leases after every
        `next_batch` and `complete` (``debug.check_invariants``; slow, for tests and the fuzzer).
        ``speculative``: decode steps carry drafts to verify (`testbed.scheduler.spec_steps`;
        None or ``method=none``: plain decoding)."""
        self.check_invariants = check_invariants
        self.decode_groups: DecodeGroups | None = None  # cascade: set by `build_scheduler`
        self.cache = cache
        self.reuse = ReusePlanner(cache, reuse) if reuse is not None and reuse.active else None
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.eos_for_all = eos_for_all
        self.config = config or SchedulerConfig()
        c = self.config
        self.rules = ReleaseRules.of(c.sglang)
        self.policy = c.queue_policy().build(cache=cache, rng=np.random.default_rng(seed),
                                             **c.settings())
        capacity = cache.available_size
        self.max_running = c.max_running_requests or (
            4096 if math.isinf(capacity) else max(1, min(int(capacity) // 2, 4096)))
        self.page_size = getattr(cache, "page_size", 1)  # SGLang's pages (radix); 1 otherwise
        if c.chunked_prefill_size is not None and c.chunked_prefill_size < self.page_size:
            raise BadInput(f"scheduler.chunked_prefill_size={c.chunked_prefill_size} must be at "
                           f"least cache.page_size={self.page_size} (a chunk is cut at whole "
                           "pages)")
        self.waiting: list[Req] = []  # SGLang's waiting_queue: the policy re-sorts it in place
        self.running: list[Req] = []  # the running batch; finished ones stay until a decode step
        self.chunked: Req | None = None
        self.batch_is_full = False
        self._last_prefill: Batch | None = None  # merged into the running batch at the next step
        self._unapplied: list[Batch] = []  # formed, results not applied yet (oldest first)
        self._newest: Batch | None = None  # what the latest `form` returned
        # overlap, results-first order: results reported before the next batch formed
        self._pending: tuple[Batch, list[int | None]] | None = None
        self._finished_out: list[Req] = []  # finished while applying pending results
        self.min_new_token_ratio = c.init_new_token_ratio * c.min_new_token_ratio_factor
        self.new_token_ratio_decay = (c.init_new_token_ratio - self.min_new_token_ratio) / c.new_token_ratio_decay_steps
        self.new_token_ratio = c.init_new_token_ratio
        self.preemptions = 0
        self.processed_tokens = 0  # prefill tokens run so far (SGLang's processed_tokens_counter)
        self._now = 0.0  # the clock of the latest next_batch
        self._seq = 0
        self.loads = LoadBacks(cache)  # lower-tier load-backs in flight
        self.spec = SpecSteps(speculative, cache) \
            if speculative is not None and speculative.active else None

    # ------------------------------------------------------------------ requests in
    def submit(self, request: Request, now: float, prompt: np.ndarray | None = None) -> Req:
        """Queue a request. One that could never fit in the KV cache is aborted at once: under
        overlap it needs one slot more, its last token's, as it is decoded once more before its
        finish is applied."""
        req = Req(request=request, prompt=request.prompt if prompt is None else prompt,
                  submitted_s=now, seq=self._seq, queued_s=now,
                  queued_tokens=self.processed_tokens)
        if self.eos_for_all or request.generates:
            req.use_stop_tokens(self.eos_token_ids)
        self._seq += 1
        extra = 1 if self.config.overlap and req.max_new_tokens > 0 else 0
        if not self.cache.fits(req.kv_needed + extra):
            req.aborted = True
            req.finish_s = now
            return req
        self.waiting.append(req)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.chunked or self.loading or self._unapplied
                    or any(not r.finished for r in self.running)
                    or (self._last_prefill and any(not e.req.finished
                                                   for e in self._last_prefill.entries)))

    # ------------------------------------------------------------------ the next step
    def next_batch(self, now: float = 0.0) -> Batch | None:
        """Form the next step (``get_next_batch_to_run``) in the results-first order: with
        ``overlap``, the results `complete` kept back are applied right after it is formed;
        `take_finished` returns what they finished.

        When no batch forms but applying those results changed the state (a request finished
        and unlocked or freed its KV), the step is formed again at once: SGLang's overlap loop
        goes round again without waiting for input. The driver would otherwise wait for an
        arrival that may never come while admissible requests sit in the queue."""
        batch = self.form(now)
        if self._pending is not None:
            done, tokens = self._pending
            self._pending = None
            self._finished_out += self._applied(done, tokens, now)
            if batch is None:
                batch = self.form(now)
        return batch

    def form(self, now: float = 0.0) -> Batch | None:
        """Form the next step and put its cascade groups on it, applying no results: under
        ``overlap`` the step formed before it may still be running (its results come with
        `complete`). None when no step forms now."""
        self._now = now
        # at most the step before this one is still unapplied (overlap); a batch formed and
        # never completed before that is forgotten, as one that never ran
        self._unapplied = self._unapplied[-1:] if self.config.overlap else []
        batch = self._form(now)
        attach_groups(batch, self.decode_groups)
        if batch is not None:
            self._unapplied.append(batch)
        self._newest = batch
        if self.check_invariants:
            self.cache.check_invariants(self.leases())
        return batch

    def _form(self, now: float) -> Batch | None:
        """SGLang's ``get_next_batch_to_run``: a prefill batch if one forms, else a decode."""
        if self.chunked is not None and self.config.overlap:
            self._commit_chunk(self.chunked)
        self._merge_last_prefill()
        if self.rules.filter_finished_first:
            self._filter_finished()
        batch = self._prefill_batch(now)
        if batch is None:
            before, full = len(self.running), self.batch_is_full
            batch = self._decode_batch()
            if batch is None:
                self.new_token_ratio = self.config.init_new_token_ratio  # idle: SGLang resets it
                # The running batch emptied, or nothing runs and the full flag was just cleared
                # (set while a load-back or a failed extend held the KV): SGLang's next loop
                # iteration tries prefill at once; waiting for an arrival here could wait forever.
                if before or full:
                    batch = self._prefill_batch(now)
        if batch is not None and batch.kind == "prefill":
            self._last_prefill = batch
        return batch

    def take_finished(self) -> list[Req]:
        """Requests finished while `next_batch` applied the previous step's results (overlap)."""
        out, self._finished_out = self._finished_out, []
        return out

    def _merge_last_prefill(self) -> None:
        """The last prefill batch joins the running batch, less its finished requests and its
        chunked one; a smaller batch, or a new running batch, is not full (SGLang's
        ``filter_batch`` and ``merge_batch`` in ``get_next_batch_to_run``).

        A prefill-only call (``max_new_tokens`` 0) never joins: it makes no token, so there is
        nothing to decode, and it finishes when its prefill's results are applied. Under overlap
        those results are not applied yet here, so ``finished`` cannot tell; without this check
        the next decode step would feed it a token that does not exist (no input ids)."""
        last, self._last_prefill = self._last_prefill, None
        if last is None:
            return
        keep = [e.req for e in last.entries
                if e.produces_token and not e.req.finished and e.gen == e.req.preemptions
                and e.req.remaining_new_tokens > 0]
        if len(keep) < len(last.entries) or (keep and not self.running):
            self.batch_is_full = False
        self.running += keep

    # ------------------------------------------------------------------ lower-tier load-backs
    @property
    def loading(self) -> list[Req]:
        return self.loads.loading

    @property
    def tier_hits(self) -> dict[str, tuple[int, dict[str, int] | None, float | None]]:
        """Per request id at first admission: (hit, loaded per tier, load wait)."""
        return self.loads.tier_hits

    def take_loads(self) -> list[Req]:
        """Requests whose load-back was started since the last call (their leases say how many
        tokens come from each tier: ``req.lease.loaded``)."""
        return self.loads.take_new()

    def load_done(self, req: Req, waited_s: float = 0.0) -> None:
        """The load-back of ``req`` finished after ``waited_s``: its prefix is on the GPU now; it
        rejoins the queue."""
        self.loads.done(req, waited_s)
        self._insert_by_seq(req)

    def _insert_by_seq(self, req: Req) -> None:
        """Back into the queue where its submission order puts it (before the first request
        submitted after it): a load-back only delayed it."""
        at = next((i for i, r in enumerate(self.waiting) if r.seq > req.seq), len(self.waiting))
        self.waiting.insert(at, req)

    # ------------------------------------------------------------------ aborts
    def abort(self, req: Req, now: float) -> bool:
        """End ``req`` now, unfinished (a client went away): it leaves the queue, the chunked
        slot, the running batch or the load-backs, and gives its lease up. The tokens it has KV
        for (``req.computed`` of its fill) enter the cache, as SGLang caches a request finished
        by an abort (``cache_finished_req``); a waiting one (never admitted, or retracted) holds
        no KV. Call it between steps only (before `form` or `next_batch`): a result still
        pending under ``overlap`` (or a step still running) is then dropped, as for any finished
        request; the KV its step is writing is inserted as it will be once the step ends. Returns
        False when the request had already finished (nothing to do)."""
        if req.finished:
            return False
        if any(r is req for r in self.loading):
            self.loads.done(req, 0.0)  # the copy is given up; its lease freed, nothing inserted
        elif req.lease is not None:
            self._release_inserting(req, req.computed)
        self.waiting = [r for r in self.waiting if r is not req]
        if any(r is req for r in self.running):
            self.running = [r for r in self.running if r is not req]
            self.batch_is_full = False
        if self.chunked is req:
            self.chunked = None
        req.aborted = True
        req.finish_s = now
        return True

    def check_drained(self) -> None:
        """At the end of a run: every request finished, no lease held, nothing locked in the
        cache (``debug.check_invariants``); raises AssertionError naming what is left."""
        left = [r.id for r in self.waiting + self.running if not r.finished]
        assert not left and self.chunked is None, f"requests left unfinished: {left[:5]}"
        assert not self.leases(), f"{len(self.leases())} leases still held at the end"
        assert self.cache.protected_size == 0, \
            f"{self.cache.protected_size} tokens still locked in the cache at the end"
        self.cache.check_invariants()

    def leases(self) -> list[Lease]:
        """Leases of every request holding KV, batches in flight included (invariant checks)."""
        holders = self.running + ([self.chunked] if self.chunked else []) + self.loading
        for batch in (self._last_prefill, *self._unapplied):
            holders += [e.req for e in batch.entries] if batch else []
        return list({id(r.lease): r.lease for r in holders if r.lease is not None}.values())
