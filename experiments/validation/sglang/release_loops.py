"""Each release's part of SGLang's event loop (`loop.Loop` holds what both releases do alike),
chosen by release in `LOOPS`: how it builds its pools, tree and policy, reads its ratio
constants, caches a request's KV, admits a prefill, allocates and retracts.
"""

from __future__ import annotations

import torch

from experiments.validation.sglang.loop import Batch, Loop
from experiments.validation.sglang.stand_ins import (FreeSlots, ReqRows, ReqToTokenPool,
                                                     slot_allocator)


class Loop0410(Loop):
    """0.4.10: the tree caches requests itself (``cache_finished_req``, ``cache_unfinished_req``);
    an allocation evicts all it asks for when short, not the shortfall."""

    chunk_counter = "is_chunked"

    def build(self, policy: str, width: int) -> None:
        self.alloc = FreeSlots(self.capacity)
        self.rows = ReqToTokenPool(width)
        self.tree_cache = self.sgl.radix.RadixCache(
            req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.alloc, page_size=1,
            disable=False)
        self.policy = self.sgl.policy.SchedulePolicy(policy, self.tree_cache, False)

    def ratio_settings(self) -> tuple[float, float, int, int]:
        gc = self.sgl.global_config
        return (gc.default_init_new_token_ratio, gc.default_min_new_token_ratio_factor,
                gc.default_new_token_ratio_decay_steps, gc.retract_decode_steps)

    def rows_held(self) -> bool:
        return bool(self.rows.rows)

    def cache_chunked(self, req) -> None:
        self.tree_cache.cache_unfinished_req(req)
        self.rows.free(req.req_pool_idx)

    def cache_finished(self, req) -> None:
        self.tree_cache.cache_finished_req(req)

    def cache_unfinished(self, req) -> None:
        self.tree_cache.cache_unfinished_req(req)

    def new_prefill(self) -> Batch | None:
        """Scheduler.get_new_batch_prefill."""
        running = self.running
        if (running.batch_is_full or not self.waiting) and self.chunked_req is None:
            return None
        allocatable = self.max_running - len(running.reqs)  # get_num_allocatable_reqs
        if allocatable <= 0 and self.chunked_req is None:
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
        return self.prefill_batch(adder)

    def prepare_for_extend(self, batch: Batch) -> None:
        """ScheduleBatch.prepare_for_extend: a req-pool row per request holding its prefix, then
        one allocation for all new tokens (alloc_token_slots)."""
        for req, idx in zip(batch.reqs, self.rows.alloc(len(batch.reqs))):
            req.req_pool_idx = idx
            pre = len(req.prefix_indices)
            assert len(req.fill_ids) - pre == req.extend_input_len
            if pre:
                self.rows.write((idx, slice(0, pre)), req.prefix_indices)
            if req.first_hit is None:
                req.first_hit = pre
        slots = self.alloc_slots(sum(r.extend_input_len for r in batch.reqs))
        at = 0
        for req in batch.reqs:
            pre, n = len(req.prefix_indices), req.extend_input_len
            self.rows.write((req.req_pool_idx, slice(pre, pre + n)), slots[at : at + n])
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

    def decode_fits(self, bs: int) -> bool:
        """check_decode_mem: one token each, after evicting ``bs`` tokens when short."""
        if self.alloc.available_size() < bs:
            self.tree_cache.evict(bs)
        return self.alloc.available_size() >= bs

    def prepare_for_decode(self, batch: Batch) -> None:
        """ScheduleBatch.prepare_for_decode: a slot each, after its KV."""
        for req, slot in zip(batch.reqs, self.alloc_slots(len(batch.reqs))):
            self.rows.write((req.req_pool_idx, slice(req.kv_len, req.kv_len + 1)), slot[None])
            req.kv_len += 1

    def must_retract(self, left: int) -> bool:
        return self.alloc.available_size() < left * self.retract_steps

    def check_last_request(self) -> None:
        if self.alloc.available_size() <= 0:
            raise RuntimeError("SGLang would fail its 'no space left for only one request' "
                               "assert")

    def release_retracted(self, req, need: int) -> None:
        """Free the request's uncached slots and row, unlock its prefix, evict ``need`` when
        short."""
        uncached = slice(len(req.prefix_indices), req.kv_len)
        self.alloc.free(self.rows[req.req_pool_idx, uncached])
        self.rows.free(req.req_pool_idx)
        self.tree_cache.dec_lock_ref(req.last_node)
        if self.alloc.available_size() < need:
            self.tree_cache.evict(need)


class Loop0523(Loop):
    """0.5.23: requests are matched, checkpointed and released through ``mem_cache/common.py``;
    an allocation evicts the shortfall; rows are a bounded pool."""

    filter_running_first = True
    ratio_budget_pad = 1  # estimate_new_token_ratio_after_retract
    chunk_counter = "inflight_middle_chunks"

    def build(self, policy: str, width: int) -> None:
        self.alloc = slot_allocator(self.sgl, self.capacity)
        self.rows = ReqRows(self.max_running, width)
        params = self.sgl.params.CacheInitParams(
            disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.alloc,
            page_size=1)
        self.tree_cache = self.sgl.radix.RadixCache(params)
        self.policy = self.sgl.policy.SchedulePolicy(policy, self.tree_cache, False, False, True)

    def ratio_settings(self) -> tuple[float, float, int, int]:
        envs = self.sgl.environ.envs  # NewTokenRatioTracker.from_config
        return (envs.SGLANG_INIT_NEW_TOKEN_RATIO.get(),
                envs.SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR.get(),
                envs.SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS.get(),
                envs.SGLANG_RETRACT_DECODE_STEPS.get())

    def rows_held(self) -> bool:
        return self.rows.available_size() != self.max_running

    def cache_chunked(self, req) -> None:
        if req.extend_end > req.prefix_len:
            self.sgl.common.checkpoint_kv_cache(req, self.tree_cache)

    def cache_finished(self, req) -> None:
        self.sgl.common.release_kv_cache(req, self.tree_cache, checkpoint=True)

    def cache_unfinished(self, req) -> None:
        self.sgl.common.checkpoint_kv_cache(req, self.tree_cache)

    def allocatable(self, running_bs: int, held_rows: int = 0) -> int:
        """Scheduler.get_num_allocatable_reqs (pp_size 1, no beams)."""
        return min(self.max_running - running_bs,
                   max(self.rows.available_size() + held_rows, 0))

    def new_prefill(self) -> Batch | None:
        """Scheduler._get_new_batch_prefill_raw."""
        running, result = self.running, self.sgl.policy.AddReqResult
        if not running.reqs:
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting) and self.chunked_req is None:
            return None
        if self.allocatable(len(running.reqs)) <= 0 and self.chunked_req is None:
            running.batch_is_full = True
            return None
        self.policy.calc_priority(self.waiting, running, processed_tokens=self.processed_tokens)
        adder = self.sgl.policy.PrefillAdder(
            1, self.tree_cache, self.alloc, running, self.new_token_ratio,
            self.max_prefill_tokens, self.chunked_prefill_size, 0, 0,
            max_running_requests=self.max_running, waiting_queue_len=len(self.waiting))
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            adder.chunked_req_limit = self.policy.shortest_prefill_chunk_limit(
                self.chunked_req, self.waiting, adder.rem_chunk_tokens or 0, 1)
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting:
            if adder.budget_state() == result.OTHER:
                break
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= self.allocatable(len(running.reqs), held):
                running.batch_is_full = True
            if running.batch_is_full:
                break
            req.init_next_round_input(self.tree_cache, self.sgl.common.match_kv_cache)
            res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None,
                                    truncation_align_size=None)
            if res != result.CONTINUE:
                if res == result.NO_TOKEN:
                    running.batch_is_full = bool(adder.can_run_list) or bool(running.reqs)
                break
        return self.prefill_batch(adder)

    def prepare_for_extend(self, batch: Batch) -> None:
        """ScheduleBatch.prepare_for_extend with alloc_for_extend: rows for requests without
        one (alloc_req_slots), then one allocation for all new tokens (alloc_token_slots,
        which evicts the shortfall), written after each request's prefix."""
        prefixes = []
        for req in batch.reqs:  # _prefix_kv_indices, before rows are handed out
            if req.kv.holds_kv:
                prefixes.append(self.rows.req_to_token[req.kv.req_pool_idx, :req.prefix_len])
            elif req.prefix_len == 0:
                prefixes.append(torch.empty(0, dtype=torch.int64))
            else:
                prefixes.append(self.tree_cache.prefix_device_indices(req))
        if self.rows.alloc(batch.reqs) is None:
            raise RuntimeError("SGLang's alloc_req_slots would run out of rows")
        total = sum(r.extend_len for r in batch.reqs)
        slots = self.alloc_slots(total)
        at = 0
        for req, prefix in zip(batch.reqs, prefixes):
            idx, pre, n = req.kv.req_pool_idx, req.prefix_len, req.extend_len
            self.rows.write((idx, slice(0, pre)), prefix)
            self.rows.write((idx, slice(pre, pre + n)), slots[at : at + n])
            req.kv.kv_allocated_len = req.kv.kv_committed_len = req.extend_end
            if req.first_hit is None:
                req.first_hit = pre
            at += n
        self.processed_tokens += total  # processed_tokens_counter (run_batch)

    def alloc_slots(self, n: int) -> torch.Tensor:
        """alloc_token_slots: evict the shortfall (evict_from_tree_cache), then allocate; out of
        memory is an error."""
        self.sgl.common.evict_from_tree_cache(self.tree_cache, n)
        slots = self.alloc.alloc(n)
        if slots is None:
            raise RuntimeError(f"SGLang would run out of memory allocating {n} tokens")
        return slots

    def decode_fits(self, bs: int) -> bool:
        """ScheduleBatch.check_decode_mem at page size 1: one token each, after evicting the
        shortfall (BaseTokenToKVPoolAllocator.check_decode_capacity)."""
        return self.alloc.check_decode_capacity(num_tokens=bs, tree_cache=self.tree_cache)

    def prepare_for_decode(self, batch: Batch) -> None:
        """ScheduleBatch.prepare_for_decode (alloc_for_decode_default): a slot each, after its
        committed KV."""
        for req, slot in zip(batch.reqs, self.alloc_slots(len(batch.reqs))):
            kv = req.kv
            self.rows.write((kv.req_pool_idx, slice(kv.kv_committed_len,
                                                    kv.kv_committed_len + 1)), slot[None])
            kv.kv_allocated_len += 1
            kv.kv_committed_len += 1

    def must_retract(self, left: int) -> bool:
        return not self.decode_fits(left)

    def check_last_request(self) -> None:
        if not self.decode_fits(1):
            raise RuntimeError("SGLang would abort its last request: out of memory")

    def release_retracted(self, req, need: int) -> None:
        """ScheduleBatch.release_req: the request's KV back (no checkpoint), evict ``need``."""
        self.sgl.common.release_kv_cache(req, self.tree_cache, checkpoint=False)
        self.sgl.common.evict_from_tree_cache(self.tree_cache, need)


LOOPS = {"0.4.10": Loop0410, "0.5.23": Loop0523}
