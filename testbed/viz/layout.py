"""A tidy tree layout (after Reingold and Tilford, 1981), small enough to read in one sitting.

Rules: a node is drawn one level below its parent; siblings keep their order left to right;
each subtree is placed as far left as its *contour* (its leftmost and rightmost node on every
level) allows, at least ``sep`` from everything placed on the same levels before it; a parent is
centred over its first and last child. Subtrees never overlap, identical subtrees are drawn
identically, and a narrow subtree can tuck in under a wide neighbour's shallow part.
Cost: O(nodes × depth); no recursion, so long chains (a chat session's turns) are fine.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)


def postorder(children: Mapping[K, Sequence[K]], root: K) -> list[K]:
    """Every node reachable from ``root``, children before their parent."""
    out: list[K] = []
    stack = [root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(children.get(node, ()))
    out.reverse()
    return out


def tidy_layout(children: Mapping[K, Sequence[K]], root: K,
                sep: float = 1.0) -> dict[K, tuple[float, int]]:
    """``{node: (x, depth)}`` for every node reachable from ``root`` (depth 0); the leftmost node
    has x = 0. ``children`` maps a node to its children in left-to-right order."""
    offset: dict[K, float] = {}  # a child's x relative to its parent's
    contour: dict[K, list[tuple[float, float]]] = {}  # per level from the node down, relative x
    for node in postorder(children, root):
        kids = children.get(node, ())
        if not kids:
            contour[node] = [(0.0, 0.0)]
            continue
        merged: list[list[float]] = []  # [left, right] per level of the kids placed so far
        placed: list[float] = []
        for kid in kids:
            shape = contour.pop(kid)
            x = 0.0
            if merged:
                common = range(min(len(merged), len(shape)))
                x = max(merged[d][1] + sep - shape[d][0] for d in common)
            placed.append(x)
            for d, (left, right) in enumerate(shape):
                if d < len(merged):
                    merged[d][1] = right + x  # to the right of all before it on this level
                else:
                    merged.append([left + x, right + x])
        middle = (placed[0] + placed[-1]) / 2
        for kid, x in zip(kids, placed):
            offset[kid] = x - middle
        contour[node] = [(0.0, 0.0)] + [(left - middle, right - middle) for left, right in merged]
    positions: dict[K, tuple[float, int]] = {root: (0.0, 0)}
    stack = [root]
    while stack:
        node = stack.pop()
        x, depth = positions[node]
        for kid in children.get(node, ()):
            positions[kid] = (x + offset[kid], depth + 1)
            stack.append(kid)
    shift = min(x for x, _ in positions.values())
    return {node: (x - shift, depth) for node, (x, depth) in positions.items()}
