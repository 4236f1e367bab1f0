"""The reuse planner: which prompt positions past the exact hit take KV from elsewhere.

The scheduler calls it at the points of a request's life where reuse beyond exact prefixes acts
(docs/design.md §4 "Reuse beyond exact prefixes"); with ``cache.reuse=prefix`` and
``cache.match=exact`` the scheduler has none and nothing here runs.

- `plan` (admission, once the exact hit ``h`` is locked): ``blend`` looks each chunk of the prompt
  that ends past ``h`` up as a chunk (`testbed.cache.chunks`), ``semantic`` aligns the prompt with
  the most similar indexed sequence (`testbed.cache.similarity`, `difflib`); each reused run is a
  `ReusedSpan` whose donor path is locked until the prefill has run (`release`).
- `attach` gives a prefill entry the spans inside its positions (cut at chunk boundaries).
- `stores` (blend): when a request's prefill completes in a step, its chunks not cached yet are
  stored, each a `KVCopy` the step carries (``Batch.kv_copies``).
- `exact_len`: the exact tree takes a sequence only up to its first approximate position;
  `inserted` indexes what it took (semantic).

The last fill token is never reused: one token must be computed to produce the next one.
"""

from __future__ import annotations

from difflib import SequenceMatcher

import numpy as np

from testbed.cache.chunks import find_chunk, store_chunk
from testbed.cache.radix import RadixCache, TreeNode
from testbed.cache.reuse import KVCopy, ReuseConfig, ReusedSpan, recompute_count
from testbed.cache.similarity import MinHashIndex
from testbed.scheduler.batch import BatchEntry
from testbed.scheduler.request_state import Req, ReusePlan
from testbed.workloads.request import OutputRef, Request


def chunk_bounds(request: Request, prompt_len: int, fixed: int | None) -> list[tuple[int, int]]:
    """The prompt's chunks as (start, end): fixed ``N``-token runs, or its literal segments.
    A prompt without segments is one chunk; after the first `OutputRef` (whose length the
    request does not record) the rest of the prompt is one chunk."""
    if fixed is not None:
        return [(s, min(s + fixed, prompt_len)) for s in range(0, prompt_len, fixed)]
    out, at = [], 0
    for seg in request.segments or ():
        if isinstance(seg, OutputRef):
            break
        if len(seg):
            out.append((at, at + len(seg)))
            at += len(seg)
    if at < prompt_len:
        out.append((at, prompt_len))
    return out


class ReusePlanner:
    def __init__(self, cache: RadixCache, config: ReuseConfig) -> None:
        if not isinstance(cache, RadixCache):
            raise ValueError(f"cache.reuse / cache.match beyond exact prefixes need cache=radix, "
                             f"got cache={cache.name}")
        self.cache, self.config = cache, config
        self.index = MinHashIndex() if config.match == "semantic" else None

    # ------------------------------------------------------------------ admission
    def plan(self, req: Req, hit: int) -> ReusePlan:
        """Plan the reuse of the fill's positions ``hit ..`` and lock the donors; sets
        ``req.reuse_plan``."""
        fill = req.fill()
        limit = len(fill) - 1
        plan = ReusePlan()
        if hit < limit:
            if self.config.reuse == "blend":
                self._plan_chunks(req, fill, hit, limit, plan)
            elif self.index is not None:
                self._plan_semantic(req, fill, hit, limit, plan)
        req.reuse_plan = plan
        return plan

    def _plan_chunks(self, req: Req, fill: np.ndarray, hit: int, limit: int,
                     plan: ReusePlan) -> None:
        ratio = self.config.recompute_ratio
        spans = []
        for s, e in chunk_bounds(req.request, len(req.prompt), self.config.fixed_chunk):
            if min(e, limit) <= hit:
                continue
            found, node, slots = find_chunk(self.cache, fill[s:e], req.requester)
            a, b = max(hit - s, 0), min(found, limit - s)  # chunk offsets reused
            if b <= a:
                continue
            self.cache.lock(node)
            plan.donors.append(node)
            spans.append(ReusedSpan(s + a, slots[a:b].copy(), a, recompute_count(b - a, ratio)))
        plan.spans = tuple(spans)

    def _plan_semantic(self, req: Req, fill: np.ndarray, hit: int, limit: int,
                       plan: ReusePlan) -> None:
        query = fill[:limit]
        for _, key, donor in self.index.best(query, self.config.similarity_threshold,
                                             exclude=req.id):
            cached, node, slots = self.cache.match_prefix(donor, req.requester)
            if cached == 0:
                self.index.remove(key)  # evicted: it falls out now
                continue
            spans = self._aligned(query.tolist(), donor[:cached].tolist(), slots, hit)
            if spans:
                self.cache.lock(node)
                plan.donors.append(node)
                plan.spans = tuple(spans)
            return

    def _aligned(self, query: list[int], donor: list[int], slots: np.ndarray,
                 hit: int) -> list[ReusedSpan]:
        """The runs the edit-distance alignment of ``query`` and ``donor`` matches, after
        ``hit``, as spans at the donor's positions."""
        ratio = self.config.recompute_ratio
        spans = []
        blocks = SequenceMatcher(None, query, donor, autojunk=False).get_matching_blocks()
        for a, b, size in blocks:
            cut = max(hit - a, 0)
            if size - cut <= 0:
                continue
            a, b, size = a + cut, b + cut, size - cut
            spans.append(ReusedSpan(a, slots[b : b + size].copy(), b,
                                    recompute_count(size, ratio)))
        return spans

    # ------------------------------------------------------------------ batches
    @staticmethod
    def attach(entry: BatchEntry) -> None:
        """The entry's pieces of its request's spans (positions ``context .. context+new``)."""
        plan = entry.req.reuse_plan
        if plan is None or not plan.spans:
            return
        lo, hi = entry.context, entry.context + entry.new
        pieces = (s.piece(lo, hi) for s in plan.spans)
        entry.reuse = tuple(p for p in pieces if p is not None)

    def stores(self, entries: list[BatchEntry]) -> list[KVCopy]:
        """Blend: the chunk stores of the entries whose prefill completes in this step, as
        copies from the request's slots (run after the step's forward pass). Tokens evicted for
        them count as the request's."""
        if self.config.reuse != "blend":
            return []
        copies = []
        for entry in entries:
            req = entry.req
            if entry.context + entry.new != req.fill_len:
                continue
            slots = entry.kv_slots()
            for s, e in chunk_bounds(req.request, len(req.prompt), self.config.fixed_chunk):
                copy, evicted = store_chunk(self.cache, req.prompt[s:e], slots[s:e], s,
                                            req.requester)
                req.evicted_tokens += evicted
                if copy is not None:
                    copies.append(copy)
        return copies

    # ------------------------------------------------------------------ the exact tree
    @staticmethod
    def exact_len(req: Req, n: int) -> int:
        """Of the fill's first ``n`` tokens, how many the exact tree may take: those before the
        first approximate one."""
        until = req.reuse_plan.exact_until if req.reuse_plan is not None else None
        return n if until is None else min(n, until)

    def inserted(self, req: Req, tokens: np.ndarray) -> None:
        """The exact tree took ``tokens`` for ``req``: index them (semantic)."""
        if self.index is not None and len(tokens):
            self.index.add(req.id, tokens)

    def release(self, req: Req) -> None:
        """Unlock the request's donors (its prefill has run, or it was retracted)."""
        plan = req.reuse_plan
        if plan is None:
            return
        for node in plan.donors:
            self.cache.unlock(node)
        plan.donors = []
