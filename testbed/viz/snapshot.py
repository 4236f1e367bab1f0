"""Replaying a workload through the radix cache and taking pictures of its tree (`Panel`s).

The tree is read only through the cache's public views (`RadixCache.root`, `RadixCache.nodes()` and
the `TreeNode` fields), after each request served by `testbed.backends.replay.replay`, so what is
drawn is exactly what the replay backend leaves behind. Node ids are stable: a split gives the head
a new id and the tail keeps the old node, so a node id missing from one walk to the next was
evicted. An evicted `TreeNode` keeps its fields (its tokens, last access, parent) as they were when
it left; a panel shows every node evicted since the previous panel as a *ghost* where it was, under
its old parent (the tail, if that parent was split since: the ghost hung below its end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from testbed.cache.radix import RadixCache, TreeNode
from testbed.errors import BadInput
from testbed.backends.replay import replay
from testbed.workloads.request import Request

STATES = ("new", "accessed", "unchanged", "evicted")


@dataclass(frozen=True)
class NodeView:
    """One node of a panel. ``state`` compares it with the previous panel: ``new`` (created
    since, a split's head included), ``accessed`` (its last access is later), ``unchanged``, or
    ``evicted`` (a ghost: left the tree since). The root has ``parent`` None and no tokens."""

    id: int
    parent: int | None
    tokens: tuple[int, ...]
    lock_ref: int
    last_access: int
    state: str

    @property
    def size(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Panel:
    """The tree after the first ``served`` requests, with what happened since the previous panel:
    the requests served (``request_ids``), their prompt and hit tokens, the tokens evicted for them.
    ``nodes`` lists the root first, then parents before children; siblings ordered by first token,
    ghosts after a live sibling with the same one. ``cached_tokens`` counts the live nodes' tokens,
    ``capacity`` is the KV pool's (None: unbounded)."""

    served: int
    request_ids: tuple[str, ...]
    prompt_tokens: int
    hit_tokens: int
    evicted_tokens: int
    cached_tokens: int
    capacity: int | None
    nodes: tuple[NodeView, ...]

    def children(self) -> dict[int, list[int]]:
        """Node id -> its children's ids, in drawing order (every node has an entry)."""
        kids: dict[int, list[int]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            if n.parent is not None:
                kids[n.parent].append(n.id)
        return kids


def parse_steps(at: Sequence[int], num_requests: int) -> list[int]:
    """The panels' request counts, sorted and without repeats; each in 0 .. ``num_requests``."""
    for n in at:
        if n < 0 or n > num_requests:
            raise BadInput(f"--at {n} is outside 0..{num_requests} (the workload has "
                           f"{num_requests} requests; N draws the tree after the first N)")
    if not at:
        raise BadInput("--at needs at least one request count")
    return sorted(set(at))


def live_nodes(cache: RadixCache) -> dict[int, TreeNode]:
    return {node.id: node for node in cache.nodes()}


def replay_panels(requests: Sequence[Request], cache: RadixCache, at: Sequence[int]) -> list[Panel]:
    """Serve ``requests`` in order through ``cache`` with the replay backend's rules and return
    the tree after the first N requests for each N in ``at`` (0: before any)."""
    steps = parse_steps(at, len(requests))
    panels: list[Panel] = []
    live: dict[int, TreeNode] = live_nodes(cache)
    seen_ids: set[int] = set(live)  # live at the previous panel
    seen_clock = _clock(cache, live.values())
    served = 0
    for target in steps:
        ghosts: dict[int, TreeNode] = {}
        ids: list[str] = []
        prompt = hit = evicted = 0
        while served < target:
            request = requests[served]
            record = replay([request], cache)[0]
            now = live_nodes(cache)
            ghosts.update((i, node) for i, node in live.items() if i not in now)
            live = now
            served += 1
            ids.append(request.id)
            prompt += record.prompt_tokens
            hit += record.cached_tokens
            evicted += record.evicted_tokens
        panels.append(Panel(
            served=served, request_ids=tuple(ids), prompt_tokens=prompt, hit_tokens=hit,
            evicted_tokens=evicted, cached_tokens=sum(n.size for n in live.values()),
            capacity=cache.pool.capacity,
            nodes=_views(cache, live, ghosts, seen_ids, seen_clock)))
        seen_ids, seen_clock = set(live), _clock(cache, live.values())
    return panels


def _clock(cache: RadixCache, nodes) -> int:
    """The latest access so far (the root is touched by every walk): a node whose last access is
    later than this at the next panel was accessed in between."""
    return max([cache.root.last_access, *(n.last_access for n in nodes)])


def _views(cache: RadixCache, live: dict[int, TreeNode], ghosts: dict[int, TreeNode],
           seen_ids: set[int], seen_clock: int) -> tuple[NodeView, ...]:
    root = cache.root
    kids: dict[int, list[tuple[tuple, TreeNode]]] = {root.id: []}
    for group, table in ((0, live), (1, ghosts)):
        for node in table.values():
            parent = node.parent  # live, or a ghost itself: only leaves are evicted
            while parent is not root and parent.id not in live and parent.id not in ghosts:
                parent = parent.parent  # a safeguard: in replay a parent is seen alive first
            order = (int(node.key[0]), group, node.id)
            kids.setdefault(parent.id, []).append((order, node))
    views = [NodeView(root.id, None, (), root.lock_ref, root.last_access, "unchanged")]
    stack = [root]
    while stack:
        parent = stack.pop()
        children = [node for _, node in sorted(kids.get(parent.id, []), key=lambda e: e[0])]
        for node in children:
            if node.id in ghosts:
                state = "evicted"
            elif node.id not in seen_ids:
                state = "new"
            else:
                state = "accessed" if node.last_access > seen_clock else "unchanged"
            views.append(NodeView(node.id, parent.id, tuple(int(t) for t in node.key),
                                  node.lock_ref, node.last_access, state))
        stack.extend(reversed(children))
    return tuple(views)


def outline(panel: Panel, max_tokens: int | None = None, details: bool = False) -> str:
    """The panel's tree as indented text, one node a line: ``size [tokens]``, `` evicted`` for a
    ghost; with ``details`` also its lock count and last access. ``max_tokens`` shortens the
    token lists (None: all)."""
    kids = panel.children()
    by_id = {n.id: n for n in panel.nodes}
    lines = ["root"]
    stack = [(child, 1) for child in reversed(kids[panel.nodes[0].id])]
    while stack:
        node_id, depth = stack.pop()
        node = by_id[node_id]
        line = f"{'  ' * depth}{node.size} [{shorten(node.tokens, max_tokens)}]"
        if details:
            line += f" lock {node.lock_ref} t {node.last_access}"
        if node.state == "evicted":
            line += " evicted"
        lines.append(line)
        stack.extend((child, depth + 1) for child in reversed(kids[node_id]))
    return "\n".join(lines)


def shorten(tokens: Sequence[int], max_tokens: int | None, max_chars: int | None = None) -> str:
    """``1 2 3 …``: the first ``max_tokens`` ids (None: all), fewer if they would take more than
    ``max_chars`` characters with the ellipsis (at least one id), an ellipsis for the rest."""
    shown = list(map(str, tokens if max_tokens is None else tokens[:max_tokens]))

    def text() -> str:
        return " ".join(shown) + (" …" if len(shown) < len(tokens) else "")

    while max_chars is not None and len(shown) > 1 and len(text()) > max_chars:
        shown.pop()
    return text()
