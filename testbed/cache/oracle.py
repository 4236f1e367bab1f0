"""The oracle eviction policy: Belady's rule on the radix tree, an upper bound, not deployable.

It knows every future prompt. A cached node is next used by the first future request whose prompt
runs into the node (starts with the tokens leading to it plus its first token); the oracle evicts
the leaf whose next use is farthest away, never-used-again leaves first (ties by LRU). Because
only prompts are matched, a request's own output counts as a future use only through a later
prompt. "Now" is the position in the workload's arrival order of the request using the cache:
exact in replay; in the simulator, where calls wait for dependencies, it is the order requests
arrive at the cache.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Sequence

import numpy as np

from testbed.cache.eviction import EVICTION, EntryStats, EvictionPolicy, Requester


class _FutureNode:
    __slots__ = ("key", "children", "users")

    def __init__(self, key: np.ndarray, users: list[int]) -> None:
        self.key = key
        self.children: dict[int, _FutureNode] = {}
        self.users = users  # indices of the requests whose prompt passes through, ascending


class FutureIndex:
    """Every prompt of a workload in one radix tree; each node lists the requests through it."""

    def __init__(self, prompts: Sequence[np.ndarray]) -> None:
        self.root = _FutureNode(np.zeros(0, dtype=np.int32), [])
        for i, prompt in enumerate(prompts):
            self._add(np.asarray(prompt), i)

    def _add(self, key: np.ndarray, index: int) -> None:
        node, at = self.root, 0
        while at < len(key):
            child = node.children.get(int(key[at]))
            if child is None:
                node.children[int(key[at])] = _FutureNode(key[at:].copy(), [index])
                return
            n = _lcp(child.key, key[at:])
            if n < len(child.key):  # split: the head carries the same users so far
                head = _FutureNode(child.key[:n], list(child.users))
                child.key = child.key[n:]
                head.children[int(child.key[0])] = child
                node.children[int(key[at])] = head
                child = head
            child.users.append(index)
            at += n
            node = child

    def locate(self, path: np.ndarray) -> _FutureNode | None:
        """The node holding the last token of ``path``, or None if no prompt starts with it."""
        node, at = self.root, 0
        while at < len(path):
            child = node.children.get(int(path[at]))
            if child is None:
                return None
            n = _lcp(child.key, path[at:])
            if n < min(len(child.key), len(path) - at):
                return None
            at += n
            node = child
        return node


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = a[:n] != b[:n]
    i = int(differ.argmax()) if n else 0
    return i if n and differ[i] else n


@EVICTION.register("oracle")
class Oracle(EvictionPolicy):
    name = "oracle"
    # A leaf is queued with its next use as of then. Each use touches the node and queues it
    # anew, so in replay (requests in order) the queued value is current; in the simulator "now"
    # can pass a next use that never touched the node (calls arrive out of list order), and a
    # queued leaf then ranks by that earlier next use until it is queued again.
    priority_drifts = True

    def __init__(self, requests: Sequence[Any]) -> None:
        self.index = FutureIndex([r.prompt for r in requests])
        self.position = {r.id: i for i, r in enumerate(requests)}
        self.now = -1
        self._located: dict[int, tuple[int, _FutureNode | None]] = {}

    def on_access(self, requester: Requester | None) -> None:
        if requester is not None and requester.request_id in self.position:
            self.now = self.position[requester.request_id]

    def next_use(self, entry: EntryStats) -> float:
        """Index of the next request that will use ``entry`` (inf if none)."""
        cached = self._located.get(entry.id)
        if cached is None or cached[0] != entry.start:  # a split moved the node's start
            cached = (entry.start, self.index.locate(_path_into(entry)))
            self._located[entry.id] = cached
        future = cached[1]
        if future is None:
            return math.inf
        i = bisect.bisect_right(future.users, self.now)
        return future.users[i] if i < len(future.users) else math.inf

    def priority(self, entry: EntryStats) -> Any:
        return (-self.next_use(entry), entry.last_access)

    def on_evict(self, entry: EntryStats, key: Any) -> None:
        self._located.pop(entry.id, None)


def _path_into(node: Any) -> np.ndarray:
    """The tokens from the root to ``node``'s first token (a radix `TreeNode`)."""
    parts = [node.key[:1]]
    parent = node.parent
    while parent is not None and parent.parent is not None:
        parts.append(parent.key)
        parent = parent.parent
    return np.concatenate(parts[::-1])
