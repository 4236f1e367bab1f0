"""The cache-aware router's approximate tree: which prefixes probably live on which worker.

One radix tree over token sequences shared by all workers (SGLang's router keeps one tree over
request text with a tenant per worker; here tokens, tenant = worker index). Each node records, per
worker, when that worker last had the node's path routed to it or reported it; a worker is on a
node only if it is on the node's parent too (insert stamps the whole path, pruning removes a
worker from its deepest nodes first), so a worker's matched length is the depth of the deepest
node on the query's path that carries it.

Nothing here knows about the real caches: the tree is what the router *believes*, built from its
own routing decisions (and lazy reports of finished requests), kept bounded by pruning each worker
to a size cap, least recently used first. Sizes are counted in tokens (SGLang counts characters).

Recency is a logical clock that ticks once per insert, so runs are deterministic.
"""

from __future__ import annotations

import heapq
from itertools import count
from typing import Iterator

import numpy as np

from testbed.cache.radix import common_prefix_length
from testbed.cache.tree_node import descendants

_EMPTY = np.zeros(0, dtype=np.int32)


class _Node:
    __slots__ = ("parent", "children", "key", "workers")

    def __init__(self, parent: "_Node | None", key: np.ndarray) -> None:
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.key = key
        self.workers: dict[int, int] = {}  # worker -> logical time it last touched this node


class ApproxTree:
    """Per-worker prefix sets in one radix tree, with per-worker token counts and LRU pruning.

    >>> t = ApproxTree(num_workers=2)
    >>> t.insert(np.array([1, 2, 3, 4]), worker=0); t.insert(np.array([1, 2, 9]), worker=1)
    >>> t.match(np.array([1, 2, 3, 7]))
    [3, 2]
    >>> t.size
    [4, 3]
    """

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"replicas must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.root = _Node(None, _EMPTY)
        self.size = [0] * num_workers  # tokens of the tree each worker is believed to hold
        self.pruned_tokens = 0
        self._clock = 0
        self._num_nodes = 1

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, the root included."""
        return self._num_nodes

    # ---------------------------------------------------------------- queries
    def match(self, tokens: np.ndarray) -> list[int]:
        """For each worker, the length of the longest prefix of ``tokens`` it is believed to hold.
        A pure query: recency is refreshed by `insert`, which the router calls for its choice."""
        lengths = [0] * self.num_workers
        node, matched, n = self.root, 0, len(tokens)
        while matched < n:
            child = node.children.get(int(tokens[matched]))
            if child is None:
                break
            k = common_prefix_length(child.key, tokens[matched:])
            for w in child.workers:
                lengths[w] = matched + k  # deeper nodes overwrite: their workers are a subset
            if k < len(child.key):
                break
            matched += k
            node = child
        return lengths

    # ---------------------------------------------------------------- updates
    def insert(self, tokens: np.ndarray, worker: int) -> None:
        """Record that ``worker`` holds ``tokens``: every node on the path gets the worker with
        the current time (splitting the edge the path ends inside), a new leaf takes the rest."""
        self._clock += 1
        now = self._clock
        node, matched, n = self.root, 0, len(tokens)
        while matched < n:
            child = node.children.get(int(tokens[matched]))
            if child is None:
                leaf = _Node(node, np.array(tokens[matched:], copy=True))
                leaf.workers[worker] = now
                node.children[int(tokens[matched])] = leaf
                self._num_nodes += 1
                self.size[worker] += n - matched
                return
            k = common_prefix_length(child.key, tokens[matched:])
            if k < len(child.key):
                child = self._split(child, k)
            if worker not in child.workers:
                self.size[worker] += len(child.key)
            child.workers[worker] = now
            matched += k
            node = child

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` after ``at`` tokens; the new head keeps the same workers and times (so no
        worker's size changes). Returns the head."""
        head = _Node(node.parent, node.key[:at])
        head.workers = dict(node.workers)
        node.parent.children[int(node.key[0])] = head
        node.key = node.key[at:]
        node.parent = head
        head.children[int(node.key[0])] = node
        self._num_nodes += 1
        return head

    def prune(self, max_size: int, workers: list[int] | None = None) -> int:
        """Shrink every worker in ``workers`` (default: all) to at most ``max_size`` tokens by
        removing it from its least recently touched leaves (nodes carrying it where no child
        does), whole nodes at a time; a node no worker carries is deleted. Returns the tokens
        removed."""
        over = [w for w in (range(self.num_workers) if workers is None else workers)
                if self.size[w] > max_size]
        if not over:
            return 0
        heaps: dict[int, list[tuple[int, int, _Node]]] = {w: [] for w in over}
        tie = count()
        for node in self._nodes():
            below = set().union(*(c.workers for c in node.children.values()))
            for w in node.workers:
                if w in heaps and w not in below:
                    heaps[w].append((node.workers[w], next(tie), node))
        removed = 0
        for w, heap in heaps.items():
            heapq.heapify(heap)
            while self.size[w] > max_size and heap:
                _, _, node = heapq.heappop(heap)
                del node.workers[w]
                self.size[w] -= len(node.key)
                removed += len(node.key)
                parent = node.parent
                if not node.workers:
                    del parent.children[int(node.key[0])]
                    self._num_nodes -= 1
                if parent is not self.root and w in parent.workers and not any(
                        w in c.workers for c in parent.children.values()):
                    heapq.heappush(heap, (parent.workers[w], next(tie), parent))
        self.pruned_tokens += removed
        return removed

    # ---------------------------------------------------------------- exact removals
    def remove_below(self, tokens: np.ndarray, keep: int, worker: int,
                     branch: bool = True) -> bool:
        """``worker`` no longer holds what continues ``tokens[:keep]`` along ``tokens``.

        With ``branch``, ``tokens`` is the whole path of a leaf of its cache evicted whole
        (``keep``: where the leaf began): the worker loses the leaf's tokens except those it
        still holds through another branch. At pages of P tokens a sibling leaf may share up to
        P - 1 tokens of the leaf's first page (the cache keys children by their first page, the
        index by their first token), so the worker comes off the path only below the deepest
        point at or after ``keep`` where it holds another branch. Without ``branch`` (a leaf cut
        back to ``tokens[:keep]``) every continuation of ``tokens[:keep]`` goes. Nodes left to
        nobody are deleted; the edge ``keep`` falls inside is split first. False (nothing
        changed) when ``worker`` does not hold ``tokens[:keep]`` (with ``branch``: the whole
        leaf): the caller's picture of the worker is then out of step."""
        if keep > len(tokens) or branch and keep == len(tokens):
            return False
        need = len(tokens) if branch else keep
        if self.match(tokens[:need])[worker] < need:
            return False
        node, matched = self.root, 0
        while matched < keep:
            child = node.children[int(tokens[matched])]
            k = min(len(child.key), keep - matched)
            if k < len(child.key):
                child = self._split(child, k)
            matched += k
            node = child
        if not branch:
            for top in list(node.children.values()):
                self._drop(top, worker)
            return True
        top = None
        while matched < need:  # the worker holds the path to its end: whole edges
            child = node.children[int(tokens[matched])]
            if top is None or any(worker in c.workers for c in node.children.values()
                                  if c is not child):
                top = child
            matched += len(child.key)
            node = child
        self._drop(top, worker)
        return True

    def remove_worker(self, worker: int) -> None:
        """Forget everything ``worker`` was believed to hold."""
        for top in list(self.root.children.values()):
            self._drop(top, worker)

    def _drop(self, top: _Node, worker: int) -> None:
        """Take ``worker`` off ``top`` and every node below it; delete nodes left to nobody."""
        stack = [top]
        while stack:
            node = stack.pop()
            if worker not in node.workers:
                continue  # closed upward: nobody below carries it either
            del node.workers[worker]
            self.size[worker] -= len(node.key)
            if node.workers:
                stack.extend(node.children.values())
                continue
            # nobody else is on it, so nobody else below it (closed upward): all of it goes
            below = list(descendants(node))
            self.size[worker] -= sum(len(n.key) for n in below)
            del node.parent.children[int(node.key[0])]
            self._num_nodes -= 1 + len(below)

    def sequences(self, worker: int) -> set[tuple[int, ...]]:
        """The longest sequences ``worker`` holds (its nodes no child of which it is on), as
        token tuples: two workers hold the same prefixes exactly when these sets are equal."""
        out = set()
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self.root, ())]
        while stack:
            node, path = stack.pop()
            below = [(c, path + tuple(int(t) for t in c.key)) for c in node.children.values()
                     if worker in c.workers]
            if not below and node is not self.root:
                out.add(path)
            stack.extend(below)
        return out

    # ---------------------------------------------------------------- checks
    def _nodes(self) -> Iterator[_Node]:
        return descendants(self.root)

    def recount(self, worker: int) -> int:
        """``worker``'s size counted from scratch (tests compare it with `size`)."""
        return sum(len(n.key) for n in self._nodes() if worker in n.workers)

    def check_invariants(self) -> None:
        """Raise AssertionError unless sizes match a recount, every node carries a worker, every
        worker on a node is on its parent too, and children are keyed by their first token."""
        nodes = 1
        for node in self._nodes():
            nodes += 1
            assert node.workers, "a node no worker carries should have been deleted"
            assert len(node.key) > 0
            assert node.parent.children[int(node.key[0])] is node
            if node.parent is not self.root:
                assert set(node.workers) <= set(node.parent.workers), "worker set not closed upward"
        assert nodes == self._num_nodes
        for w in range(self.num_workers):
            assert self.size[w] == self.recount(w), f"worker {w}: size {self.size[w]} != recount"
