"""SGLang 0.5.23's non-overlap event loop around its own scheduling objects.

`SglangLoop523` replays ``Scheduler.event_loop_normal`` (no overlap, one GPU, page size 1,
non-disaggregated; no mixed chunk, LoRA, HiCache, speculative decoding, grammar, priority
scheduling, prefill delayer or dynamic chunking: the default server's settings) around 0.5.23's
``SchedulePolicy`` and ``PrefillAdder`` (``managers/schedule_policy.py``, with the real
``PrefillBudget``), ``RadixCache`` (``checkpoint``, ``evict``, locks) and ``mem_cache/common.py``
(``match_kv_cache``, ``checkpoint_kv_cache``, ``release_kv_cache``, ``evict_from_tree_cache``), as
`sglang_wheel523` loads them. Re-implemented, each function citing the one it mirrors: the
``Scheduler`` (``get_next_batch_to_run``, ``_get_new_batch_prefill_raw``,
``update_running_batch``), ``ScheduleBatch``'s bookkeeping (``filter_batch``, ``merge_batch``,
``prepare_for_extend`` with ``alloc_for_extend``, ``prepare_for_decode``, ``retract_decode``,
``release_req``), the result processing (``process_batch_result_prefill/decode``) and, in
`sglang_req523`, ``Req`` and the pools. The server arguments that matter: ``max_running_requests``
(``pp_max_micro_batch_size`` and the req-to-token pool's rows), ``max_prefill_tokens``,
``chunked_prefill_size``, ``schedule_policy``, ``schedule_conservativeness`` 1.0 and the
environment's defaults (``SGLANG_INIT_NEW_TOKEN_RATIO`` 0.7, ``..._MIN_NEW_TOKEN_RATIO_FACTOR``
0.14, ``..._NEW_TOKEN_RATIO_DECAY_STEPS`` 600, ``SGLANG_RETRACT_DECODE_STEPS`` 20,
``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION`` 4096).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from experiments.validation.sglang.loop import SglangLoop
from experiments.validation.sglang.stand_ins import ReqRows, SglReq523, slot_allocator


class SglBatch523:
    """What the loop keeps of a ``ScheduleBatch``: its requests, mode and two flags."""

    def __init__(self, kind: str, reqs: list[SglReq523],
                 chunked_req: SglReq523 | None = None) -> None:
        self.kind, self.reqs, self.chunked_req = kind, reqs, chunked_req
        self.batch_is_full = False

    def filter_batch(self, exclude=()) -> None:
        """ScheduleBatch.filter_batch: keep the unfinished requests not excluded, in order."""
        self.reqs = [r for r in self.reqs if not r.finished() and r not in exclude]


class SglangLoop523:
    """``Scheduler.event_loop_normal`` of 0.5.23 over its SchedulePolicy, PrefillAdder and
    RadixCache."""

    def __init__(self, sgl: SimpleNamespace, policy: str, capacity: int, max_running: int,
                 max_prefill_tokens: int, chunked_prefill_size: int | None, width: int) -> None:
        self.sgl, self.capacity = sgl, capacity
        self.alloc = slot_allocator(sgl, capacity)
        self.rows = ReqRows(max_running, width)
        params = sgl.params.CacheInitParams(disable=False, req_to_token_pool=self.rows,
                                            token_to_kv_pool_allocator=self.alloc, page_size=1)
        self.tree_cache = sgl.radix.RadixCache(params)
        self.policy = sgl.policy.SchedulePolicy(policy, self.tree_cache, False, False, True)
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        envs = sgl.environ.envs  # NewTokenRatioTracker.from_config, conservativeness 1.0
        self.init_ratio = min(envs.SGLANG_INIT_NEW_TOKEN_RATIO.get(), 1.0)
        self.min_ratio = min(self.init_ratio * envs.SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR.get(), 1.0)
        self.ratio_decay = ((self.init_ratio - self.min_ratio)
                            / envs.SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS.get())
        self.retract_steps = envs.SGLANG_RETRACT_DECODE_STEPS.get()
        self.new_token_ratio = self.init_ratio
        self.processed_tokens = 0
        self.waiting: list[SglReq523] = []
        self.running = SglBatch523("decode", [])
        self.chunked_req: SglReq523 | None = None
        self.last_batch: SglBatch523 | None = None
        self.steps: list[tuple[str, frozenset]] = []
        self.retractions = 0
        self.stuck = False

    run = SglangLoop.run  # event_loop_normal is the same loop in both releases

    def check_memory(self) -> None:
        """Scheduler.check_memory: when idle, every KV slot is free or cached and unlocked."""
        free, cached = self.alloc.available_size(), self.tree_cache.evictable_size()
        if free + cached != self.capacity or self.rows.available_size() != self.max_running:
            raise RuntimeError(f"SGLang loop leaked memory: {free=} + {cached=} != {self.capacity}")

    def next_batch(self) -> SglBatch523 | None:
        """Scheduler.get_next_batch_to_run: checkpoint the chunked request, merge the last
        prefill batch, drop the running batch's finished requests, prefill if possible,
        otherwise decode."""
        exclude = []
        if self.chunked_req is not None:
            exclude.append(self.chunked_req)
            if self.chunked_req.extend_end > self.chunked_req.prefix_len:
                self.sgl.common.checkpoint_kv_cache(self.chunked_req, self.tree_cache)
        last, running = self.last_batch, self.running
        if last is not None and last.kind == "prefill":
            if last.chunked_req is not None:
                exclude.append(last.chunked_req)
            last_bs = len(last.reqs)
            last.filter_batch(exclude)
            if len(last.reqs) < last_bs:
                running.batch_is_full = False
            if last.reqs and last is not running:
                if not running.reqs:
                    running = last  # the prefill batch object becomes the running batch
                else:
                    running.reqs.extend(last.reqs)  # ScheduleBatch.merge_batch
        running_bs = len(running.reqs)
        running.filter_batch()
        if len(running.reqs) < running_bs:
            running.batch_is_full = False
        self.running = running
        batch = self.new_prefill()
        if batch is not None:
            return batch
        if self.running.reqs:
            decode = self.update_running(self.running)
            return decode if decode is not None and decode.reqs else None
        return None

    def allocatable(self, running_bs: int, held_rows: int = 0) -> int:
        """Scheduler.get_num_allocatable_reqs (pp_size 1, no beams)."""
        return min(self.max_running - running_bs,
                   max(self.rows.available_size() + held_rows, 0))

    def new_prefill(self) -> SglBatch523 | None:
        """Scheduler._get_new_batch_prefill_raw, then ScheduleBatch.prepare_for_extend."""
        running, result = self.running, self.sgl.policy.AddReqResult
        if not running.reqs:
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting) and self.chunked_req is None:
            return None
        running_bs = len(running.reqs)
        if self.allocatable(running_bs) <= 0 and self.chunked_req is None:
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
        if not adder.can_run_list:
            return None
        admitted = set(adder.can_run_list)
        self.waiting = [r for r in self.waiting if r not in admitted]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = SglBatch523("prefill", adder.can_run_list, self.chunked_req)
        self.prepare_for_extend(batch)
        return batch

    def prepare_for_extend(self, batch: SglBatch523) -> None:
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
        self.sgl.common.evict_from_tree_cache(self.tree_cache, total)
        slots = self.alloc.alloc(total)
        if slots is None:
            raise RuntimeError(f"SGLang would run out of memory allocating {total} tokens")
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

    def update_running(self, batch: SglBatch523) -> SglBatch523 | None:
        """Scheduler.update_running_batch: retract while the step does not fit
        (ScheduleBatch.check_decode_mem evicts the shortfall first), else decay the ratio;
        prepare_for_decode."""
        initial_bs = len(batch.reqs)
        batch.filter_batch()
        if not batch.reqs:
            batch.batch_is_full = False
            return batch
        if not self.decode_fits(len(batch.reqs)):
            retracted = self.retract_decode(batch)
            self.retractions += len(retracted)
            for req in retracted:  # _add_request_to_queue(is_retracted=True): to the back
                req.arrival_processed_tokens = self.processed_tokens
                self.waiting.append(req)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        if len(batch.reqs) < initial_bs:
            batch.batch_is_full = False
        if not batch.reqs:
            return batch
        batch.kind = "decode"  # prepare_for_decode: alloc_for_decode_default
        self.sgl.common.evict_from_tree_cache(self.tree_cache, len(batch.reqs))
        slots = self.alloc.alloc(len(batch.reqs))
        if slots is None:
            raise RuntimeError("SGLang would run out of memory in a decode step")
        for req, slot in zip(batch.reqs, slots):
            self.rows.write((req.kv.req_pool_idx, slice(req.kv.kv_committed_len,
                                                        req.kv.kv_committed_len + 1)), slot[None])
            req.kv.kv_allocated_len += 1
            req.kv.kv_committed_len += 1
        return batch

    def decode_fits(self, bs: int) -> bool:
        """ScheduleBatch.check_decode_mem at page size 1: one token each, after evicting the
        shortfall (BaseTokenToKVPoolAllocator.check_decode_capacity)."""
        return self.alloc.check_decode_capacity(num_tokens=bs, tree_cache=self.tree_cache)

    def retract_decode(self, batch: SglBatch523) -> list[SglReq523]:
        """ScheduleBatch.retract_decode: retract the requests with the fewest outputs (then the
        longest prompt) until the rest's next step fits; release_req frees each one's row and
        evicts for ``retract_decode_steps`` tokens per request left."""
        order = sorted(range(len(batch.reqs)), reverse=True,
                       key=lambda i: (len(batch.reqs[i].output_ids),
                                      -len(batch.reqs[i].origin_input_ids)))
        retracted, first = [], True
        while first or not self.decode_fits(len(order)):
            if len(order) == 1:
                break
            first = False
            req = batch.reqs[order.pop()]
            self.sgl.common.release_kv_cache(req, self.tree_cache, checkpoint=False)
            self.sgl.common.evict_from_tree_cache(self.tree_cache,
                                                  len(order) * self.retract_steps)
            req.reset_for_retract()
            retracted.append(req)
        if len(order) <= 1 and not self.decode_fits(len(order)):
            raise RuntimeError("SGLang would abort its last request: out of memory")
        batch.reqs = [batch.reqs[i] for i in order]  # filter_batch(keep_indices=...) reorders
        decoded = sum(len(r.output_ids) for r in batch.reqs)  # estimate_..._after_retract
        budget = sum(r.sampling_params.max_new_tokens for r in batch.reqs)
        self.new_token_ratio = min(1.0, (decoded + self.retract_steps * len(batch.reqs))
                                   / (budget + 1))
        return retracted

    def process_prefill(self, batch: SglBatch523) -> None:
        """process_batch_result_prefill: a request whose fill is done takes its token and is
        released into the tree (finished) or checkpointed (unfinished); a middle chunk only
        counts down ``inflight_middle_chunks``."""
        for req in batch.reqs:
            if req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                continue
            req.output_ids.append(req.next_token())
            req.update_finish_state()
            if req.finished():
                self.sgl.common.release_kv_cache(req, self.tree_cache, checkpoint=True)
            else:
                self.sgl.common.checkpoint_kv_cache(req, self.tree_cache)

    def process_decode(self, batch: SglBatch523) -> None:
        """process_batch_result_decode: one token each; finished requests are released into
        the tree."""
        for req in batch.reqs:
            req.output_ids.append(req.next_token())
            req.update_finish_state()
            if req.finished():
                self.sgl.common.release_kv_cache(req, self.tree_cache, checkpoint=True)
