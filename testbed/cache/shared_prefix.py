"""Which running requests share a cached prefix, read off the radix tree (for cascade decoding).

Requests whose leases lock nodes under a common node share the KV of the path down to it: the
same slots, computed once. A decode step can read such a prefix once for all of them
(`testbed.engine.cascade`). Choosing the groups is a question about the tree, answered here from
the leases the scheduler already holds; nothing is scheduled differently.

Grouping: each request belongs to at most one group, at one node on its path; a group of ``n``
requests at a node ``P`` tokens deep saves ``(n - 1) · P`` KV reads. `shared_prefix_groups`
maximises the total saving exactly, by one pass over the nodes the leases reach (deepest first):
a node either groups every request under it, or leaves them to its children's best groups.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from testbed.cache.base import Lease


def _path_end(node: Any) -> int:
    """Tokens from the root to the end of ``node`` (a radix `TreeNode`)."""
    return node.start + node.size


def shared_prefix_groups(leases: Sequence[Lease | None], min_tokens: int = 1,
                         pays: Callable[[int, int], bool] | None = None
                         ) -> list[tuple[int, list[int]]]:
    """Disjoint groups ``(prefix tokens, indices into leases)`` of two or more leases whose
    cached prefixes share that many tokens (the same KV slots), chosen to save the most reads.

    Only radix-tree leases count (their ``handle`` is a tree node ending where the lease's cached
    slots end); None and other leases join no group. Groups share at least ``min_tokens``, and
    only at a node where ``pays(sharers, tokens)`` (None: every node): a node that does not pay
    leaves its leases to its children.
    """
    under: dict[Any, list[int]] = {}  # node -> leases at or below it, in lease order
    for i, lease in enumerate(leases):
        node = getattr(lease, "handle", None)
        if node is None or not hasattr(node, "parent") or node.parent is None \
                or _path_end(node) != lease.cached:
            continue
        while node.parent is not None:  # up to (not including) the root
            under.setdefault(node, []).append(i)
            node = node.parent
    children: dict[Any, list[Any]] = {node: [] for node in under}
    tops: list[Any] = []
    for node in under:
        (children[node.parent] if node.parent in under else tops).append(node)

    def gain(node: Any) -> int:  # reads saved by grouping every lease under node there
        end = _path_end(node)
        n = len(under[node])
        return (n - 1) * end if end >= min_tokens and (pays is None or pays(n, end)) else 0

    best: dict[Any, int] = {}
    for node in sorted(under, key=_path_end, reverse=True):  # children before their parents
        best[node] = max(gain(node), sum(best[c] for c in children[node]))
    groups: list[tuple[int, list[int]]] = []
    stack = list(reversed(tops))
    while stack:
        node = stack.pop()
        if gain(node) > 0 and gain(node) >= best[node]:
            groups.append((_path_end(node), sorted(under[node])))
        else:
            stack += reversed(children[node])
    return sorted(groups, key=lambda g: g[1][0])
