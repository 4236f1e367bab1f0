"""vLLM V1's scheduler (``scheduler=vllm``) over the block-hash cache, step by step.

Each rule names the function of vLLM 0.32 it follows (``vllm/v1/core/sched/scheduler.py``:
``Scheduler``; ``vllm/v1/core/kv_cache_manager.py``: ``KVCacheManager``; docs/design.md §4). It is
written from those rules, not copied; `experiments/validation/vllm/scheduler.py` runs vLLM's own
classes beside it.

- **No phases** (``Scheduler.schedule``). A step gives each request tokens so that what it has
  computed catches up with its fill (prompt plus outputs): a prefill chunk, a whole prompt or one
  decode token, all in one batch under one token budget, ``max_num_batched_tokens``.
- **Running first** (``schedule``, its first loop). Running requests, in their order, each get
  ``min(fill − computed, budget)`` tokens (at most ``long_prefill_token_threshold`` when set and
  more than one request is running or waiting). When the KV blocks for them cannot be had
  (``KVCacheManager.allocate_slots`` returns None), the *last* running request is preempted
  (``self.running.pop()``, ``_preempt_request``): its blocks are freed (``KVCacheManager.free``,
  last block first), its computed tokens reset to 0 (recompute), and it goes to the *front* of the
  waiting queue (``prepend_request``); repeated until the allocation fits or the request itself
  was the one preempted, which ends the loop.
- **Then waiting** (``schedule``, its second loop; only in a step that preempted nobody), in queue
  order (FCFS), while budget is left and fewer than ``max_num_seqs`` run: the cached prefix is
  looked up (``KVCacheManager.get_computed_blocks``: whole blocks, at most ``fill − 1`` tokens, so
  the last token is always computed); the request takes ``min(fill − hit, budget)`` tokens
  (without ``enable_chunked_prefill``, a request that does not fit the budget stops admission);
  it is admitted only if the free queue holds the blocks of its whole fill beyond the hit, plus
  the hit's blocks that sit in the free queue (``allocate_slots`` with
  ``full_sequence_must_fit``, i.e. ``scheduler_reserve_full_isl``; ``get_num_blocks_to_allocate``);
  otherwise admission stops. Admitted requests join the end of the running list.
- **When a block becomes cacheable** (``allocate_slots`` → ``cache_blocks``). As soon as a step is
  scheduled, every block that the request's tokens up to ``computed + new`` fill completely gets
  its chained hash: later requests, even later in the same step, hit it while the first is still
  running. Decoded tokens join as their blocks fill.
- **Speculative decoding** (``speculative``: the scheduler's drafts, as vLLM's
  ``spec_token_ids``). After a step in which a request produced a token (and did not finish),
  the drafter proposes its drafts from its context (``update_draft_token_ids``); they stay the
  request's until it is next scheduled (then they are cleared, scheduled or not) or preempted
  (cleared). A running request with drafts wants ``fill − computed + |d|`` tokens, capped like
  any other (``long_prefill_token_threshold``, the budget); the drafts scheduled are the first
  ``computed + new − fill`` of them (none when the cap leaves only the last token: a plain
  decode). ``allocate_slots`` takes blocks for all ``new`` tokens and hashes only blocks full of
  *verified* tokens (it caches up to ``min(computed + new, request.num_tokens)``: the fill, never
  a draft). Results: ``computed`` rolls back by the rejected drafts and the verified tokens are
  appended one by one (a finish ends the request there); the request keeps the blocks of its
  rejected drafts (``BlockHashCache.rewind``), which its next step fills again. A block that its
  accepted drafts fill is hashed at the request's next ``allocate_slots``, and never if it
  finishes first (``_free_request`` hashes nothing). vLLM's CUDA-graph padding of a waiting
  request's one-token admission to ``1 + num_speculative_tokens`` is not modelled. Runs refuse
  ``speculative`` with this scheduler (`check_speculative`); the drafts are checked against
  vLLM's own scheduler by `experiments/validation/vllm/spec_blocks.py`.
- **Results** (``update_from_output``). An entry whose tokens reach the end of its fill produces a
  token; a request that reaches ``max_new_tokens`` (or a stop token) is freed at once, in the
  step's order (``_free_request``): its hashed blocks to the free queue's tail, the unhashed last
  block to its head (``BlockPool.free_blocks``).

Beyond vLLM: a request whose KV (``prompt + max_new − 1``) could never fit the pool is aborted at
submission, as with the SGLang scheduler (vLLM checks only ``max_model_len``). Not modelled:
async scheduling, priorities, KV connectors, encoder inputs,
``max_model_len``, the watermark (0 by default).
"""

from __future__ import annotations

from collections import deque

import numpy as np
from typing import Collection

from testbed.cache.base import Lease
from testbed.cache.block_hash import BlockHashCache
from testbed.errors import BadInput, WorkloadRefused
from testbed.scheduler.decode_groups import DecodeGroups, attach_groups
from testbed.scheduler.batch import Batch, BatchEntry
from testbed.scheduler.request_state import Req
from testbed.scheduler.spec_steps import SpecSteps
from testbed.scheduler.speculative import SpeculativeConfig
from testbed.scheduler.vllm_config import VllmSchedulerConfig
from testbed.workloads.request import Request


class VllmScheduler:
    def __init__(self, cache: BlockHashCache, config: VllmSchedulerConfig | None = None,
                 eos_token_ids: Collection[int] = (), eos_for_all: bool = False,
                 check_invariants: bool = False,
                 speculative: SpeculativeConfig | None = None) -> None:
        if not isinstance(cache, BlockHashCache):
            raise BadInput(f"scheduler=vllm needs cache=block_hash, got cache={cache.name}")
        self.cache = cache
        self.config = config or VllmSchedulerConfig()
        self.block_size = cache.block_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.eos_for_all = eos_for_all
        self.check_invariants = check_invariants
        self.decode_groups: DecodeGroups | None = None  # cascade: set by `build_scheduler`
        self.waiting: deque[Req] = deque()  # FCFS; preempted requests go to the front
        self.running: list[Req] = []  # admission order; the last is preempted first
        self.preemptions = 0
        self.loading: list[Req] = []  # no lower tiers: nothing is ever loaded back
        self.tier_hits: dict = {}
        self._seq = 0
        self.spec = SpecSteps(speculative, cache, keep_blocks=True) \
            if speculative is not None and speculative.active else None
        self._drafts: dict[int, np.ndarray] = {}  # id(req) -> its drafts (vLLM's spec_token_ids)

    # ------------------------------------------------------------------ requests in
    def submit(self, request: Request, now: float, prompt=None) -> Req:
        """Queue a request (``add_request``); abort one whose KV could never fit the pool."""
        req = Req(request=request, prompt=request.prompt if prompt is None else prompt,
                  submitted_s=now, seq=self._seq)
        self._seq += 1
        if self.eos_for_all or request.generates:
            req.use_stop_tokens(self.eos_token_ids)
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and req.kv_needed > budget:
            raise WorkloadRefused(
                f"request {req.id}: {req.kv_needed} tokens (prompt + output − 1) exceed "
                f"scheduler.max_num_batched_tokens={budget} with enable_chunked_prefill=false "
                "(vLLM requires max_model_len <= max_num_batched_tokens then); raise it or "
                "enable chunked prefill")
        if self.cache.fits(req.kv_needed):
            self.waiting.append(req)
        else:  # never fits: aborted, it finishes at once
            req.aborted, req.finish_s = True, now
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_finished(self) -> list[Req]:
        return []  # results are applied in `complete` (no overlap)

    def take_loads(self) -> list[Req]:
        return []

    # ------------------------------------------------------------------ the next step
    def form(self, now: float = 0.0) -> Batch | None:
        """The serving loop's name for `next_batch` (no overlap: nothing is ever left to apply)."""
        return self.next_batch(now)

    def next_batch(self, now: float = 0.0) -> Batch | None:
        """``Scheduler.schedule``: running requests first, then waiting ones (module docstring)."""
        c = self.config
        budget = c.max_num_batched_tokens
        threshold = c.long_prefill_token_threshold \
            if len(self.running) + len(self.waiting) > 1 else 0
        entries: list[BatchEntry] = []
        decodes: list[bool] = []  # per entry: a decode, else a prefill chunk
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            draft = self._drafts.pop(id(req), None)  # cleared once scheduled (or not)
            want = req.fill_len - req.computed + (0 if draft is None else len(draft))
            new = self._chunk(want, threshold, budget)
            while not self._allocate(req, new):
                victim = self.running.pop()  # FCFS: the last running request
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.lease is None:  # it preempted itself: nothing more runs this step
                break
            drafted = req.computed + new - req.fill_len
            verify = draft is not None and drafted > 0
            decodes.append(bool(req.output) and req.computed == req.fill_len - 1
                           and (new == 1 or verify))
            entries.append(self._scheduled(req, new, draft[:drafted] if verify else None))
            entries[-1].decode = decodes[-1]
            budget -= new
            i += 1
        while not preempted and budget > 0 and self.waiting \
                and len(self.running) < c.max_num_seqs:
            req = self.waiting[0]
            fill = req.fill()
            hit, idle = self.cache.peek(fill, limit=len(fill) - 1)  # get_computed_blocks
            want = self._chunk(len(fill) - hit, threshold, None)
            if not c.enable_chunked_prefill and want > budget:
                break
            new = min(want, budget)
            if not self._admissible(len(fill), hit, idle, new):
                break
            self.waiting.popleft()
            req.lease = self.cache.acquire(fill, limit=len(fill) - 1, requester=req.requester)
            req.computed = req.lease.hit
            if req.cached_tokens is None:  # at first admission, as vLLM's prefill stats
                req.cached_tokens = min(req.lease.hit, len(req.prompt))
            if not self._allocate(req, new):
                raise RuntimeError(f"request {req.id}: admitted but its blocks are not free")
            self.running.append(req)
            decodes.append(False)
            entries.append(self._scheduled(req, new))
            budget -= new
        # a step of decodes only (running requests feeding their last token) is a decode step;
        # one with a prefill chunk or an admission is a prefill step (mixed ones included)
        batch = Batch("decode" if all(decodes) else "prefill", entries) if entries else None
        attach_groups(batch, self.decode_groups)
        if self.check_invariants:
            self.cache.check_invariants(self.leases())
        return batch

    @staticmethod
    def _chunk(todo: int, threshold: int, budget: int | None) -> int:
        """Tokens a request takes this step: capped at ``long_prefill_token_threshold`` (when
        active) and at the budget left."""
        if 0 < threshold < todo:
            todo = threshold
        return todo if budget is None else min(todo, budget)

    def _admissible(self, fill_len: int, hit: int, idle: int, new: int) -> bool:
        """``allocate_slots`` for a waiting request: the blocks beyond its hit (for its whole fill
        with ``scheduler_reserve_full_isl``, then for ``hit + new``) plus its hit blocks that sit
        in the free queue must all be free."""
        free = self.cache.free_blocks
        if free is None:
            return True
        b = self.block_size
        hit_blocks = hit // b
        ends = ([fill_len] if self.config.scheduler_reserve_full_isl else []) + [hit + new]
        return all(max(-(-end // b) - hit_blocks, 0) + idle <= free for end in ends)

    def _allocate(self, req: Req, new: int) -> bool:
        """``allocate_slots`` for ``new`` more tokens: the blocks they need from the free queue
        (evicting the hashes of cached ones popped), then ``cache_blocks``: every block now full
        of scheduled tokens gets its hash. False, changing nothing, if too few blocks are free."""
        evicted = self.cache.extend(req.lease, new)
        if evicted is None:
            return False
        req.evicted_tokens += evicted
        self.cache.commit(req.lease, req.fill()[: req.computed + new])
        return True

    def _scheduled(self, req: Req, new: int, draft: np.ndarray | None = None) -> BatchEntry:
        """The step's entry for ``req`` (``draft``: the drafts it verifies); its computed tokens
        advance now (``_update_after_schedule``)."""
        context = req.computed
        entry = BatchEntry(req, context, new, produces_token=context + new >= req.fill_len,
                           draft=draft).bind()
        req.computed += new
        return entry

    def _preempt(self, req: Req) -> None:
        """``_preempt_request``: free its blocks (last first), recompute from scratch, front of
        the queue."""
        self.cache.release(req.lease, req.fill(), insert=False)
        req.lease, req.computed = None, 0
        self._drafts.pop(id(req), None)
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ results in
    def complete(self, batch: Batch, tokens: list[int | None], now: float) -> list[Req]:
        """``update_from_output``: append each produced token; free finished requests in the
        step's order. Returns them."""
        finished = []
        for entry, token in zip(batch.entries, tokens):
            req = entry.req
            if req.finished or entry.gen != req.preemptions or not entry.produces_token:
                continue
            if entry.draft is not None:  # computed rolls back by the rejected drafts
                done = self.spec.apply(req, entry, token, now)
            else:
                done = req.take_token(token, now)  # check_stop: its length, or a stop token
            if done:
                self._finish(req, now)
                finished.append(req)
            elif self.spec is not None:  # update_draft_token_ids
                self._drafts[id(req)] = self.spec.drafts([req])[0][0]
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]  # remove_all
        if self.check_invariants:
            self.cache.check_invariants(self.leases())
        return finished

    def _finish(self, req: Req, now: float) -> None:
        """``_free_request``: its blocks go back; those hashed stay cached (hashed already when
        they filled, so nothing new is inserted here; with drafts, blocks that accepted drafts
        filled in the last step stay unhashed: only ``allocate_slots`` hashes)."""
        committed = req.computed if self.spec is None else req.lease.cached
        released = self.cache.release(req.lease, req.fill()[:committed], insert=True)
        req.inserted = released.inserted
        req.lease = None
        req.finish_s = now

    # ------------------------------------------------------------------ aborts
    def abort(self, req: Req, now: float) -> bool:
        """``finish_requests(..., FINISHED_ABORTED)`` (a client went away): it leaves the running
        list or the queue and its blocks are freed as at finish (``_free_request``); those
        already hashed stay cached. Call it between steps. Returns False when it had already
        finished."""
        if req.finished:
            return False
        if req.lease is not None:
            self._finish(req, now)
        self.running = [r for r in self.running if r is not req]
        self.waiting = deque(r for r in self.waiting if r is not req)
        self._drafts.pop(id(req), None)
        req.aborted = True
        req.finish_s = now
        return True

    # ------------------------------------------------------------------ checks
    def leases(self) -> list[Lease]:
        return [r.lease for r in self.running if r.lease is not None]

    def check_drained(self) -> None:
        """At the end of a run: every request finished, no lease held, nothing protected."""
        left = [r.id for r in [*self.waiting, *self.running] if not r.finished]
        assert not left, f"requests left unfinished: {left[:5]}"
        assert self.cache.protected_size == 0, \
            f"{self.cache.protected_size} tokens still protected in the cache at the end"
        self.cache.check_invariants()
