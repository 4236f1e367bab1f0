"""Eviction order against SGLang's own RadixCache and eviction strategies, on random trees.

For each strategy SGLang has (0.5.23: ``lru``, ``lfu``, ``fifo``, ``mru``, ``filo``,
``priority``, ``slru``, ``tlru`` of ``mem_cache/evict_policy.py``; 0.4.10: its radix cache's one
order, LRU), a random history is applied to SGLang's RadixCache and to ours with the same-named
policy (`testbed.cache.eviction.EVICTION`): sequences branching off earlier ones are inserted
(each with a priority, and sometimes as a request's second insert that covers its first, with
0.5.23's ``inserted_len``), and random prefixes of them are looked up (``match_prefix``:
recency, splits). Then both trees are evicted one token at a time until empty (each call evicts
one leaf) and the sequences of evicted nodes (their whole paths) must be equal.

Correspondences: our priorities are lower-is-more-urgent, 0.5.23's ``PriorityStrategy`` evicts
lower values first, so each insert carries minus our priority there; T-LRU draws its threshold and
next-prompt estimate per tree (both sides alike). T-LRU lives only in 0.5.23's unified tree
(``unified_cache/unified_tree_core.py``), whose nodes keep the branch depths it reads;
`tlru_bookkeeping` applies that module's own ``_set_tlru_lens_and_raise_history`` to the classic
RadixCache's new nodes, and copies the depths on a split as ``unified_tree_core`` does, so that
``TLRUStrategy`` can rank them.
"""

from __future__ import annotations

from array import array
from collections import Counter

import numpy as np
import torch

from testbed.cache import EVICTION, RadixCache, Requester
from testbed.workloads.request import TOKEN_DTYPE

STRATEGIES = {"0.5.23": ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru", "tlru"),
              "0.4.10": ("lru",)}


class _Freed:
    """The token-to-KV allocator stand-in: SGLang's evict frees each victim's slots through it."""

    device = "cpu"

    def free_segment(self, value, start_pos: int = 0) -> None:
        pass

    free = free_segment


def random_history(rng: np.random.Generator) -> list[tuple]:
    """Operations: ("insert", tokens, priority, inserted_len) and ("match", tokens)."""
    vocab = int(rng.choice([4, 16, 1000]))
    seqs: list[list[int]] = []
    ops: list[tuple] = []
    for _ in range(int(rng.integers(1, 30))):
        r = rng.random()
        if seqs and r < 0.25:
            base = seqs[int(rng.integers(len(seqs)))]
            ops.append(("match", base[: int(rng.integers(1, len(base) + 1))]))
            continue
        if seqs and r < 0.45:  # a request's second insert over its first (a chunk, then all)
            base = seqs[int(rng.integers(len(seqs)))]
            seq = base + rng.integers(0, vocab, int(rng.integers(1, 20))).tolist()
            ops.append(("insert", base, 0, 0))
            ops.append(("insert", seq, 0, len(base)))
            seqs.append(seq)
            continue
        if seqs and rng.random() < 0.8:
            base = seqs[int(rng.integers(len(seqs)))]
            seq = base[: int(rng.integers(0, len(base) + 1))]
        else:
            seq = []
        seq = seq + rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
        seqs.append(seq)
        ops.append(("insert", seq, int(rng.integers(-2, 3)), 0))
    return ops


def their_cache(sgl, strategy: str, config: dict):
    if sgl.version == "0.4.10":
        return sgl.radix.RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=_Freed(),
                                    page_size=1, disable=False)
    params = sgl.params.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=_Freed(), page_size=1,
        eviction_policy=strategy, eviction_policy_config=config or None)
    cache = sgl.radix.RadixCache(params)
    if strategy == "tlru":
        tlru_bookkeeping(sgl, cache)
    return cache


def apply_theirs(sgl, cache, ops: list[tuple]) -> None:
    for op in ops:
        tokens = array("q", op[1])
        if sgl.version == "0.4.10":
            if op[0] == "insert":
                cache.insert(list(op[1]), torch.arange(len(op[1])))
            else:
                cache.match_prefix(key=list(op[1]))
            continue
        key = sgl.radix.RadixKey(tokens)
        if op[0] == "insert":
            cache.insert(sgl.base.InsertParams(key=key, value=torch.arange(len(tokens)),
                                               priority=-op[2], inserted_len=op[3]))
        else:
            cache.match_prefix(sgl.base.MatchPrefixParams(key=key))


def apply_ours(cache: RadixCache, ops: list[tuple]) -> None:
    for op in ops:
        tokens = np.asarray(op[1], dtype=TOKEN_DTYPE)
        if op[0] == "match":
            cache.match_prefix(tokens, lookup=True)
            continue
        slots = cache.pool.alloc(len(tokens))
        present = cache.insert(tokens, slots, Requester(priority=op[2]), inserted=op[3])
        cache.pool.free(slots[:present])  # duplicates of what was cached, as release frees them


def their_paths(cache) -> set[tuple[int, ...]]:
    out, stack = set(), [(cache.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            key = child.key.raw_token_ids() if hasattr(child.key, "raw_token_ids") else child.key
            full = path + tuple(key)
            out.add(full)
            stack.append((child, full))
    return out


def our_paths(cache: RadixCache) -> set[tuple[int, ...]]:
    out, stack = set(), [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            full = path + tuple(child.key.tolist())
            out.add(full)
            stack.append((child, full))
    return out


def evict_one(sgl, cache) -> None:
    if sgl.version == "0.4.10":
        cache.evict(1)
    else:
        cache.evict(sgl.base.EvictParams(num_tokens=1))


def eviction_order(paths, evict) -> list[list[tuple[int, ...]]]:
    """The nodes (paths) each one-token eviction removes, until the tree is empty."""
    order, before = [], paths()
    while before:
        evict()
        after = paths()
        if after == before:
            raise RuntimeError("an eviction freed nothing")
        order.append(sorted(before - after))
        before = after
    return order


def compare_once(sgl, strategy: str, rng: np.random.Generator) -> bool:
    config: dict = {}
    if strategy == "tlru":
        config = {"threshold": int(rng.choice([0, 10, 40, 100])),
                  "next_prompt_estimate": int(rng.choice([0, 5, 30]))}
    ops = random_history(rng)
    theirs = their_cache(sgl, strategy, config)
    apply_theirs(sgl, theirs, ops)
    ours = RadixCache(None, policy=EVICTION.build({"name": strategy, **config}))
    apply_ours(ours, ops)
    if their_paths(theirs) != our_paths(ours):
        return False
    expected = eviction_order(lambda: their_paths(theirs), lambda: evict_one(sgl, theirs))
    got = eviction_order(lambda: our_paths(ours), lambda: ours.evict(1))
    return expected == got


def check_eviction(sgl, trials: int, seed: int) -> dict[str, Counter]:
    rng = np.random.default_rng(seed)
    stats = {s: Counter() for s in STRATEGIES[sgl.version]}
    for strategy, c in stats.items():
        for _ in range(trials):
            c.update(trees=1, agree=compare_once(sgl, strategy, rng))
    return stats


def print_eviction(stats: dict[str, Counter]) -> None:
    print("  " + ", ".join(f"{s} {c['agree']}/{c['trees']}" for s, c in stats.items()))


def tlru_bookkeeping(sgl, cache) -> None:
    """Give a classic RadixCache the T-LRU depths the unified tree keeps (module docstring):
    ``_set_tlru_lens_and_raise_history`` for each new node (its parent's depth plus its own
    length), and a split's head taking the parent's depth plus its length and the tail's history
    (``unified_tree_core``'s split)."""
    raise_history = sgl.unified._set_tlru_lens_and_raise_history
    root = cache.root_node
    root._tlru_cached_prefix_len = root._tlru_history_len = 0
    insert_helper, split_node = cache._insert_helper, cache._split_node
    heads: set = set()  # nodes made by splits: they copy depths instead

    def insert(node, key, value, priority=0, inserted_len=0):
        before = set(_nodes(root))
        out = insert_helper(node, key, value, priority, inserted_len)
        for new in _nodes(root):
            if new not in before and new not in heads:
                new._tlru_history_len = 0  # as UnifiedTreeNode starts
                raise_history(new, new.parent)
        return out

    def split(key, child, split_len):
        head = split_node(key, child, split_len)
        heads.add(head)
        head._tlru_cached_prefix_len = head.parent._tlru_cached_prefix_len + split_len
        head._tlru_history_len = child._tlru_history_len
        return head

    cache._insert_helper, cache._split_node = insert, split


def _nodes(root) -> list:
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out
