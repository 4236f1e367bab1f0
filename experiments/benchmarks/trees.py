"""The trees `experiments.benchmarks.cache` races the project's caches against, each served replay.py's way.

Every one takes the requests in order, one at a time, with the replay backend's calls
(docs/design.md §4: match the prompt and lock it, evict the shortfall, allocate, insert prompt +
output, free the duplicates, unlock) and returns the hit and the tokens evicted per request, so
`experiments.benchmarks.cache` can check them against `RadixCache` request for request:

- `PlainRadix` + `replay_plain`: the obvious per-token Python radix tree (edges are lists of ints
  compared token by token, eviction by a heap of all leaves rebuilt per evict call as SGLang does);
- `EdgeRadix` + `replay_edge`: a plain per-edge Python radix tree, written for this benchmark
  as one would write it with care: edges are lists compared a whole slice at a time (``==`` in C),
  LRU by a counter, eviction from a lazily invalidated heap of leaves, a list of free slots; with
  ``checkpoint``, SGLang 0.5.23's rule (the prompt inserted again, the sequence looked up);
- `replay_sglang`: SGLang 0.4.10's own ``RadixCache`` (imported from the wheel cached by
  `experiments.validation.sglang`, see `load_sglang`) with the allocator stand-in of
  `experiments.validation.sglang.tree_serving`.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Iterable

SGLANG_CACHE = Path.home() / ".cache" / "radix-testbed" / "sglang-0.4.10"


# ------------------------------------------------------------------------- per token
class Node:
    __slots__ = ("key", "slots", "children", "parent", "lock", "last")

    def __init__(self, key: list[int], slots: list[int], parent: "Node | None", last: int) -> None:
        self.key = key  # the edge's tokens
        self.slots = slots  # one KV slot per token of the edge
        self.children: dict[int, Node] = {}  # by first token
        self.parent = parent
        self.lock = 0
        self.last = last  # access time (a counter)


class PlainRadix:
    """Per-token radix tree with LRU leaf eviction; ``capacity`` in tokens, None for unlimited."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.free = list(range(capacity, 0, -1)) if capacity is not None else []
        self.minted = capacity or 0
        self.clock = 0
        self.root = Node([], [], None, 0)
        self.root.lock = 1  # never evicted

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def walk(self, key: list[int]) -> tuple[Node, int, list[int]]:
        """Follow ``key`` from the root touching every node on the way; split the edge the walk
        stops inside. Returns (last node, tokens matched, their slots)."""
        node = self.root
        node.last = self.tick()
        i = 0
        slots: list[int] = []
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            child.last = self.tick()
            edge = child.key
            j = 0
            n = min(len(edge), len(key) - i)
            while j < n and edge[j] == key[i + j]:
                j += 1
            if j < len(edge):
                child = self.split(child, j)
            slots += child.slots
            i += j
            node = child
            if j < n or i == len(key):
                break
        return node, i, slots

    def split(self, child: Node, at: int) -> Node:
        """Cut ``child`` after ``at`` tokens; a new head (accessed now) takes the first part."""
        head = Node(child.key[:at], child.slots[:at], child.parent, self.tick())
        head.lock = child.lock
        child.parent.children[child.key[0]] = head
        head.children[child.key[at]] = child
        child.parent = head
        child.key = child.key[at:]
        child.slots = child.slots[at:]
        return head

    def match(self, key: list[int]) -> tuple[Node, int, list[int]]:
        if not key:
            return self.root, 0, []
        return self.walk(key)

    def insert(self, key: list[int], slots: list[int]) -> int:
        """Cache ``key`` with ``slots``; returns how many leading tokens were already cached."""
        if not key:
            return 0
        node, present, _ = self.walk(key)
        if present < len(key):
            node.children[key[present]] = Node(key[present:], slots[present:], node, self.tick())
        return present

    def lock_path(self, node: Node, delta: int) -> None:
        while node is not self.root:
            node.lock += delta
            assert node.lock >= 0
            node = node.parent

    def leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def evict(self, num_tokens: int) -> int:
        """Remove unlocked leaves, oldest access first, until ``num_tokens`` are freed."""
        heap = [(x.last, id(x), x) for x in self.leaves() if not x.lock]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.free.extend(leaf.slots)
            freed += len(leaf.key)
            if parent is not self.root and not parent.children and not parent.lock:
                heapq.heappush(heap, (parent.last, id(parent), parent))
        return freed

    def alloc(self, n: int) -> list[int]:
        if len(self.free) < n:  # only an unlimited pool gets here: mint fresh ids
            fresh = n - len(self.free)
            self.free.extend(range(self.minted + 1, self.minted + fresh + 1))
            self.minted += fresh
        out = self.free[len(self.free) - n :]
        del self.free[len(self.free) - n :]
        return out

    def check(self) -> None:
        """Every slot id is free or held by exactly one node."""
        held = [s for node in self.nodes() for s in node.slots]
        assert sorted(held + self.free) == list(range(1, self.minted + 1)), "slot lost or shared"
        assert all(node.lock == 0 for node in self.nodes()), "lock left behind"

    def nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            out.append(stack.pop())
            stack.extend(out[-1].children.values())
        return out


def replay_plain(requests: Iterable, tree: PlainRadix) -> tuple[list[int], list[int]]:
    """The replay loop of docs/design.md §4 over the plain tree; returns (hits, evicted) per request."""
    hits, evicted = [], []
    for r in requests:
        prompt = r.prompt.tolist()
        seq = prompt + r.output.tolist()
        if tree.capacity is not None and len(seq) > tree.capacity:
            hits.append(0)
            evicted.append(0)
            continue
        node, hit, slots = tree.match(prompt)
        tree.lock_path(node, +1)
        need = len(seq) - hit
        ev = 0
        if tree.capacity is not None and len(tree.free) < need:
            ev = tree.evict(need - len(tree.free))
        slots = slots + tree.alloc(need)
        present = tree.insert(seq, slots)
        tree.free.extend(slots[hit:present])  # duplicates of cached KV
        tree.lock_path(node, -1)
        hits.append(hit)
        evicted.append(ev)
    return hits, evicted


# ------------------------------------------------------------------------- per edge
class Edge:
    __slots__ = ("key", "slots", "children", "parent", "lock", "last", "alive")

    def __init__(self, key: list[int], slots: list[int], parent: "Edge | None", last: int) -> None:
        self.key = key
        self.slots = slots
        self.children: dict[int, Edge] = {}
        self.parent = parent
        self.lock = 0
        self.last = last
        self.alive = True


class EdgeRadix:
    """Per-edge radix tree with LRU leaf eviction from a lazy heap; ``capacity`` in tokens."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.free = list(range(capacity, 0, -1)) if capacity is not None else []
        self.minted = capacity or 0
        self.clock = 0
        self.root = Edge([], [], None, 0)
        self.root.lock = 1
        self.heap: list[tuple[int, int, Edge]] = []  # (last access, tie, leaf); stale ones skipped
        self.ties = 0

    def offer(self, node: Edge) -> None:
        if not node.children and not node.lock and node is not self.root:
            self.ties += 1
            heapq.heappush(self.heap, (node.last, self.ties, node))

    def walk(self, key: list[int], node: Edge | None = None, i: int = 0,
             path: list[Edge] | None = None) -> tuple[Edge, int]:
        """Follow ``key[i:]`` from ``node`` (the root, touched) touching every node; split the
        edge the walk stops inside. Returns (last node, tokens matched)."""
        if node is None:
            node = self.root
            self.clock += 1
            node.last = self.clock
        n = len(key)
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                break
            self.clock += 1
            child.last = self.clock
            edge = child.key
            m = len(edge)
            if key[i : i + m] == edge:
                j = m
            else:
                j = 1
                top = min(m, n - i)
                while j < top and edge[j] == key[i + j]:
                    j += 1
                child = self.split(child, j)
            if path is not None:
                path.append(child)
            i += j
            node = child
            if j < m:
                break
        self.offer(node)
        return node, i

    def split(self, child: Edge, at: int) -> Edge:
        self.clock += 1
        head = Edge(child.key[:at], child.slots[:at], child.parent, self.clock)
        head.lock = child.lock
        child.parent.children[child.key[0]] = head
        head.children[child.key[at]] = child
        child.parent = head
        child.key = child.key[at:]
        child.slots = child.slots[at:]
        self.offer(child)
        return head

    def lock_path(self, node: Edge, delta: int) -> None:
        while node is not self.root:
            node.lock += delta
            if not node.lock:
                self.offer(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        freed = 0
        while freed < num_tokens and self.heap:
            last, _, leaf = heapq.heappop(self.heap)
            if last != leaf.last or leaf.children or leaf.lock or not leaf.alive:
                continue  # touched, grown or locked since it was offered
            leaf.alive = False
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.free += leaf.slots
            freed += len(leaf.key)
            self.offer(parent)
        return freed

    def alloc(self, n: int) -> list[int]:
        if len(self.free) < n:
            fresh = n - len(self.free)
            self.free += range(self.minted + 1, self.minted + fresh + 1)
            self.minted += fresh
        out = self.free[len(self.free) - n :]
        del self.free[len(self.free) - n :]
        return out


def as_lists(requests: Iterable) -> list[tuple[list[int], list[int]]]:
    """(prompt, prompt + output) of each request as lists of ints: the plain trees' input, made
    before a timed replay (parsing is not the replay's)."""
    out = []
    for r in requests:
        prompt = r.prompt.tolist()
        out.append((prompt, prompt + r.output.tolist()))
    return out


def replay_edge(requests: list[tuple[list[int], list[int]]], tree: EdgeRadix,
                checkpoint: bool = False) -> tuple[list[int], list[int]]:
    """replay.py's loop over `EdgeRadix` on `as_lists` input; the insert walks the matched path
    again. ``checkpoint``: SGLang 0.5.23's rule (`RadixCache.checkpoint`): after the insert, the
    prompt is inserted again (a walk that cuts the new leaf at the prompt's end) and the whole
    sequence looked up (a walk), as the plain tree would do it, walking from the root."""
    hits, evicted = [], []
    for prompt, seq in requests:
        if tree.capacity is not None and len(seq) > tree.capacity:
            hits.append(0)
            evicted.append(0)
            continue
        node, hit = tree.walk(prompt) if prompt else (tree.root, 0)
        tree.lock_path(node, +1)
        need = len(seq) - hit
        ev = 0
        if tree.capacity is not None and len(tree.free) < need:
            ev = tree.evict(need - len(tree.free))
        fresh = tree.alloc(need)
        end, present = tree.walk(seq)
        if present < len(seq):
            tree.clock += 1
            leaf = Edge(seq[present:], fresh[present - hit :], end, tree.clock)
            end.children[seq[present]] = leaf
            tree.offer(leaf)
        tree.free += fresh[: present - hit]
        if checkpoint:
            if 0 < len(prompt) < len(seq):
                tree.walk(prompt)
            if seq:
                tree.walk(seq)
        tree.lock_path(node, -1)
        hits.append(hit)
        evicted.append(ev)
    return hits, evicted


# ------------------------------------------------------------------------- SGLang's own
def load_sglang(cache_dir: Path = SGLANG_CACHE):
    """SGLang 0.4.10's modules from the unpacked wheel in ``cache_dir``
    (`experiments.validation.sglang.wheel.load`), or None when it is not there (`python -m
    experiments.validation.sglang --release 0.4.10 --quick` fetches it; the benchmark never
    downloads)."""
    root = cache_dir / "src"
    if not (root / "sglang/srt/mem_cache/radix_cache.py").exists():
        return None
    from experiments.validation.sglang.wheel import load

    return load(root, "0.4.10")


def replay_sglang(sgl, requests: Iterable, capacity: int) -> tuple[list[int], list[int]]:
    """replay.py's calls on SGLang's ``RadixCache`` (page size 1): ``match_prefix`` of the whole
    prompt, ``inc_lock_ref``, ``evict`` of the shortfall, new slots from `PagedSlots`,
    ``insert`` of prompt + output, the duplicates freed, ``dec_lock_ref``. Tokens evicted are read
    off ``evictable_size``."""
    import torch
    from experiments.validation.sglang.tree_serving import PagedSlots

    alloc = PagedSlots(capacity, 1)
    tree = sgl.radix.RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                page_size=1, disable=False)
    hits, evicted = [], []
    for r in requests:
        prompt = r.prompt.tolist()
        seq = prompt + r.output.tolist()
        if len(seq) > capacity:
            hits.append(0)
            evicted.append(0)
            continue
        match = tree.match_prefix(key=prompt)
        prefix, node = match.device_indices, match.last_device_node
        tree.inc_lock_ref(node)
        hit, need = len(prefix), len(seq) - len(prefix)
        before = tree.evictable_size()
        if alloc.available_size() < need:
            tree.evict(need - alloc.available_size())
        evicted.append(before - tree.evictable_size())
        value = torch.cat([prefix, alloc.alloc_extend(hit, len(seq))])
        present = tree.insert(seq, value)
        alloc.free(value[hit:present])
        tree.dec_lock_ref(node)
        hits.append(hit)
    return hits, evicted
