"""A node of the radix tree (`testbed.cache.radix`): a run of tokens, their KV slots, the lock
count and the statistics eviction policies read (`testbed.cache.eviction.EntryStats`).

Kept apart from the tree so that what reads nodes (the tree's eviction, the tiers' state, the
scheduler's and router's walks, views) needs no part of the tree itself.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Iterator, Mapping

import numpy as np

from testbed.cache.eviction import Requester
from testbed.cache.token_runs import TOKEN_BYTES, TOKEN_DTYPE


#: a leaf's children: one read-only empty mapping shared by every leaf (a dict each would be a
#: fifth of a replayed tree's memory); the tree gives a node a dict of its own with its first
#: child (`own_children`)
NO_CHILDREN: Mapping[bytes, "TreeNode"] = MappingProxyType({})


def own_children(node: "TreeNode") -> dict[bytes, "TreeNode"]:
    """``node``'s children as a dict it owns, to add a child to (made with its first)."""
    kids = node.children
    if kids is NO_CHILDREN:
        kids = node.children = {}
    return kids


class TreeNode:
    """A run of tokens and their KV slots; the path from the root spells the cached sequence.

    ``kb`` holds the tokens as bytes; ``key`` shows them as a (read-only) token array."""

    __slots__ = (
        "id", "parent", "children", "kb", "slots", "lock_ref", "last_access", "access_count",
        "created", "start", "priority", "category", "offer", "alive", "tier", "hits", "history",
    )

    def __init__(self, node_id: int, parent: "TreeNode | None", kb: bytes, slots: np.ndarray,
                 clock: int, start: int = 0, requester: Requester | None = None) -> None:
        self.id = node_id
        self.parent = parent
        self.children: Mapping[bytes, TreeNode] = NO_CHILDREN  # a dict once it has any
        self.kb = kb
        self.slots = slots
        self.lock_ref = 0
        self.last_access = clock
        self.access_count = 1
        self.hits = 0  # SGLang 0.5.23's hit_count: inserts through the node (`RadixTree.insert`)
        self.history = 0  # T-LRU only: deepest sequence cached through the node (tokens)
        self.created = clock
        self.start = start  # tokens on the path before this node
        self.priority = requester.priority if requester else 0
        self.category = requester.category if requester else None
        self.offer = 0  # version of the node's latest eviction-heap entry
        self.alive = True
        self.tier = None  # where lower tiers hold copies (testbed.cache.tiers); None without them

    @property
    def key(self) -> np.ndarray:
        return np.frombuffer(self.kb, TOKEN_DTYPE)

    @property
    def size(self) -> int:
        return len(self.kb) // TOKEN_BYTES

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, tokens={self.size}, lock={self.lock_ref}, "
                f"t={self.last_access}, children={len(self.children)})")


def descendants(node: Any) -> Iterator[Any]:
    """Every node under ``node`` (not itself), parents before children: a radix tree's
    `TreeNode`s, a router's approximate tree's nodes (anything whose ``children`` is a mapping)."""
    stack = list(node.children.values())
    while stack:
        below = stack.pop()
        yield below
        stack.extend(below.children.values())


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    i = int(differ.argmax())
    return i if differ[i] else n
