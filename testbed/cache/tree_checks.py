"""Consistency checks of the radix trees (``debug.check_invariants``, the tests): what
`RadixCache` and `TieredRadixCache` keep incrementally (token counts, node count, candidate
heaps, slot ownership, the tiers' children counts), recounted from the nodes.

The checks read the trees only through their public views (``root``, ``nodes()``, the size
properties, ``pool``, ``eviction.queued``), so they import neither tree.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import numpy as np

from testbed.cache.base import Lease
from testbed.cache.eviction import EvictionPolicy, queued_as_valued
from testbed.cache.pool import KVSlotPool
from testbed.cache.tier_state import LowerTier
from testbed.cache.token_runs import TOKEN_BYTES
from testbed.cache.tree_node import TreeNode


class CheckedTree(Protocol):
    """What the checks read of a radix tree (`testbed.cache.radix.RadixCache`)."""

    root: TreeNode
    pool: KVSlotPool
    policy: EvictionPolicy
    page_size: int
    evictable_size: int
    protected_size: int
    num_nodes: int
    eviction: object  # `LeafEviction` (``queued()``) or `TierEviction` (``queued(t)``)

    def nodes(self) -> Iterable[TreeNode]: ...


class CheckedTieredTree(CheckedTree, Protocol):
    """What the checks read besides of a tiered tree (`testbed.cache.tiers.TieredRadixCache`)."""

    tiers: list[LowerTier | None]
    ntiers: int

    def top(self, node: TreeNode) -> int: ...


def check_lease(tree: CheckedTree, lease: Lease) -> np.ndarray:
    """Assert the lease's page layout; returns the slots it owns."""
    assert lease.cached % tree.page_size == 0, f"cached prefix not page-aligned: {lease!r}"
    assert len(lease.spare) == -lease.num_tokens % tree.page_size, \
        f"spare slots do not fill the last page: {lease!r}"
    owned = lease.owned
    tree.pool.assert_whole_pages(owned)
    return owned


def _check_place(tree: CheckedTree, node: TreeNode) -> None:
    """``node`` is alive, page-aligned, locked no more than its parent and keyed in it."""
    assert node.alive, f"dead node in tree: {node!r}"
    size = len(node.key)
    assert size > 0 and size % tree.page_size == 0, f"bad node size {node!r}"
    assert node.lock_ref >= 0, f"negative lock: {node!r}"
    assert node.parent is tree.root or node.parent.lock_ref >= node.lock_ref, node
    assert node.start == node.parent.start + len(node.parent.key), f"bad start: {node!r}"
    assert node.parent.children.get(node.kb[: tree.page_size * TOKEN_BYTES]) is node, node


def check_radix_tree(tree: CheckedTree, leases: Iterable[Lease] = ()) -> None:
    """Raise AssertionError unless the tree is consistent: the counts and the candidate heap
    agree with the nodes, every slot is free xor owned by one node or one lease (its spare
    slots included), and node slots and lease-owned slots are whole pages."""
    evictable = protected = 0
    owned = [check_lease(tree, lease) for lease in leases]
    queued = tree.eviction.queued()
    nodes = list(tree.nodes())
    for node in nodes:
        _check_place(tree, node)
        assert len(node.key) == len(node.slots), node
        tree.pool.assert_whole_pages(node.slots)
        if node.lock_ref:
            protected += len(node.key)
        else:
            evictable += len(node.key)
            if not node.children:
                assert queued_as_valued(tree.policy, queued, node), \
                    f"evictable leaf without a current heap entry: {node!r}"
        owned.append(node.slots)
    _check_counts(tree, evictable, protected, len(nodes))
    tree.pool.check_ownership(owned)


def check_tiered_tree(tree: CheckedTieredTree, leases: Iterable[Lease] = ()) -> None:
    """Raise AssertionError unless the tiered tree is consistent: `check_radix_tree`'s checks
    (GPU tokens only), plus every node held by some tier, GPU residency prefix-closed, each copy
    as long as its node, each tier's slots owned once, children counts and every tier's candidate
    heap current."""
    evictable = protected = 0
    owned = [check_lease(tree, lease) for lease in leases]
    lower_owned: list[list[np.ndarray]] = [[] for _ in range(tree.ntiers)]
    policies = [tree.policy] + [tier.policy for tier in tree.tiers[1:]]
    queued = [tree.eviction.queued(t) for t in range(tree.ntiers)]
    nodes = list(tree.nodes())
    kids: dict[int, list[int]] = {node.id: [0] * tree.ntiers for node in [tree.root, *nodes]}
    for node in nodes:
        _check_place(tree, node)
        size = len(node.key)
        assert len(node.slots) in (0, size), f"partly on the GPU: {node!r}"
        tree.pool.assert_whole_pages(node.slots)
        assert not len(node.slots) or node.parent is tree.root or len(node.parent.slots), \
            f"on the GPU under a parent that is not: {node!r}"
        for t in range(1, tree.ntiers):
            copy = node.tier.copies[t]
            if copy is not None:
                assert len(copy) == size, f"{tree.tiers[t].name} copy of {len(copy)}: {node!r}"
                tree.tiers[t].pool.assert_whole_pages(copy)
                lower_owned[t].append(copy)
        top = tree.top(node)
        assert top >= 0, f"held by no tier: {node!r}"
        kids[node.parent.id][top] += 1
        if node.lock_ref:
            protected += len(node.slots)
        else:
            evictable += len(node.slots)
        if tree.eviction.is_candidate(node, top):
            assert queued_as_valued(policies[top], queued[top], node), \
                f"tier {top} candidate without a current heap entry: {node!r}"
        owned.append(node.slots)
    for node in [tree.root, *nodes]:
        assert node.tier.kids == kids[node.id], f"children counts {node.tier.kids} != " \
            f"{kids[node.id]}: {node!r}"
    _check_counts(tree, evictable, protected, len(nodes))
    tree.pool.check_ownership(owned)
    for t in range(1, tree.ntiers):
        tree.tiers[t].pool.check_ownership(lower_owned[t])


def _check_counts(tree: CheckedTree, evictable: int, protected: int, nodes: int) -> None:
    assert evictable == tree.evictable_size, \
        f"evictable {tree.evictable_size} != recount {evictable}"
    assert protected == tree.protected_size, \
        f"protected {tree.protected_size} != recount {protected}"
    assert tree.num_nodes == 1 + nodes, f"{tree.num_nodes} nodes counted, {1 + nodes} in the tree"
