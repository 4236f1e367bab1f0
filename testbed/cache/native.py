"""The replay's hot loops (`testbed.cache.radix_replay`, `LeafEviction.evict`) in C where the
extension `testbed.cache._radix_core` is built, else in Python; both do exactly the same.

Four pieces carry most of a replayed request's time, each a few attribute reads and writes per
tree node: the match's walk down the tree (`match`), the ticks and counts its path takes
(`touch`), the two nodes a request adds under SGLang 0.5.23's rules (`cut_leaf`), and LRU's
offer and eviction of whole leaves (`offer_lru`, `evict_lru`). `make setup` (``pip install -e .``) builds the extension where a C
compiler is found; where it is not, or ``TESTBED_NATIVE=0`` is set, the Python loops below run
instead, with every hit, eviction and node statistic the same (tests/test_native.py runs both
on the same requests). `NATIVE` says which is in use.

The C code reads and writes `TreeNode`'s slots at their offsets, found once from the class
(`bind`), and takes only `TreeNode`s: a node of any other class raises TypeError.
"""

from __future__ import annotations

import os
from typing import Iterator

from testbed.cache.eviction import Requester
from testbed.cache.token_runs import TOKEN_BYTES
from testbed.cache.tree_node import NO_CHILDREN, TreeNode, own_children

try:
    import testbed.cache._radix_core as _radix_core
except ImportError:  # not built (no compiler at setup): the Python loops below
    _radix_core = None

if os.environ.get("TESTBED_NATIVE", "1") == "0" or TOKEN_BYTES != 4:  # (the C code's token)
    _radix_core = None
if _radix_core is not None:
    try:
        _radix_core.bind(TreeNode, NO_CHILDREN)
    except TypeError as e:  # TreeNode's fields changed: the C code must learn them first
        raise ImportError(f"{e}: update testbed/cache/_radix_core.c's slot list and rebuild it "
                          "(make setup), or run the Python loops with TESTBED_NATIVE=0") from e

#: whether the C loops run (False: the extension is not built, or TESTBED_NATIVE=0)
NATIVE = _radix_core is not None


def match_py(root: TreeNode, kb: bytes, end: int) -> tuple[list[TreeNode], int, TreeNode | None]:
    """Walk ``kb[:end]`` (token bytes, page size 1) down from ``root``, touching nothing: (the
    nodes whose whole edge matched, bytes matched, the child the walk stopped inside or None)."""
    node = root
    path: list[TreeNode] = []
    at = 0
    while at < end:
        child = node.children.get(kb[at : at + TOKEN_BYTES])
        if child is None:
            break
        edge = child.kb
        if not kb.startswith(edge, at, end):
            return path, at, child
        at += len(edge)
        path.append(child)
        node = child
    return path, at, None


def touch_py(root: TreeNode, path: list[TreeNode], last: list[TreeNode], tick: int,
             urgent: int | None) -> int:
    """The last of a replayed request's walks, whose ticks stand: ``root`` at ``tick``, then each
    node of ``path`` one tick after the one before it, with one more match and insert hit, then
    each of ``last`` one tick later again (time only); ``urgent`` (None: none) lowers the root's
    and the path's priorities to it. Returns the last tick."""
    root.last_access = tick
    if urgent is not None and urgent < root.priority:
        root.priority = urgent
    for x in path:
        tick += 1
        x.last_access = tick
        x.access_count += 1
        x.hits += 1
        if urgent is not None and urgent < x.priority:
            x.priority = urgent
    for x in last:
        tick += 1
        x.last_access = tick
    return tick


def cut_leaf_py(ids: Iterator[int], node: TreeNode, kb: bytes, at: int, cut: int,
                head_slots, leaf_slots, head_tick: int, leaf_tick: int,
                requester: Requester | None, prompt_priority: int) -> list[TreeNode]:
    """The new tokens ``kb[at:]`` under ``node`` as two nodes cut at byte ``cut`` (what SGLang
    0.5.23's prompt insert leaves of one new leaf): the leaf ``kb[cut:]`` (its id drawn first
    from ``ids``, made at ``leaf_tick``) below the head ``kb[at:cut]`` (made at ``head_tick``),
    each with the requester's statistics and one insert hit, the head the more urgent of its
    priority and ``prompt_priority``. Returns [head, leaf]."""
    leaf = TreeNode(next(ids), None, kb[cut:], leaf_slots, leaf_tick, cut // TOKEN_BYTES,
                    requester)
    head = TreeNode(next(ids), node, kb[at:cut], head_slots, head_tick, at // TOKEN_BYTES,
                    requester)
    leaf.parent = head
    leaf.hits = head.hits = 1
    if prompt_priority < head.priority:
        head.priority = prompt_priority
    head.children = {kb[cut : cut + TOKEN_BYTES]: leaf}
    own_children(node)[kb[at : at + TOKEN_BYTES]] = head
    return [head, leaf]


match = _radix_core.match if NATIVE else match_py
touch = _radix_core.touch if NATIVE else touch_py
cut_leaf = _radix_core.cut_leaf if NATIVE else cut_leaf_py
#: `LeafEviction.offer` and `evict` under LRU over whole leaves of page size 1, without hooks,
#: called as ``(eviction, tree, root, node)`` and ``(eviction, tree, root, num_tokens)``; None:
#: the methods' own Python
offer_lru = _radix_core.offer_lru if NATIVE else None
evict_lru = _radix_core.evict_lru if NATIVE else None
