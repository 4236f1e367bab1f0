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
    # per level of the node's subtree, relative x, the deepest level first: a node with one child
    # takes over the child's list and appends its own level (a chain is linear, not quadratic)
    contour: dict[K, list[tuple[float, float]]] = {}
    for node in postorder(children, root):
        kids = children.get(node, ())
        if not kids:
            contour[node] = [(0.0, 0.0)]
            continue
        if len(kids) == 1:  # centred over its one child: the child's contour, one level more
            offset[kids[0]] = 0.0
            shape = contour.pop(kids[0])
            shape.append((0.0, 0.0))
            contour[node] = shape
            continue
        merged: list[list[float]] = []  # [left, right] per level of the kids placed so far
        placed: list[float] = []
        for kid in kids:
            shape = contour.pop(kid)[::-1]  # from the kid's own level down
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
        contour[node] = [(left - middle, right - middle) for left, right in reversed(merged)]
        contour[node].append((0.0, 0.0))
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
