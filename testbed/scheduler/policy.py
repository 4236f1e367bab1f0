"""Queue policies: in which order waiting requests are considered for the next prefill batch.

- ``fcfs``: submission order;
- ``lpm``: longest cached prefix first (SGLang's longest-prefix-match), FCFS among equals; falls
  back to FCFS when more than ``lpm_fallback_threshold`` requests wait (matching all is too slow);
- ``dfs_weight``: SGLang's DFS-weight order over the radix tree: at each node, visit the child
  subtrees holding more waiting requests first, then the requests whose match ends at the node;
- ``random``: a seeded shuffle; ``lof``: longest output first.

Cache-aware policies (lpm, dfs_weight) also apply SGLang's in-batch prefix caching: a request with
at most ``check_threshold`` tokens cached whose prefix shares at least ``deprioritize_threshold``
tokens with an earlier waiting request is deferred for this step, so the shared prefix is computed
once and then hit. A policy that needs a capability the cache lacks degrades to FCFS (lpm with
``cache=none``; dfs_weight without a radix tree).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from testbed.cache.base import PrefixCache
from testbed.cache.pool import SLOT_DTYPE
from testbed.cache.radix import RadixCache, TreeNode
from testbed.scheduler.request_state import Req

POLICIES = ("fcfs", "lpm", "dfs_weight", "random", "lof")


@dataclass
class Ordering:
    queue: list[Req]  # in the order to try
    deferred: set[int]  # ids (id()) of requests that sit this step out


class QueuePolicy:
    def __init__(self, name: str, cache: PrefixCache, rng: np.random.Generator,
                 lpm_fallback_threshold: int = 128, in_batch_prefix_caching: bool = True,
                 check_threshold: int = 32, deprioritize_threshold: int = 32) -> None:
        if name not in POLICIES:
            raise ValueError(f"scheduler must be one of {', '.join(POLICIES)}; got {name!r}")
        self.name = name
        self.cache = cache
        self.rng = rng
        self.lpm_fallback_threshold = lpm_fallback_threshold
        self.in_batch = in_batch_prefix_caching and cache.name != "none"
        self.check_threshold = check_threshold
        self.deprioritize_threshold = deprioritize_threshold

    def effective(self, num_waiting: int) -> str:
        """The policy actually applied with this many requests waiting."""
        if self.name == "lpm" and (self.cache.name == "none" or num_waiting > self.lpm_fallback_threshold):
            return "fcfs"
        if self.name == "dfs_weight" and not isinstance(self.cache, RadixCache):
            return "fcfs"
        return self.name

    def order(self, waiting: list[Req]) -> Ordering:
        """``waiting`` must be in submission (``seq``) order, which is FCFS."""
        fcfs = list(waiting)
        name = self.effective(len(waiting))
        if name == "fcfs":
            return Ordering(fcfs, set())
        if name == "random":
            return Ordering([fcfs[i] for i in self.rng.permutation(len(fcfs))], set())
        if name == "lof":
            return Ordering(sorted(fcfs, key=lambda r: -r.remaining_new_tokens), set())
        # Cache-aware: match every waiting request (as SGLang does, this counts as an access).
        keys = [r.fill()[: r.fill_len - 1] for r in fcfs]
        if name == "lpm":
            hits = [self.cache.match(r.fill(), limit=r.fill_len - 1, requester=r.requester)
                    for r in fcfs]
            deferred = self._in_batch_deferrals(fcfs, keys, hits)
            order = sorted(range(len(fcfs)), key=lambda i: -hits[i])
            return Ordering([fcfs[i] for i in order], deferred)
        matches = [self.cache.match_prefix(k, r.requester) for k, r in zip(keys, fcfs)]  # radix
        deferred = self._in_batch_deferrals(fcfs, keys, [m[0] for m in matches])
        return Ordering(dfs_weight_order(self.cache.root, fcfs, [m[1] for m in matches]), deferred)

    def _in_batch_deferrals(self, reqs: list[Req], keys: list[np.ndarray], hits: list[int]) -> set[int]:
        if not self.in_batch:
            return set()
        pending = RadixCache(capacity=None)  # prefixes earlier waiting requests will compute
        deferred = set()
        for req, key, hit in zip(reqs, keys, hits):
            if hit > self.check_threshold:
                continue
            shared, _, _ = pending.match_prefix(key)
            if shared >= self.deprioritize_threshold:
                deferred.add(id(req))
            else:
                pending.insert(key, np.zeros(len(key), dtype=SLOT_DTYPE))
        return deferred


def dfs_weight_order(root: TreeNode, reqs: list[Req], last_nodes: list[TreeNode]) -> list[Req]:
    """SGLang's DFS-weight order: a node's weight is the number of waiting requests whose match
    ends in its subtree; children are visited heaviest first (ties in tree order), and a node's
    own requests follow its subtrees. Only nodes on some request's path are visited."""
    at_node: dict[int, list[Req]] = {}
    weight: dict[int, int] = {}
    for req, node in zip(reqs, last_nodes):
        at_node.setdefault(node.id, []).append(req)
        while node is not None:
            weight[node.id] = weight.get(node.id, 0) + 1
            node = node.parent
    out: list[Req] = []
    stack: list[tuple[TreeNode, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out += at_node.get(node.id, [])
            continue
        stack.append((node, True))
        children = [c for c in node.children.values() if c.id in weight]
        children.sort(key=lambda c: -weight[c.id])
        stack += [(c, False) for c in reversed(children)]
    return out
