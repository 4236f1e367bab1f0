"""Stand-ins for SGLang's request and memory pools, per release, for the event loop (`loop`) and
the queue check (`queues`).

``schedule_batch.Req`` carries every feature's state (0.5.23's also a ``ReqKvInfo``: LoRA,
mamba, SWA, HiCache, dLLM, ...); each release's stand-in keeps what that release's
SchedulePolicy, PrefillAdder and RadixCache (and 0.5.23's ``mem_cache/common.py``) read and write
for a plain generation request without logprobs whose outputs are forced, page size 1, each
method citing the one it mirrors: `Req0410`, `Req0523` (with `KvRecord`); what they share is
`ForcedReq`. The pools: 0.4.10's token-to-KV allocator (Triton) is a free list (`FreeSlots`) and
its req-to-token pool a dict of rows (`ReqToTokenPool`); 0.5.23's allocator subclasses the wheel's
own ``BaseTokenToKVPoolAllocator`` (its prefill budget, eviction for allocation and decode check
are the wheel's) around a free list (`slot_allocator`), its req-to-token pool a tensor of rows
(`ReqRows`).
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import torch


class ForcedReq:
    """What both releases' ``Req`` stand-ins share: each step produces the request's
    predetermined token, and it stops after the last, by length."""

    def __init__(self, rid: str, outputs: list[int]) -> None:
        self.rid = rid
        self.forced = outputs  # the token each step produces, in order
        self.sampling_params = SimpleNamespace(max_new_tokens=len(outputs), ignore_eos=False)
        self.return_logprob = False
        self.last_node = self.last_host_node = None
        self.host_hit_length = 0
        self.done = False
        self.first_hit: int | None = None  # prefix length at its first prepare_for_extend

    def next_token(self) -> int:
        n = len(self.output_ids)
        return self.forced[n] if n < len(self.forced) else 0  # max_new_tokens=0 still samples one

    def finished(self) -> bool:
        return self.done

    def finish_by_length(self) -> None:
        """Req.check_finished (0.4.10), Req.update_finish_state (0.5.23): the length rule only
        (no EOS among forced tokens)."""
        self.done = self.done or len(self.output_ids) >= self.sampling_params.max_new_tokens


class Req0410(ForcedReq):
    """0.4.10's ``schedule_batch.Req``: the fields and methods its policy, adder and radix cache
    use."""

    def __init__(self, rid: str, prompt: list[int], outputs: list[int]) -> None:
        super().__init__(rid, outputs)
        self.origin_input_ids = prompt
        self.output_ids: list[int] = []
        self.fill_ids: list[int] = []
        self.logprob_start_len = len(prompt) - 1  # handle_generate_request, no logprobs asked
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.extend_input_len = 0
        self.is_chunked = 0
        self.req_pool_idx = None
        self.kv_len = 0  # the batch's seq_lens entry for this request

    def adjust_max_prefix_ids(self) -> list[int]:
        """Req.adjust_max_prefix_ids: the fill minus its last token (no logprobs)."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        return self.fill_ids[: max(len(self.fill_ids) - 1, 0)]

    def init_next_round_input(self, tree_cache=None) -> None:
        """Req.init_next_round_input: re-match the fill when a cache is given."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        if tree_cache is not None:
            (self.prefix_indices, self.last_node, self.last_host_node,
             self.host_hit_length) = tree_cache.match_prefix(key=self.adjust_max_prefix_ids())
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def reset_for_retract(self) -> None:
        """Req.reset_for_retract (outputs are kept: the request re-prefills them)."""
        self.prefix_indices, self.last_node, self.extend_input_len = [], None, 0


@dataclass
class KvRecord:
    """0.5.23's ``ReqKvInfo``: the request's row in the req-to-token pool and how much of it is
    whose."""

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


class Req0523(ForcedReq):
    """0.5.23's ``schedule_batch.Req``: what its policy (``calc_priority`` included), adder,
    radix cache and ``mem_cache/common.py`` read and write."""

    def __init__(self, rid: str, prompt: list[int], outputs: list[int]) -> None:
        super().__init__(rid, outputs)
        self.origin_input_ids = array("q", prompt)
        self.output_ids = array("q")
        self.full_untruncated_fill_ids = self.origin_input_ids
        self.extra_key = self.cache_salt = self.priority = None
        self.logprob_start_len = -1
        self.dllm_config = self.positional_embed_overrides = self.session = None
        self.multimodal_inputs = self.beam_group = self.lock = None
        self.skip_radix_cache_insert = False
        self.kv = KvRecord()
        self.prefix_len, self.extend_end = 0, None
        self.best_match_node = None
        self.swa_host_hit_length = self.mamba_host_hit_length = 0
        self.auxiliary_swa_host_hit_length = self.storage_hit_length = 0
        self.storage_hit_start, self.host_hit_is_storage = 0, False
        self.num_matched_prefix_tokens = 0
        self.swa_branching_seqlen = self.mamba_branching_seqlen = None
        self.cache_request_handle = None
        self.retracted_stain = self.is_retracted = False
        self.inflight_middle_chunks = 0
        self.arrival_processed_tokens = 0
        self.time_stats = SimpleNamespace(wait_queue_entry_time=0.0)
        self.finished_len = None  # no stop before the last output token

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

    def reset_for_retract(self) -> None:
        """Req.reset_for_retract: the prefix, lock and row are gone; outputs are kept (the
        request re-prefills them)."""
        self.prefix_len, self.last_node, self.lock, self.extend_end = 0, None, None, None
        self.kv.cache_protected_len = self.kv.cache_inserted_len = 0
        self.kv.kv_committed_len = 0
        self.num_matched_prefix_tokens = self.inflight_middle_chunks = 0
        self.is_retracted = self.retracted_stain = True


REQS = {"0.4.10": Req0410, "0.5.23": Req0523}


class FreeSlots:
    """0.4.10's ``TokenToKVPoolAllocator`` at page_size 1: slots 1..size (0 is SGLang's padding
    slot), handed out from the front of the free list, freed ones appended."""

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
    """0.4.10's ``memory_pool.ReqToTokenPool``: one row of KV slot ids per pool index, read as
    ``req_to_token[idx, a:b]`` and written with ``write((idx, slice), values)``."""

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


class ReqRows:
    """0.5.23's ``memory_pool.ReqToTokenPool``: ``size`` rows of KV slot ids."""

    def __init__(self, size: int, width: int) -> None:
        self.req_to_token = torch.zeros((size, width), dtype=torch.int64)
        self.free_rows = list(range(size))

    def available_size(self) -> int:
        return len(self.free_rows)

    def alloc(self, reqs: list[Req0523]) -> list[int] | None:
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

    def free(self, req: Req0523) -> None:
        self.free_rows.append(req.kv.req_pool_idx)


def slot_allocator(sgl, size: int):
    """0.5.23's ``TokenToKVPoolAllocator`` at page size 1 of ``size`` slots: `FreeSlots`'
    free list, everything else the wheel's ``BaseTokenToKVPoolAllocator``."""
    base = sgl.allocator_base.BaseTokenToKVPoolAllocator

    class Slots(FreeSlots, base):
        def __init__(self) -> None:
            base.__init__(self, size, 1, torch.int64, "cpu", None, False)
            self.free_slots = deque(range(1, size + 1))

        def free_full(self, free_index) -> None:
            self.free(free_index)

        def clear(self) -> None:
            self.free_slots = deque(range(1, size + 1))

    return Slots()
