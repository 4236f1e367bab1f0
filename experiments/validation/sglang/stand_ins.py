"""Stand-ins for SGLang 0.5.23's request, KV record and memory pools, for `sglang_mirror523`.

0.5.23's ``schedule_batch.Req`` and ``ReqKvInfo`` carry every feature's state (LoRA, mamba, SWA,
HiCache, dLLM, ...); what its SchedulePolicy, PrefillAdder, RadixCache and ``mem_cache/common.py``
read and write for a plain generation request without logprobs, page size 1, is kept here, each
method citing the one it mirrors. The KV allocator subclasses 0.5.23's own
``BaseTokenToKVPoolAllocator`` (its prefill budget, eviction for allocation and decode check are
the wheel's) around a free list; the req-to-token pool is a tensor of rows.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import torch


@dataclass
class KvRecord:
    """``ReqKvInfo``: the request's row in the req-to-token pool and how much of it is whose."""

    req_pool_idx: int | None = None
    cache_protected_len: int = 0  # tree-owned prefix of the row (not this request's to free)
    cache_inserted_len: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    swa_evict_floor: int = 0
    holds_mamba: bool = False
    retraction_backup: None = None
    is_kv_released: bool = True

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None

    def mark_kv_released(self) -> None:
        self.req_pool_idx, self.is_kv_released = None, True

    def get_evicted_seqlen(self, component) -> int:
        return 0  # no sliding window

    def swa_dead_lo(self, page_size: int) -> int:
        return 0


class SglReq523:
    """``schedule_batch.Req`` for a request whose outputs are forced (each step produces its
    predetermined token; it stops after the last, by length)."""

    def __init__(self, rid: str, prompt: list[int], outputs: list[int]) -> None:
        self.rid = rid
        self.origin_input_ids = array("q", prompt)
        self.forced = outputs
        self.output_ids = array("q")
        self.full_untruncated_fill_ids = self.origin_input_ids
        self.sampling_params = SimpleNamespace(max_new_tokens=len(outputs), ignore_eos=False)
        self.extra_key = self.cache_salt = self.priority = None
        self.return_logprob, self.logprob_start_len = False, -1
        self.dllm_config = self.positional_embed_overrides = self.session = None
        self.multimodal_inputs = self.beam_group = self.lock = None
        self.skip_radix_cache_insert = False
        self.kv = KvRecord()
        self.prefix_len, self.extend_end = 0, None
        self.last_node = self.last_host_node = self.best_match_node = None
        self.host_hit_length = self.swa_host_hit_length = self.mamba_host_hit_length = 0
        self.auxiliary_swa_host_hit_length = self.storage_hit_length = 0
        self.storage_hit_start, self.host_hit_is_storage = 0, False
        self.num_matched_prefix_tokens = 0
        self.swa_branching_seqlen = self.mamba_branching_seqlen = None
        self.cache_request_handle = None
        self.retracted_stain = self.is_retracted = False
        self.inflight_middle_chunks = 0
        self.arrival_processed_tokens = 0
        self.time_stats = SimpleNamespace(wait_queue_entry_time=0.0)
        self.done = False
        self.first_hit: int | None = None  # prefix_len at its first prepare_for_extend

    # -- Req's methods the wheel's code calls
    def is_dllm(self) -> bool:
        return False

    def needs_host_load_back(self) -> bool:
        return False

    def materialized_host_hit_len(self) -> int:
        return 0

    def fulfilled_storage_hit_len(self, prefix_len: int) -> int:
        return 0

    @property
    def extend_len(self) -> int:
        return self.extend_end - self.prefix_len

    def finished(self) -> bool:
        return self.done

    def refresh_fill_ids(self) -> None:
        """Req.refresh_fill_ids: the fill is the prompt plus the outputs so far."""
        self.full_untruncated_fill_ids = self.origin_input_ids + self.output_ids

    def _compute_max_prefix_len(self, input_len: int) -> int:
        return max(input_len - 1, 0)  # Req._compute_max_prefix_len without logprobs or dLLM

    def init_next_round_input(self, tree_cache=None, match_kv_cache=None) -> None:
        """Req.init_next_round_input: refresh the fill; with a cache, match all of it but its
        last token (``match_kv_cache``) and protect the matched prefix."""
        self.refresh_fill_ids()
        if tree_cache is not None:
            match_kv_cache(self, tree_cache, self.full_untruncated_fill_ids,
                           max_prefix_len=self._compute_max_prefix_len(
                               len(self.full_untruncated_fill_ids)))
            self.kv.cache_protected_len = self.prefix_len

    def owned_kv_len(self) -> int:
        """Req.owned_kv_len (no stop before the committed tokens): all committed KV."""
        return self.kv.kv_committed_len

    def next_token(self) -> int:
        n = len(self.output_ids)
        return self.forced[n] if n < len(self.forced) else 0  # max_new_tokens=0 samples one

    def update_finish_state(self) -> None:
        """Req.update_finish_state, the length rule only (no EOS among forced tokens)."""
        self.done = self.done or len(self.output_ids) >= self.sampling_params.max_new_tokens

    def reset_for_retract(self) -> None:
        """Req.reset_for_retract: the prefix, lock and row are gone; outputs are kept (the
        request re-prefills them)."""
        self.prefix_len, self.last_node, self.lock, self.extend_end = 0, None, None, None
        self.kv.cache_protected_len = self.kv.cache_inserted_len = 0
        self.kv.kv_committed_len = 0
        self.num_matched_prefix_tokens = self.inflight_middle_chunks = 0
        self.is_retracted = self.retracted_stain = True


class ReqRows:
    """``memory_pool.ReqToTokenPool``: ``size`` rows of KV slot ids."""

    def __init__(self, size: int, width: int) -> None:
        self.req_to_token = torch.zeros((size, width), dtype=torch.int64)
        self.free_rows = list(range(size))

    def available_size(self) -> int:
        return len(self.free_rows)

    def alloc(self, reqs: list[SglReq523]) -> list[int] | None:
        """ReqToTokenPool.alloc: a new row for each request without one."""
        need = [r for r in reqs if r.kv.req_pool_idx is None]
        if len(need) > len(self.free_rows):
            return None
        for r in need:
            r.kv.req_pool_idx, r.kv.is_kv_released = self.free_rows.pop(0), False
        return [r.kv.req_pool_idx for r in reqs]

    def write(self, key, values) -> None:
        idx, cols = key
        self.req_to_token[idx, cols] = torch.as_tensor(values, dtype=torch.int64)

    def free(self, req: SglReq523) -> None:
        self.free_rows.append(req.kv.req_pool_idx)


def slot_allocator(sgl, size: int):
    """A ``TokenToKVPoolAllocator`` at page size 1 of ``size`` slots (1..size; 0 is SGLang's
    padding slot), handed out from the front of a free list, freed ones appended; everything
    else is 0.5.23's ``BaseTokenToKVPoolAllocator``."""
    base = sgl.allocator_base.BaseTokenToKVPoolAllocator

    class FreeSlots(base):
        def __init__(self) -> None:
            base.__init__(self, size, 1, torch.int64, "cpu", None, False)
            self.free_slots = deque(range(1, size + 1))

        def available_size(self) -> int:
            return len(self.free_slots)

        def alloc(self, need_size: int) -> torch.Tensor | None:
            if need_size > len(self.free_slots):
                return None
            return torch.tensor([self.free_slots.popleft() for _ in range(need_size)],
                                dtype=torch.int64)

        def free(self, free_index) -> None:
            self.free_slots.extend(torch.as_tensor(free_index).reshape(-1).tolist())

        def free_full(self, free_index) -> None:
            self.free(free_index)

        def clear(self) -> None:
            self.free_slots = deque(range(1, size + 1))

    return FreeSlots()
