"""SGLang 0.4.10's non-overlap event loop around its own scheduling objects.

`SglangLoop` replays ``Scheduler.event_loop_normal`` (no overlap, one GPU, ``page_size`` 1; no
mixed chunk, LoRA, HiCache, speculative decoding, grammar, disaggregation) around SGLang's
SchedulePolicy, PrefillAdder and RadixCache as `experiments.validation.sglang_wheel` loads them.
Three parts of SGLang cannot be isolated and are re-implemented, each function citing the one it
mirrors: ``Scheduler`` itself (threads, ZMQ, the TP worker), ``ScheduleBatch`` (tensors and
sampling state; only its scheduling bookkeeping is kept, `SglBatch`) and ``Req``
(`sglang_wheel.SglReq`). The token-to-KV allocator (Triton) is a free list (`FreeSlots`) and the
req-to-token pool a dict of rows (`ReqToTokenPool`).
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import torch

from experiments.validation.sglang.wheel import SglReq


class FreeSlots:
    """Stand-in for ``TokenToKVPoolAllocator`` at page_size 1: slots 1..size (0 is SGLang's
    padding slot), handed out from the front of the free list, freed ones appended."""

    page_size = 1
    device = torch.device("cpu")

    def __init__(self, size: int) -> None:
        self.free_slots = deque(range(1, size + 1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_slots):
            return None
        return torch.tensor([self.free_slots.popleft() for _ in range(n)], dtype=torch.int64)

    def free(self, indices) -> None:
        self.free_slots.extend(torch.as_tensor(indices).reshape(-1).tolist())


class ReqToTokenPool:
    """Stand-in for ``memory_pool.ReqToTokenPool``: one row of KV slot ids per pool index,
    read as ``req_to_token[idx, a:b]`` and written with ``write((idx, slice), values)``."""

    def __init__(self, width: int) -> None:
        self.width, self.rows, self.next = width, {}, 0
        self.req_to_token = self

    def alloc(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        for i in out:
            self.rows[i] = torch.zeros(self.width, dtype=torch.int64)
        return out

    def free(self, idx: int) -> None:
        del self.rows[idx]

    def __getitem__(self, key):
        idx, cols = key
        return self.rows[idx][cols]

    def write(self, key, values) -> None:
        idx, cols = key
        self.rows[idx][cols] = torch.as_tensor(values, dtype=torch.int64)


class SglBatch:
    """What the loop keeps of a ``ScheduleBatch``: its requests, mode and two flags."""

    def __init__(self, kind: str, reqs: list[SglReq], chunked_req: SglReq | None = None) -> None:
        self.kind, self.reqs, self.chunked_req = kind, reqs, chunked_req
        self.batch_is_full = False


class SglangLoop:
    """``Scheduler.event_loop_normal`` over SGLang's SchedulePolicy, PrefillAdder and RadixCache."""

    def __init__(self, sgl: SimpleNamespace, policy: str, capacity: int, max_running: int,
                 max_prefill_tokens: int, chunked_prefill_size: int | None, width: int) -> None:
        self.sgl = sgl
        self.capacity = capacity
        self.alloc = FreeSlots(capacity)
        self.req_to_token = ReqToTokenPool(width)
        self.tree_cache = sgl.radix.RadixCache(req_to_token_pool=self.req_to_token,
                                               token_to_kv_pool_allocator=self.alloc,
                                               page_size=1, disable=False)
        self.policy = sgl.policy.SchedulePolicy(policy, self.tree_cache, False)
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        gc = sgl.global_config  # Scheduler.__init__, schedule_conservativeness 1.0
        self.init_ratio = min(gc.default_init_new_token_ratio, 1.0)
        self.min_ratio = min(self.init_ratio * gc.default_min_new_token_ratio_factor, 1.0)
        self.ratio_decay = ((self.init_ratio - self.min_ratio)
                            / gc.default_new_token_ratio_decay_steps)
        self.retract_steps = gc.retract_decode_steps
        self.new_token_ratio = self.init_ratio
        self.waiting: list[SglReq] = []
        self.running = SglBatch("decode", [])
        self.chunked_req: SglReq | None = None
        self.last_batch: SglBatch | None = None
        self.steps: list[tuple[str, frozenset]] = []
        self.retractions = 0
        self.stuck = False

    def run(self, max_steps: int = 200_000) -> None:
        """Scheduler.event_loop_normal until nothing is left (or nothing can run)."""
        idle = 0
        while len(self.steps) < max_steps:
            batch = self.next_batch()
            if batch is None:
                self.check_memory()  # self_check_during_idle
                self.new_token_ratio = self.init_ratio
                self.last_batch = None
                if not (self.waiting or self.running.reqs or self.chunked_req):
                    return
                idle += 1
                if idle > 3:
                    self.stuck = True
                    return
                continue
            idle = 0
            self.steps.append((batch.kind, frozenset(r.rid for r in batch.reqs)))
            if batch.kind == "prefill":
                self.process_prefill(batch)
            else:
                self.process_decode(batch)
            self.last_batch = batch
        self.stuck = True

    def check_memory(self) -> None:
        """Scheduler.check_memory: when idle, every KV slot is free or cached and unlocked."""
        free, cached = self.alloc.available_size(), self.tree_cache.evictable_size()
        if free + cached != self.capacity or self.req_to_token.rows:
            raise RuntimeError(f"SGLang loop leaked memory: {free=} + {cached=} != {self.capacity}")

    def next_batch(self) -> SglBatch | None:
        """Scheduler.get_next_batch_to_run: merge the last prefill batch, prefill if possible,
        otherwise decode the running batch."""
        exclude = []
        if self.chunked_req:
            exclude.append(self.chunked_req)
            self.tree_cache.cache_unfinished_req(self.chunked_req)
            self.req_to_token.free(self.chunked_req.req_pool_idx)
        last = self.last_batch
        if last is not None and last.kind == "prefill":
            if last.chunked_req is not None:
                exclude.append(last.chunked_req)
            last_bs = len(last.reqs)
            last.reqs = [r for r in last.reqs if not r.finished() and r not in exclude]
            if len(last.reqs) < last_bs:
                self.running.batch_is_full = False
            if last.reqs:
                if not self.running.reqs:
                    self.running = last  # the prefill batch object becomes the running batch
                else:
                    self.running.reqs.extend(last.reqs)  # ScheduleBatch.merge_batch
        batch = self.new_prefill()
        if batch is not None:
            return batch
        if self.running.reqs:
            self.running = self.update_running(self.running)
            return self.running if self.running.reqs else None
        return None

    def new_prefill(self) -> SglBatch | None:
        """Scheduler.get_new_batch_prefill, then ScheduleBatch.prepare_for_extend."""
        running = self.running
        if (running.batch_is_full or not self.waiting) and self.chunked_req is None:
            return None
        running_bs = len(running.reqs)
        allocatable = self.max_running - running_bs  # get_num_allocatable_reqs
        if allocatable <= 0 and not self.chunked_req:
            running.batch_is_full = True
            return None
        self.policy.calc_priority(self.waiting)
        adder = self.sgl.policy.PrefillAdder(1, self.tree_cache, self.alloc, running,
                                             self.new_token_ratio, self.max_prefill_tokens,
                                             self.chunked_prefill_size, 0)
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        result = self.sgl.policy.AddReqResult
        for req in self.waiting:
            if len(adder.can_run_list) >= allocatable:
                running.batch_is_full = True
                break
            req.init_next_round_input(self.tree_cache)
            res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None)
            if res != result.CONTINUE:
                if res == result.NO_TOKEN:
                    running.batch_is_full = True
                break
        if not adder.can_run_list:
            return None
        admitted = set(adder.can_run_list)
        self.waiting = [r for r in self.waiting if r not in admitted]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req:
            self.chunked_req.is_chunked += 1
        batch = SglBatch("prefill", adder.can_run_list, self.chunked_req)
        self.prepare_for_extend(batch)
        return batch

    def prepare_for_extend(self, batch: SglBatch) -> None:
        """ScheduleBatch.prepare_for_extend: a req-pool row per request holding its prefix, then
        one allocation for all new tokens (alloc_token_slots)."""
        for req, idx in zip(batch.reqs, self.req_to_token.alloc(len(batch.reqs))):
            req.req_pool_idx = idx
            pre = len(req.prefix_indices)
            assert len(req.fill_ids) - pre == req.extend_input_len
            if pre:
                self.req_to_token.write((idx, slice(0, pre)), req.prefix_indices)
            if req.first_hit is None:
                req.first_hit = pre
        slots = self.alloc_slots(sum(r.extend_input_len for r in batch.reqs))
        at = 0
        for req in batch.reqs:
            pre, n = len(req.prefix_indices), req.extend_input_len
            self.req_to_token.write((req.req_pool_idx, slice(pre, pre + n)), slots[at : at + n])
            req.kv_len = pre + n
            at += n

    def alloc_slots(self, n: int) -> torch.Tensor:
        """ScheduleBatch.alloc_token_slots: evict ``n`` tokens (not the shortfall) when fewer than
        ``n`` are free (_evict_tree_cache_if_needed); out of memory is an error."""
        if self.alloc.available_size() < n:
            self.tree_cache.evict(n)
        slots = self.alloc.alloc(n)
        if slots is None:
            raise RuntimeError(f"SGLang would run out of memory allocating {n} tokens")
        return slots

    def update_running(self, batch: SglBatch) -> SglBatch:
        """Scheduler.update_running_batch: drop finished requests, retract if one more token each
        does not fit (ScheduleBatch.check_decode_mem), else decay the ratio; prepare_for_decode."""
        initial_bs = len(batch.reqs)
        batch.reqs = [r for r in batch.reqs if not r.finished()]
        if not batch.reqs:
            batch.batch_is_full = False
            return batch
        bs = len(batch.reqs)
        if self.alloc.available_size() < bs:  # check_decode_mem
            self.tree_cache.evict(bs)
        if self.alloc.available_size() < bs:
            retracted = self.retract_decode(batch)
            self.waiting.extend(retracted)  # _extend_requests_to_queue: to the back of the queue
            self.retractions += len(retracted)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        if len(batch.reqs) < initial_bs:
            batch.batch_is_full = False
        batch.kind = "decode"  # ScheduleBatch.prepare_for_decode
        for req, slot in zip(batch.reqs, self.alloc_slots(len(batch.reqs))):
            at = slice(req.kv_len, req.kv_len + 1)
            self.req_to_token.write((req.req_pool_idx, at), slot[None])
            req.kv_len += 1
        return batch

    def retract_decode(self, batch: SglBatch) -> list[SglReq]:
        """ScheduleBatch.retract_decode: retract the requests with the fewest outputs (then the
        longest prompt) until ``retract_decode_steps`` tokens per remaining request are free."""
        order = sorted(range(len(batch.reqs)), reverse=True,
                       key=lambda i: (len(batch.reqs[i].output_ids),
                                      -len(batch.reqs[i].origin_input_ids)))
        retracted, first = [], True
        while self.alloc.available_size() < len(order) * self.retract_steps or first:
            if len(order) == 1:
                if self.alloc.available_size() <= 0:
                    raise RuntimeError("SGLang would fail its 'no space left for only one "
                                       "request' assert")
                break
            first = False
            req = batch.reqs[order.pop()]
            retracted.append(req)
            uncached = slice(len(req.prefix_indices), req.kv_len)
            self.alloc.free(self.req_to_token[req.req_pool_idx, uncached])
            self.req_to_token.free(req.req_pool_idx)
            self.tree_cache.dec_lock_ref(req.last_node)
            need = len(order) * self.retract_steps
            if self.alloc.available_size() < need:
                self.tree_cache.evict(need)
            req.reset_for_retract()
        batch.reqs = [batch.reqs[i] for i in order]  # filter_batch(keep_indices=...) reorders
        decoded = sum(len(r.output_ids) for r in batch.reqs)
        budget = sum(r.sampling_params.max_new_tokens for r in batch.reqs)
        self.new_token_ratio = min(1.0, (decoded + self.retract_steps * len(batch.reqs)) / budget)
        return retracted

    def process_prefill(self, batch: SglBatch) -> None:
        """process_batch_result_prefill: a request whose fill is done takes its token and is
        cached (finished) or re-cached (unfinished); a chunk only counts down ``is_chunked``."""
        for req in batch.reqs:
            if req.is_chunked > 0:
                req.is_chunked -= 1
                continue
            req.output_ids.append(req.next_token())
            req.check_finished()
            if req.finished():
                self.tree_cache.cache_finished_req(req)
            else:
                self.tree_cache.cache_unfinished_req(req)

    def process_decode(self, batch: SglBatch) -> None:
        """process_batch_result_decode: one token each; finished requests are cached."""
        for req in batch.reqs:
            req.output_ids.append(req.next_token())
            req.check_finished()
            if req.finished():
                self.tree_cache.cache_finished_req(req)
