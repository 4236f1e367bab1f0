"""The replay backend's request on the radix tree in one walk (`RadixCache.replay_one`).

The replay serves a request with the calls of `PrefixCache.replay_one` (docs/design.md §4):
match the prompt (a walk), protect it, evict the shortfall, allocate, insert prompt + output (a
second walk over the same path) and, under SGLang 0.5.23's checkpoint rule, insert the prompt
again (a third walk, which cuts the new leaf at the prompt's end) and look the whole sequence up
(a fourth). Every walk after the first passes exactly the nodes the first found, plus the new
leaf: this module walks the tree once and writes what the other three walks leave behind.

What the walks leave is exactly computable, because a walk's effects on a node it passes are
its access time (a tick of the tree's logical clock per node), its priority (the most urgent of
the walks' requesters), its match count and its insert hit count; the last walk to pass a node
sets its time, and the ticks in between are counted, not made. `replay_fast` does this for the
usual request, whose sequence continues past the cached prefix into nothing cached, when the
eviction policy has no hooks (`EvictionPolicy.on_*`): a hook may read a node between two walks,
and then `replay_walking` makes every walk. A request whose output runs on into cached tokens
(rare outside tiny vocabularies) has its first walk's effects applied and then takes the walks.

Eviction heap entries: only the final offer of each node that a walk ends at or creates is kept
(the earlier ones are stale by the time anything pops them, since the node was touched or grew
children since), which changes no eviction: entries are ordered by the policy's key and the
node's id, and a stale one is skipped when popped. `tests/test_replay.py` holds every release,
policy, capacity and eviction unit to the calls' own results, node by node.

The walk down the tree, the last walk's effects on the path and the two nodes a request adds
under 0.5.23 are `testbed.cache.native`'s `match`, `touch` and `cut_leaf`: C where it is built,
else their Python twins, with the same results (tests/test_native.py).
"""

from __future__ import annotations

from testbed.cache.eviction import Requester
from testbed.cache.native import cut_leaf, match, touch
from testbed.cache.token_runs import TOKEN_BYTES, matched_bytes
from testbed.cache.tree_node import TreeNode
from testbed.cache.radix_tree import RadixTree

# ``cache`` below is a `testbed.cache.radix.RadixCache` (which calls these): typed as its tree,
# since importing it here would make an import cycle.


def prompt_requester(requester: Requester | None) -> Requester:
    """Who re-inserts a prompt (`RadixCache.reinsert_prompt`): the request, one more urgent
    (SGLang: ``req.priority or 0``, plus one)."""
    if requester is None:
        return Requester(None, -1, None)
    return requester._replace(priority=requester.priority - 1)


def replay_fast(cache: RadixTree, kb: bytes, p: int, n: int,
                requester: Requester | None) -> tuple[int, int, bool, None]:
    """Serve a request of ``n`` tokens (``kb``, its bytes), the first ``p`` its prompt, on a tree
    of page size 1 whose policy has no hooks (module docstring); the calls' result."""
    c0 = cache._clock
    # ---- the match: the walk itself, touching nothing yet (a cut is made, at its own ticks)
    end = p * TOKEN_BYTES
    path, at, child = match(cache.root, kb, end)
    node = path[-1] if path else cache.root
    cut = child is not None
    if cut:
        # the walk stops inside this edge: cut it as `RadixTree._descend` does, at its ticks
        k = matched_bytes(child.kb, kb, at, end)
        before = child.last_access
        cache._clock = child.last_access = c0 + 2 + len(path)  # the walk touches it...
        node = cache._split(child, k // TOKEN_BYTES)  # ...then the cut ticks (the new head)
        if cache._keep_tail:
            child.last_access = before
            cache.eviction.offer(child)
        at += k
        path.append(node)
    k = len(path)
    c1 = c0 + 1 + k + cut if p else c0  # after the match: the root, the path and a cut's tick
    urgent = requester.priority if requester is not None else None
    if at == len(kb) or kb[at : at + TOKEN_BYTES] in node.children:
        # nothing new to cache, or the output runs on into cached tokens: the match's effects
        # now, then every walk
        if p:
            apply_match(cache, path, cut, c0, c1, urgent)
        return replay_rest(cache, kb, p, n, node, at, path, requester)
    # ---- the usual request: room, then one new leaf holding everything past the hit
    hit = at // TOKEN_BYTES
    need = n - hit
    pool = cache.pool
    evicted = 0
    protect = not pool.can_alloc(need)  # (without eviction nothing could take the path)
    whole = protect and cache._protected > 0
    if whole:  # another holder's lock: room is not certain, `lock` as the calls do
        cache.lock(node)
        if pool.num_free + cache._evictable < need:
            raise RuntimeError(f"radix: no room for {n} tokens although they fit")
    elif protect:
        # Nothing else is protected and the sequence fits, so there is room; protecting the
        # path's last node protects the path (an ancestor with a child is no candidate) without
        # walking it up and down to move its tokens to the protected count and back.
        node.lock_ref += 1
    if protect:
        evicted = cache.evict(need - pool.num_free)
    # the insert's walk: the root and the path (c1 + 1 ...), then the new leaf's tick
    c2 = c1 + 1 + k
    cut_at = p if cache._checkpoints and hit < p < n else 0
    if cut_at:
        # The prompt walk will cut the new leaf at the prompt's end: make the two nodes the cut
        # leaves (the leaf's id first), the head with the cut's tick, one more urgent.
        c3 = c2 + 4 + k  # the leaf; the prompt walk's root and path; the leaf touched; the cut
        head_slots, leaf_slots = pool.alloc_split(need, p - hit)
        # (a cut's head takes the tail's priority, here the requester's as the leaf's, then
        # the prompt walk's, `prompt_requester`'s)
        last = cut_leaf(cache._ids, node, kb, at, p * TOKEN_BYTES, head_slots, leaf_slots, c3,
                        c2 + 1, requester, urgent - 1 if urgent is not None else -1)
        leaf = last[1]
        cache.num_nodes += 2
        cache._evictable += need
    else:
        cache._clock = c2
        leaf = cache._add_leaf(node, kb[at:], pool.alloc(need), hit, requester)
        last = [leaf]  # what the last walk passes after the path
    if cache._checkpoints:
        prompt_walk = 0 < p < n
        if not cut_at:
            c3 = c2 + 1 + (1 + k if prompt_walk else 0)  # the leaf; the prompt walk's root, path
        if prompt_walk:
            urgent = urgent - 1 if urgent is not None else -1  # the prompt's, one more urgent
        tick = c3 + 1  # the look-up of the whole sequence: root, path, [head,] leaf
    else:
        tick = c1 + 1  # the insert's walk was the last; the leaf keeps its creation tick
        last = []
    # the last walk: the root at ``tick``, the path after it (each with the match's and the
    # insert's count), then what it passes beyond the path (one leaf, or the cut's two)
    tick = touch(cache.root, path, last, tick, urgent)
    if last:
        cache._clock = tick
        cache.eviction.offer(leaf)
    if whole:
        cache.unlock(node)
    elif protect:
        node.lock_ref -= 1  # (`unlock` would offer it: it has a child now, so it is no candidate)
    return hit, evicted, True, None


def apply_match(cache: RadixTree, path: list[TreeNode], cut: bool, c0: int, c1: int,
                urgent: int | None) -> None:
    """What the match walk of `replay_fast` leaves on the nodes it passed (any cut is made):
    their ticks from ``c0 + 1`` on (the root's first; a cut's head keeps its own), one more match
    each, the requester's priority ``urgent``; the clock at ``c1``; the last node offered."""
    root = cache.root
    root.last_access = tick = c0 + 1
    if urgent is not None and urgent < root.priority:
        root.priority = urgent
    for x in path[:-1] if cut else path:
        tick += 1
        x.last_access = tick
    for x in path:
        x.access_count += 1
        if urgent is not None and urgent < x.priority:
            x.priority = urgent
    cache._clock = c1
    cache.eviction.offer(path[-1] if path else root)


def replay_walking(cache: RadixTree, kb: bytes, p: int, n: int,
                   requester: Requester | None) -> tuple[int, int, bool, None]:
    """Serve the request making every walk (a policy with hooks sees each as it happens)."""
    if cache._on_access is not None:
        cache._on_access(requester)
    path: list[TreeNode] = []
    node, at = (cache._walk(kb, p * TOKEN_BYTES, requester, True, path) if p
                else (cache.root, 0))
    return replay_rest(cache, kb, p, n, node, at, path, requester)


def replay_rest(cache: RadixTree, kb: bytes, p: int, n: int, node: TreeNode, at: int,
                path: list[TreeNode], requester: Requester | None) -> tuple[int, int, bool, None]:
    """After the match walk (ending at ``node``, ``at`` bytes in, through ``path``): protect,
    evict, allocate, then the insert's walk and, under 0.5.23, the checkpoint's two walks."""
    pool = cache.pool
    hit = at // TOKEN_BYTES
    need = n - hit
    evicted = 0
    # The lock matters only while evicting: without eviction, locking and unlocking the path
    # change nothing (its nodes but the last have children, so unlocking offers none of them;
    # the last one is offered at the end of the insert's walk instead, by then unlocked).
    locked = not pool.can_alloc(need)
    if locked:
        cache.lock(node)
        if pool.num_free + cache._evictable < need:
            raise RuntimeError(f"radix: no room for {n} tokens although they fit")
        evicted = cache.evict(need - pool.num_free)
    fresh = pool.alloc(need)
    # The insert's walk: the root and the matched path touched again, then on from its end.
    urgent = requester.priority if requester is not None else None
    clock = cache._clock
    clock += 1
    cache.root.last_access = clock
    if urgent is not None and urgent < cache.root.priority:
        cache.root.priority = urgent
    for x in path:
        clock += 1
        x.last_access = clock
        if urgent is not None and urgent < x.priority:
            x.priority = urgent
        x.hits += 1  # the insert's hit (SGLang 0.5.23's ``hit_count``)
    cache._clock = clock
    if at < len(kb) and kb[at : at + TOKEN_BYTES] in node.children:
        end, at = cache._descend(node, kb, at, len(kb), requester, False, [], 0)
    else:  # nothing cached beyond the hit (`_descend` would only offer it)
        end = node
        cache.eviction.offer(node)
    present = at // TOKEN_BYTES
    if present < n:
        cache._add_leaf(end, kb[at:], fresh[present - hit :], present, requester)
    if present > hit:
        pool.free(fresh[: present - hit])  # output tokens cached meanwhile: duplicates
    if cache._checkpoints:  # `RadixCache.checkpoint_walks` on the bytes at hand
        if 0 < p < n:
            cache._walk(kb, p * TOKEN_BYTES, prompt_requester(requester), False, [],
                        p * TOKEN_BYTES)
        if n:
            cache._walk(kb, len(kb), None, False, [])
    if locked:
        cache.unlock(node)
    return hit, evicted, True, None
