"""SGLang's own RadixCache serving requests one at a time, as its scheduler serves a lone request,
for (c) of the SGLang check (`replay`), the checkpoint fields (`checkpoint_fields`), the whole
trace (`whole_trace`) and the speed benchmark.

`serve` collapses each request into one allocation as our replay does, in list order, through
the release's own calls (`SIDES`):

- **0.4.10** (`Side0410`): ``match_prefix`` of ``Req.adjust_max_prefix_ids`` (the prompt minus
  its last token; page-aligned by ``match_prefix``), ``inc_lock_ref``
  (``PrefillAdder.add_one_req``), then ``ScheduleBatch._evict_tree_cache_if_needed`` with the
  size ``alloc_paged_token_slots_extend`` asks for (``alloc_token_slots`` at page size 1: the
  whole demand, not the shortfall), and its own ``cache_finished_req``, which caches
  prompt+output minus the last output token (that token's KV is never computed), frees the
  unaligned tail page and the duplicate prefix.
- **0.5.23** (`Side0523`): ``mem_cache/common.py:match_kv_cache`` with ``max_prefix_len`` = prompt
  length − 1 (``Req._compute_max_prefix_len``), then ``tree_cache.lock`` of the matched node
  (``PrefillAdder`` locks ``req.last_node``); ``common.evict_from_tree_cache`` with the demand of
  ``allocation.py:alloc_token_slots`` (the extend at page size 1) or
  ``alloc_paged_token_slots_extend`` (the extend plus one page per request), which asks the
  allocator's ``evict_to_free_tokens`` for the *shortfall* against its free pages;
  ``common.release_kv_cache(checkpoint=True)``, i.e. ``RadixCache.checkpoint`` up to
  ``Req.owned_kv_len`` (prompt + output − 1): ``_insert_cache(split_prompt=True)`` (insert, then
  the prompt again, page-aligned, one priority higher), ``match_prefix`` of the key, the lock
  moved; then the row's unaligned tail freed. Each of those three rules (`replay.RULES`) can be
  switched off, which feeds the tree replay.py's own calls. The check after prefill that a
  running request makes in the server (``checkpoint_kv_cache``) is left out, as 0.4.10's
  ``cache_unfinished_req``: replay makes one insert per request, and that earlier insert of the
  prompt changes no recency the final one does not refresh.

Stand-ins (not isolable): the paged allocator (`PagedSlots`: its Triton kernels need a GPU), the
req-to-token pool (`OneRow`) and, for 0.5.23, the request (`stand_ins.Req0523`, finished).
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import numpy as np
import torch

from experiments.validation.sglang.stand_ins import KvRecord, Req0523
from testbed.workloads.request import TOKEN_DTYPE, Request

RULES = ("limit", "kv", "evict")  # SGLang's serving rules that replay.py does not follow


class PagedSlots:
    """Stand-in for ``PagedTokenToKVPoolAllocator`` (``TokenToKVPoolAllocator`` at page size 1)
    without its Triton kernels, on numpy: pages ``1..num_pages`` (page 0 holds SGLang's padding
    slot), page ``p`` the slots ``p*P .. p*P+P-1``; new pages come from the front of
    ``free_pages``, freed ones go to ``release_pages`` (every page one of the given slots lies in:
    ``torch.unique(free_index // page_size)``) and are merged back, sorted, when ``free_pages``
    runs short (``merge_and_sort_free``). What 0.5.23's code also calls: the segment frees of
    ``BaseTokenToKVPoolAllocator`` (a segment starts on a page; every page it touches is freed)
    and ``evict_to_free_tokens`` (ask the tree for the shortfall only, in ``evict_params``)."""

    device = torch.device("cpu")

    def __init__(self, num_pages: int, page_size: int, evict_params: type | None = None) -> None:
        self.page_size = page_size
        self.free_pages = np.arange(1, num_pages + 1, dtype=np.int64)
        self.release_pages = np.zeros(0, dtype=np.int64)
        self.evict_params = evict_params

    def available_size(self) -> int:
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def alloc_extend(self, prefix_len: int, seq_len: int) -> torch.Tensor | None:
        """``alloc_extend`` for one request whose prefix is whole pages: the slots of tokens
        ``prefix_len .. seq_len`` in ``ceil(seq_len/P) - prefix_len/P`` new pages."""
        p = self.page_size
        pages = -(-seq_len // p) - prefix_len // p
        if pages > len(self.free_pages):
            self.free_pages = np.sort(np.concatenate([self.free_pages, self.release_pages]))
            self.release_pages = self.release_pages[:0]
        if pages > len(self.free_pages):
            return None
        firsts, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        slots = (firsts[:, None] * p + np.arange(p)).reshape(-1)[: seq_len - prefix_len]
        return torch.from_numpy(slots)

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel():
            pages = np.unique(indices.numpy() // self.page_size)
            self.release_pages = np.concatenate([pages, self.release_pages])

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        assert start_pos % self.page_size == 0, f"segment start {start_pos} is not page-aligned"
        self.free(free_index)

    def free_segments(self, segments) -> None:
        for free_index, start_pos in segments:
            self.free_segment(free_index, start_pos=start_pos)

    free_full_segments = free_segments

    def evict_to_free_tokens(self, tree_cache, num_tokens: int) -> None:
        # BaseTokenToKVPoolAllocator.evict_to_free_tokens (its sharded loop is a no-op here)
        shortfall = num_tokens - self.available_size()
        if shortfall > 0:
            tree_cache.evict_for_alloc(self.evict_params(num_tokens=shortfall))


class OneRow:
    """Stand-in for ``ReqToTokenPool`` when one request runs at a time: row 0 of a tensor,
    reused, read as ``req_to_token[0, a:b]``."""

    def __init__(self, width: int) -> None:
        self.req_to_token = torch.zeros((1, width), dtype=torch.int64)

    def write(self, index, values: torch.Tensor) -> None:
        self.req_to_token[index] = values

    def free(self, req_or_index) -> None:
        """The request is done; the row is overwritten by the next one."""


class Side0410:
    """0.4.10's calls (module docstring); it follows all of `RULES`, LRU its only order."""

    @staticmethod
    def tree(sgl, rows: OneRow, alloc: PagedSlots, page_size: int, eviction: str):
        if eviction != "lru":
            raise ValueError(f"SGLang 0.4.10's radix cache evicts by LRU only, not {eviction}")
        return sgl.radix.RadixCache(req_to_token_pool=rows, token_to_kv_pool_allocator=alloc,
                                    page_size=page_size, disable=False)

    @staticmethod
    def match(sgl, tree, request: Request, rules: tuple[str, ...]):
        prompt = request.prompt.tolist()
        match = tree.match_prefix(key=prompt[: len(prompt) - 1])  # Req.adjust_max_prefix_ids
        tree.inc_lock_ref(match.last_device_node)  # PrefillAdder.add_one_req
        return match.device_indices, (prompt, match.last_device_node)

    @staticmethod
    def evict(sgl, tree, alloc: PagedSlots, n: int, rules: tuple[str, ...]) -> None:
        need = n + (alloc.page_size if alloc.page_size > 1 else 0)  # alloc_paged_..., bs 1
        if alloc.available_size() < need:  # ScheduleBatch._evict_tree_cache_if_needed
            tree.evict(need)

    @staticmethod
    def finish(sgl, tree, request: Request, held, prefix: torch.Tensor, kv_len: int) -> None:
        prompt, last_node = held
        tree.cache_finished_req(SimpleNamespace(
            origin_input_ids=prompt, output_ids=request.output.tolist(), req_pool_idx=0,
            prefix_indices=prefix, last_node=last_node))


class Side0523:
    """0.5.23's calls (module docstring), each rule of `RULES` SGLang's only when named."""

    @staticmethod
    def tree(sgl, rows: OneRow, alloc: PagedSlots, page_size: int, eviction: str):
        alloc.evict_params = sgl.base.EvictParams
        return sgl.radix.RadixCache(sgl.params.CacheInitParams(
            disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=alloc,
            page_size=page_size, eviction_policy=eviction))

    @staticmethod
    def match(sgl, tree, request: Request, rules: tuple[str, ...]):
        req = Req0523(request.id, request.prompt.tolist(), request.output.tolist())
        req.output_ids = array("q", request.output.tolist())  # it has produced all of it
        req.done = True
        # priority: SGLang's tree keeps the higher longer, ours the lower (docs/design.md §4)
        req.priority = -request.priority or None
        req.kv = KvRecord(req_pool_idx=0, is_kv_released=False)
        prompt = req.origin_input_ids
        limit = req._compute_max_prefix_len(len(prompt)) if "limit" in rules else len(prompt)
        sgl.common.match_kv_cache(req, tree, prompt, max_prefix_len=limit)
        req.kv.cache_protected_len = req.prefix_len  # init_next_round_input
        prefix = tree.path_device_indices(req.last_node)[: req.prefix_len]
        req.lock = tree.lock(req.last_node)  # PrefillAdder
        return prefix, req

    @staticmethod
    def evict(sgl, tree, alloc: PagedSlots, n: int, rules: tuple[str, ...]) -> None:
        p = alloc.page_size
        demand = (n + (p if p > 1 else 0) if "evict" in rules
                  else -(-n // p) * p)  # (the prefix is whole pages)
        sgl.common.evict_from_tree_cache(tree, demand)

    @staticmethod
    def finish(sgl, tree, request: Request, req, prefix: torch.Tensor, kv_len: int) -> None:
        req.kv.kv_committed_len = req.kv.kv_allocated_len = kv_len
        sgl.common.release_kv_cache(req, tree, checkpoint=True)


SIDES = {"0.4.10": Side0410, "0.5.23": Side0523}


def serve(sgl, requests: list[Request], page_size: int, capacity: int | None,
          rules: tuple[str, ...] = RULES, eviction: str = "lru", strategy=None, after=None
          ) -> tuple[list[int], list[int], int, list]:
    """The loaded release's RadixCache serving ``requests`` one at a time (module docstring).
    Returns per request the hit and the tokens evicted, the tokens left in the tree and its runs
    (`sglang_runs`). ``rules``: those of `RULES` SGLang's server follows (0.5.23 only: without
    them its tree is fed replay.py's calls, the whole prompt matched, prompt + output inserted,
    the shortfall of whole new pages evicted). ``eviction``: the tree's strategy (0.5.23's
    ``--radix-eviction-policy``; not ``tlru``, whose bookkeeping the classic tree lacks);
    ``strategy``, an object with ``get_priority(node)``, replaces it (a rule the wheel lacks);
    ``after(tree)`` is called after each request."""
    side = SIDES[sgl.version]
    if side is Side0410 and tuple(rules) != RULES:
        raise ValueError("SGLang 0.4.10's tree caches through cache_finished_req: all of "
                         f"{', '.join(RULES)}")
    last = 1 if "kv" in rules else 0  # the last output token's KV: never computed
    kv_lens = [len(r.prompt) + len(r.output) - last for r in requests]
    pages = (sum(-(-n // page_size) + 1 for n in kv_lens) if capacity is None  # never evicts
             else capacity // page_size)
    alloc = PagedSlots(pages, page_size)
    rows = OneRow(max(kv_lens) + 1)
    tree = side.tree(sgl, rows, alloc, page_size, eviction)
    if strategy is not None:
        tree.eviction_strategy = strategy
    hits, evicted = [], []
    for r, kv_len in zip(requests, kv_lens):
        if -(-kv_len // page_size) > pages:
            raise ValueError(f"{r.id} ({kv_len} tokens of KV) does not fit {pages} pages")
        prefix, held = side.match(sgl, tree, r, rules)
        n = kv_len - len(prefix)
        before = tree.evictable_size()
        side.evict(sgl, tree, alloc, n, rules)
        evicted.append(before - tree.evictable_size())
        slots = alloc.alloc_extend(len(prefix), kv_len)
        if slots is None:
            raise RuntimeError(f"{r.id}: SGLang would run out of memory allocating {n} tokens")
        rows.req_to_token[0, : len(prefix)] = prefix  # prepare_for_extend: the prefix, then
        rows.req_to_token[0, len(prefix) : kv_len] = slots  # the new slots
        hits.append(len(prefix))
        side.finish(sgl, tree, r, held, prefix, kv_len)
        if after is not None:
            after(tree)
    return hits, evicted, tree.total_size(), sglang_runs(tree)


def sglang_runs(tree) -> list[tuple[int, int, int]]:
    """Every node of SGLang's tree as (tokens before it, its length, a hash of its tokens),
    sorted: equal for two trees holding the same runs at the same depths."""
    out, stack = [], [(child, 0) for child in tree.root_node.children.values()]
    while stack:
        node, start = stack.pop()
        out.append((start, len(node.key), hash(key_tokens(node.key).tobytes())))
        stack.extend((child, start + len(node.key)) for child in node.children.values())
    return sorted(out)


def key_tokens(key) -> np.ndarray:
    """A node key's tokens, whichever release's key it is (0.4.10: a list; 0.5.23: a RadixKey)."""
    tokens = key.token_ids[: len(key)] if hasattr(key, "token_ids") else key
    return np.asarray(tokens, dtype=TOKEN_DTYPE)
