"""(c) of ``--sglang 0.5.23``: our replay backend with pages 1 and 16 against SGLang 0.5.23's own
RadixCache (`sglang_replay` does the same against 0.4.10, and holds the cases, variants and tables).

SGLang's side (`serve_sglang523`) serves the requests one at a time, in list order, collapsed into
one allocation as our replay is, through 0.5.23's own functions (imported by `sglang_wheel523.load`):

- ``mem_cache/common.py:match_kv_cache`` with ``max_prefix_len`` = prompt length − 1
  (``Req.init_next_round_input`` / ``_compute_max_prefix_len``), then ``tree_cache.lock`` of the
  matched node (``PrefillAdder`` locks ``req.last_node``);
- ``common.evict_from_tree_cache`` with the demand of ``allocation.py:alloc_token_slots`` (the
  extend at page size 1) or ``alloc_paged_token_slots_extend`` (the extend plus one page per
  request), which asks the allocator's ``evict_to_free_tokens`` for the *shortfall* against its
  free pages (0.4.10 asked the tree for the whole demand); new pages from `PagedSlots523`;
- ``common.release_kv_cache(checkpoint=True)``, i.e. ``RadixCache.checkpoint`` up to
  ``Req.owned_kv_len`` (prompt + output − 1: the last output token's KV is never computed):
  ``_insert_cache(split_prompt=True)`` (insert, then the prompt again, page-aligned, one priority
  higher), ``match_prefix`` of the key, the lock moved; then the row's unaligned tail freed.

The check after prefill that a running request makes in the server (``checkpoint_kv_cache``) is
left out, as 0.4.10's check leaves out ``cache_unfinished_req``: replay makes one insert per
request, and that earlier insert of the prompt changes no recency the final one does not refresh.

``python -m experiments.validation.sglang_replay523`` replays the whole Mooncake conversation
trace at 3M tokens, pages 1 and 16, through our replay and through 0.5.23's RadixCache fed
replay.py's own calls (`whole_trace`).

Stand-ins (not isolable): the request and its KV record (`Req523`), the paged allocator
(`PagedSlots523`: `sglang_replay.PagedSlots` with 0.5.23's ``free_segment(s)`` and
``evict_to_free_tokens``) and the req-to-token pool (`OneRow523`).
"""

from __future__ import annotations

import dataclasses
from array import array
from types import SimpleNamespace

import numpy as np
import torch

from experiments import MOONCAKE_TRACE
from experiments.validation import sglang_replay
from experiments.validation.sglang_replay import PagedSlots, sglang_runs
from experiments.validation.sglang_req523 import KvRecord
from testbed.cache.radix import RadixCache
from testbed.backends.replay import replay
from testbed.workloads.request import Request
from testbed.workloads.traces import load_mooncake

# Where SGLang 0.5.23's serving differs from replay.py: (rule, what SGLang does, where).
RULES523 = {
    "limit": ("matches the prompt minus its last token (one token is always computed, for the "
              "logits)", "Req._compute_max_prefix_len"),
    "kv": ("caches prompt+output minus the last output token, whose KV is never computed; the "
           "request holds that many slots", "release_kv_cache -> RadixCache.checkpoint up to "
           "Req.owned_kv_len"),
    "evict": ("evicts the shortfall of the extend plus one page per request at page size > 1 "
              "(at page size 1 the shortfall of the extend, as replay.py)",
              "alloc_paged_token_slots_extend -> BaseTokenToKVPoolAllocator.evict_to_free_tokens"),
}


class PagedSlots523(PagedSlots):
    """`sglang_replay.PagedSlots` with what 0.5.23's code calls on its allocator: the segment
    frees of ``BaseTokenToKVPoolAllocator`` (a segment starts on a page; every page it touches
    is freed) and ``evict_to_free_tokens`` (ask the tree for the shortfall only, in 0.5.23's
    ``EvictParams``)."""

    def __init__(self, num_pages: int, page_size: int, evict_params: type) -> None:
        super().__init__(num_pages, page_size)
        self.evict_params = evict_params

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


class OneRow523:
    """``ReqToTokenPool`` for one request at a time: row 0 of a tensor, reused."""

    def __init__(self, width: int) -> None:
        self.req_to_token = torch.zeros((1, width), dtype=torch.int64)

    def write(self, index, values: torch.Tensor) -> None:
        self.req_to_token[index] = values

    def free(self, req) -> None:
        """The request is done; the row is overwritten by the next one."""


class Req523(SimpleNamespace):
    """``schedule_batch.Req`` as ``match_kv_cache``, ``release_kv_cache`` and
    ``RadixCache.checkpoint`` read it, for a generated request that has produced all its
    ``output`` (finished by length)."""

    def __init__(self, request: Request) -> None:
        prompt = array("q", request.prompt.tolist())
        # priority: SGLang's tree keeps the higher longer, ours the lower (docs/design.md §4)
        super().__init__(
            rid=request.id, origin_input_ids=prompt, output_ids=array("q", request.output.tolist()),
            full_untruncated_fill_ids=prompt, extra_key=None, cache_salt=None,
            priority=-request.priority or None, lock=None, last_node=None, prefix_len=0,
            finished_len=None, skip_radix_cache_insert=False,
            kv=KvRecord(req_pool_idx=0, is_kv_released=False))

    def _compute_max_prefix_len(self, input_len: int) -> int:
        return max(input_len - 1, 0)  # no logprobs, no dLLM

    def refresh_fill_ids(self) -> None:
        self.full_untruncated_fill_ids = self.origin_input_ids + self.output_ids

    def owned_kv_len(self) -> int:
        return self.kv.kv_committed_len  # finished_len None: no stop beyond the committed KV

    def finished(self) -> bool:
        return True


def runtime(sgl) -> None:
    """What ``mem_cache/common.py`` reads of a default server besides the cache: no speculative
    decoding, no thinking-stripping, no KV sharding; ``ceil_align`` as ``utils/common.py`` has it
    (its module is a placeholder)."""
    sgl.common.get_spec = lambda: SimpleNamespace(speculative_algorithm=None)
    sgl.common.get_serving = lambda: SimpleNamespace(strip_thinking_cache=False)
    sgl.common.page_interleave_shard_size = lambda allocator: 1
    sgl.common.ceil_align = lambda x, y: -(-x // y) * y


def serve_sglang523(sgl, requests: list[Request], page_size: int, capacity: int | None,
                    rules: tuple[str, ...] = tuple(RULES523), eviction: str = "lru",
                    strategy=None, after=None) -> tuple[list[int], list[int], int, list]:
    """0.5.23's RadixCache serving ``requests`` one at a time (module docstring). Returns per
    request the hit and the tokens evicted, the tokens left in the tree and its runs
    (`sglang_replay.sglang_runs`). ``rules``: those of `RULES523` SGLang's server follows (all of
    them by default); without them its tree is fed replay.py's calls (the whole prompt matched,
    prompt + output inserted, the shortfall of whole new pages evicted). ``eviction``: the
    tree's strategy (``--radix-eviction-policy``; not ``tlru``, whose bookkeeping the classic
    tree lacks); ``strategy``, an object with ``get_priority(node)``, replaces it (a rule the
    wheel lacks); ``after(tree)`` is called after each request."""
    runtime(sgl)
    last = 1 if "kv" in rules else 0  # the last output token's KV: never computed
    kv_lens = [len(r.prompt) + len(r.output) - last for r in requests]
    pages = (sum(-(-n // page_size) + 1 for n in kv_lens) if capacity is None  # never evicts
             else capacity // page_size)
    alloc = PagedSlots523(pages, page_size, sgl.base.EvictParams)
    rows = OneRow523(max(kv_lens) + 1)
    tree = sgl.radix.RadixCache(sgl.params.CacheInitParams(
        disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=alloc,
        page_size=page_size, eviction_policy=eviction))
    if strategy is not None:
        tree.eviction_strategy = strategy
    hits, evicted = [], []
    for r, kv_len in zip(requests, kv_lens):
        if -(-kv_len // page_size) > pages:
            raise ValueError(f"{r.id} ({kv_len} tokens of KV) does not fit {pages} pages")
        req = Req523(r)
        prompt = req.origin_input_ids
        limit = req._compute_max_prefix_len(len(prompt)) if "limit" in rules else len(prompt)
        sgl.common.match_kv_cache(req, tree, prompt, max_prefix_len=limit)
        req.kv.cache_protected_len = req.prefix_len  # init_next_round_input
        prefix = tree.path_device_indices(req.last_node)[: req.prefix_len]
        req.lock = tree.lock(req.last_node)  # PrefillAdder
        n = kv_len - req.prefix_len
        before = tree.evictable_size()
        demand = (n + (page_size if page_size > 1 else 0) if "evict" in rules
                  else -(-n // page_size) * page_size)  # (the prefix is whole pages)
        sgl.common.evict_from_tree_cache(tree, demand)
        evicted.append(before - tree.evictable_size())
        slots = alloc.alloc_extend(req.prefix_len, kv_len)
        if slots is None:
            raise RuntimeError(f"{r.id}: SGLang would run out of memory allocating {n} tokens")
        rows.req_to_token[0, : req.prefix_len] = prefix  # write_cache_indices
        rows.req_to_token[0, req.prefix_len : kv_len] = slots
        req.kv.kv_committed_len = req.kv.kv_allocated_len = kv_len
        hits.append(req.prefix_len)
        sgl.common.release_kv_cache(req, tree, checkpoint=True)
        if after is not None:
            after(tree)
    return hits, evicted, tree.total_size(), sglang_runs(tree)


PAGE_SIZES523 = (1, 16)  # the pages issue 32 asks for (0.4.10's check runs 1, 4, 16)


def check_replay523(sgl, quick: bool, show: int) -> list[dict]:
    """(c) against 0.5.23: `sglang_replay.check_replay` with ours on ``scheduler.sglang=0.5.23``
    and SGLang's side `serve_sglang523`, at page sizes 1 and 16."""
    return sglang_replay.check_replay(sgl, quick, show, "0.5.23", serve_sglang523, PAGE_SIZES523)


def all_agree(rows: list[dict]) -> bool:
    """Whether, with 0.5.23's three rules, every request's hit and eviction and every final
    tree agree, and our rule-less driver is replay.py."""
    all_rules = sglang_replay.ALL
    return all(r[all_rules]["both"] == r["reqs"] and r[all_rules]["same"] == r["traces"]
               and r["replay_ok"] for r in rows)


# 0.5.23's strategies besides LRU that its classic tree runs alone (T-LRU needs the unified
# tree's bookkeeping: `sglang_eviction` checks its order)
STRATEGIES = ("lfu", "slru", "priority", "fifo", "mru", "filo")


def check_strategies(sgl, quick: bool) -> dict[str, list[int]]:
    """Replay under every strategy in `STRATEGIES`, with 0.5.23's three rules: random token runs
    (`sglang_replay.random_runs`, each request a random priority 0-2: lower more urgent ours,
    negated for SGLang) at the evicting and tight capacities, pages 1 and 16. Per strategy:
    [requests agreeing (hit and evicted tokens), requests, final trees the same, trees]."""
    rng = np.random.default_rng(0)
    traces = [[dataclasses.replace(r, priority=int(rng.integers(0, 3)))
               for r in sglang_replay.random_runs(seed)] for seed in range(1 if quick else 4)]
    out = {}
    for strategy in STRATEGIES:
        counts = out[strategy] = [0, 0, 0, 0]
        for trace in traces:
            caps = sglang_replay.capacities(trace)
            for page in PAGE_SIZES523:
                for level in ("evict", "tight"):
                    theirs = serve_sglang523(sgl, trace, page, caps[level], eviction=strategy)
                    ours = sglang_replay.serve_ours(trace, page, caps[level], sglang_replay.ALL,
                                                    "0.5.23", strategy)
                    counts[0] += sum(o == t for o, t in zip(zip(*ours[:2]), zip(*theirs[:2])))
                    counts[1] += len(trace)
                    counts[2] += ours[3] == theirs[3]
                    counts[3] += 1
    return out


def per_page(rows: list[dict]) -> str:
    """Per page size, with 0.5.23's three rules: requests replayed, identical (hit and evicted
    tokens), differing; final trees the same."""
    out = []
    for p in PAGE_SIZES523:
        mine = [r for r in rows if r["page"] == p]
        reqs = sum(r["reqs"] for r in mine)
        same = sum(r[sglang_replay.ALL]["both"] for r in mine)
        trees = sum(r[sglang_replay.ALL]["same"] for r in mine)
        out.append(f"page {p}: {reqs} requests replayed, {same} identical, {reqs - same} "
                   f"differing, the same final tree in {trees}/{sum(r['traces'] for r in mine)}")
    return "; ".join(out)


def report(sgl, quick: bool, show: int) -> tuple[bool, str]:
    """Run and print (c) for 0.5.23; returns whether all agree and the summary line."""
    print(f"\n(c) replay with pages {' and '.join(map(str, PAGE_SIZES523))}, one request at a "
          f"time ({'quick' if quick else 'full'}), ours with scheduler.sglang=0.5.23: hits=, "
          "evicted=: requests whose hit, tokens evicted agree; both=: requests where both agree; "
          "tree o/s: tokens left in the tree, ours/SGLang. SGLang 0.5.23's rules that replay.py "
          "does not follow:")
    sglang_replay.print_rules(RULES523)
    rows = check_replay523(sgl, quick, show)
    print()
    sglang_replay.print_replay(rows)
    strategies = check_strategies(sgl, quick)
    line = ", ".join(f"{s} {c[0]}/{c[1]} ({c[2]}/{c[3]} trees)" for s, c in strategies.items())
    print(f"other strategies, random token runs with priorities, pages 1 and 16, evicting and "
          f"tight capacities, with 0.5.23's three rules: requests agreeing {line}")
    agree = all_agree(rows) and all(c[0] == c[1] and c[2] == c[3] for c in strategies.values())
    return agree, (f"{sglang_replay.summary(rows)}\n           {per_page(rows)}\n"
                   f"           (c) other strategies: {line}")


def whole_trace(sgl, page_size: int, capacity: int) -> tuple[float, float, int, int]:
    """The whole Mooncake conversation trace through our replay and through 0.5.23's RadixCache
    fed replay.py's own calls (no `RULES523`): both hit rates, requests agreeing (hit and
    evicted tokens), requests."""
    requests = load_mooncake(MOONCAKE_TRACE)
    prompt = sum(len(r.prompt) for r in requests)
    records = replay(requests, RadixCache(capacity, page_size=page_size, sglang="0.5.23"))
    ours = [(r.cached_tokens, r.evicted_tokens) for r in records]
    hits, evicted, _, _ = serve_sglang523(sgl, requests, page_size, capacity, rules=())
    same = sum(o == t for o, t in zip(ours, zip(hits, evicted)))
    return sum(h for h, _ in ours) / prompt, sum(hits) / prompt, same, len(requests)


if __name__ == "__main__":  # the whole-trace figures of docs/results/sglang_fidelity.md (~2 min)
    import sys
    from pathlib import Path

    from experiments.validation import sglang_wheel, sglang_wheel523

    if not MOONCAKE_TRACE.exists():
        sys.exit(f"no Mooncake conversation trace at {MOONCAKE_TRACE}")
    wheel = sglang_wheel523.load(sglang_wheel.fetch(
        Path.home() / ".cache" / "radix-testbed" / "sglang-0.5.23", "0.5.23"))
    for page in PAGE_SIZES523:
        ours, theirs, same, total = whole_trace(wheel, page, 3_000_000)
        print(f"Mooncake conversation, 3M tokens, page {page}: hit rate ours {ours:.6f}, "
              f"SGLang 0.5.23 {theirs:.6f}; {same}/{total} requests agree")
