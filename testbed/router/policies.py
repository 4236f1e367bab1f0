"""Routing policies: round robin, random, least load, SGLang's cache-aware router, and an oracle.

Decision reasons (``Router.decisions``): ``round_robin``, ``random``, ``load`` (least loaded);
for ``cache_aware`` and ``oracle``: ``balance`` (the imbalance rule sent it to the least loaded
worker), ``cache`` (the best prefix match was above ``cache_threshold``), ``low_match`` (it was
not: least loaded, or smallest tree with ``fallback=smallest_tree``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from testbed.cache.base import PrefixCache
from testbed.cache.block_hash import BlockHashCache
from testbed.cache.none import NoCache
from testbed.cache.radix import RadixCache, common_prefix_length
from testbed.errors import BadInput, check_choice
from testbed.router.approx_tree import ApproxTree
from testbed.router.base import LOAD_UNITS, TIE_BREAKS, Router, is_imbalanced, least_loaded

FALLBACKS = ("least_load", "smallest_tree")


class RoundRobin(Router):
    name = "round_robin"

    def bind(self, num_workers: int, caches: Sequence[PrefixCache] = ()) -> None:
        super().bind(num_workers, caches)
        self._next = 0

    def _choose(self, tokens, loads, now):
        up = loads.up()
        for _ in range(self.num_workers):  # the next one in rotation (all: the next one)
            worker = self._next
            self._next = (self._next + 1) % self.num_workers
            if up is None or worker in up:
                break
        return worker, "round_robin"


class RandomRouter(Router):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = seed

    def bind(self, num_workers: int, caches: Sequence[PrefixCache] = ()) -> None:
        super().bind(num_workers, caches)
        self._rng = np.random.default_rng(self.seed)

    def _choose(self, tokens, loads, now):
        up = loads.up()
        if up is None:
            return int(self._rng.integers(self.num_workers)), "random"
        return up[int(self._rng.integers(len(up)))], "random"


def _least(router: Router, load, among) -> int:
    """`least_loaded` with the router's ``tie_break``."""
    sent = router.requests_sent if router.tie_break == "fewest_sent" else None
    return least_loaded(load, among, sent)


def _set_balance(router: Router, cache_threshold: float, abs_threshold: float,
                 rel_threshold: float, load: str, tie_break: str) -> None:
    """Check and set what `CacheAware` and `Oracle` share: the match rate a cached prefix must
    beat (``cache_threshold``), when loads count as imbalanced (``balance_*``), what load is, and
    how a tie of loads is broken (``tie_break``, `testbed.router.base.TIE_BREAKS`)."""
    check_choice("router.tie_break", tie_break, TIE_BREAKS)
    router.tie_break = tie_break
    if not 0.0 <= cache_threshold <= 1.0:
        raise BadInput(f"router.cache_threshold must be in [0, 1], got {cache_threshold}")
    if abs_threshold < 0:
        raise BadInput(f"router.balance_abs_threshold must be >= 0, got {abs_threshold}")
    if rel_threshold < 1:
        raise BadInput(f"router.balance_rel_threshold must be >= 1, got {rel_threshold}")
    check_choice("router.load", load, LOAD_UNITS)
    router.cache_threshold = cache_threshold
    router.balance_abs_threshold = abs_threshold
    router.balance_rel_threshold = rel_threshold
    router.load = load


class LeastLoad(Router):
    """The worker with the fewest outstanding tokens (or requests)."""

    name = "least_load"

    def __init__(self, load: str = "tokens") -> None:
        super().__init__()
        check_choice("router.load", load, LOAD_UNITS)
        self.load = load

    def _choose(self, tokens, loads, now):
        return least_loaded(loads.of(self.load), loads.up()), "load"


class CacheAware(Router):
    """SGLang's cache-aware router (sgl-router ``cache_aware``) over an `ApproxTree`.

    For each request: if the workers' loads are imbalanced (`is_imbalanced`), the least loaded
    worker; else, with ``rate`` = the longest believed prefix match / prompt length, the worker
    with that match if ``rate > cache_threshold`` (ties: the least loaded), otherwise the least
    loaded worker (``fallback=smallest_tree``: the one with the smallest tree, SGLang's choice).
    The prompt is then inserted into the chosen worker's part of the tree, whatever the reason.

    Pruning: every ``eviction_interval_s`` of virtual time (checked when a request is routed),
    each worker's part is cut to ``max_tree_size`` tokens, least recently touched leaves first
    (``eviction_interval_s=0``: the chosen worker right after each insert, a hard cap).

    Lazy updates (``update_on_complete``): ``update_delay_s`` after a worker finishes a request,
    its prompt + output is inserted into that worker's part (an aborted request teaches
    nothing). This refreshes the prompt's recency and adds the output, which the worker's real
    cache now holds (all but its last token), so a chat's next turn (prompt = this prompt +
    output + new question) matches in full. That is our addition: SGLang's router inserts only
    at routing time (``update_on_complete=false`` does the same). Nothing is ever removed except
    by pruning: evictions in the real caches stay invisible to the tree.
    """

    name = "cache_aware"
    wants_completions = True

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: float = 64,
                 balance_rel_threshold: float = 1.5, load: str = "requests",
                 fallback: str = "least_load", max_tree_size: int | None = None,
                 eviction_interval_s: float = 120.0, update_on_complete: bool = True,
                 update_delay_s: float = 0.0, tie_break: str = "index") -> None:
        super().__init__()
        _set_balance(self, cache_threshold, balance_abs_threshold, balance_rel_threshold, load,
                     tie_break)
        check_choice("router.fallback", fallback, FALLBACKS)
        if max_tree_size is not None and max_tree_size < 0:
            raise BadInput(f"router.max_tree_size must be >= 0 or null, got {max_tree_size}")
        if eviction_interval_s < 0:
            raise BadInput(f"router.eviction_interval_s must be >= 0, got {eviction_interval_s}")
        if update_delay_s < 0:
            raise BadInput(f"router.update_delay_s must be >= 0, got {update_delay_s}")
        self.fallback = fallback
        self.max_tree_size = max_tree_size
        self.eviction_interval_s = eviction_interval_s
        self.update_on_complete = update_on_complete
        self.wants_completions = update_on_complete
        self.update_delay_s = update_delay_s

    def bind(self, num_workers: int, caches: Sequence[PrefixCache] = ()) -> None:
        super().bind(num_workers, caches)
        self.tree = ApproxTree(num_workers)
        self._last_prune = 0.0

    def _choose(self, tokens, loads, now):
        load, up = loads.of(self.load), loads.up()
        among = range(self.num_workers) if up is None else up
        self._maybe_prune(now)
        if is_imbalanced(load, self.balance_abs_threshold, self.balance_rel_threshold, up):
            worker, why = _least(self, load, up), "balance"
        else:
            lengths = self.tree.match(tokens)
            best = max(lengths[w] for w in among)
            if len(tokens) and best / len(tokens) > self.cache_threshold:
                worker = _least(self, load, [w for w in among if lengths[w] == best])
                why = "cache"
            elif self.fallback == "smallest_tree":
                worker = min(among, key=lambda w: (self.tree.size[w], w))
                why = "low_match"
            else:
                worker, why = _least(self, load, up), "low_match"
        self._insert(tokens, worker)
        return worker, why

    def on_complete(self, worker, prompt, output, now):
        if self.update_on_complete and output is not None:
            self._insert(np.concatenate([prompt, np.asarray(output, dtype=prompt.dtype)]), worker)

    def forget_worker(self, worker: int) -> None:
        """SGLang's router drops a removed worker's tenant from its tree; so does this."""
        self.tree.remove_worker(worker)

    def _insert(self, tokens: np.ndarray, worker: int) -> None:
        self.tree.insert(tokens, worker)
        if self.max_tree_size is not None and self.eviction_interval_s == 0:
            self.tree.prune(self.max_tree_size, [worker])

    def _maybe_prune(self, now: float) -> None:
        if self.max_tree_size is None or self.eviction_interval_s == 0:
            return
        if now - self._last_prune >= self.eviction_interval_s:
            self.tree.prune(self.max_tree_size)
            self._last_prune = now

    def info(self) -> dict[str, Any]:
        return {"tree_tokens": list(self.tree.size), "tree_nodes": self.tree.num_nodes,
                "pruned_tokens": self.tree.pruned_tokens, "max_tree_size": self.max_tree_size}


def peek_match(cache: PrefixCache, tokens: np.ndarray, limit: int | None = None) -> int:
    """The hit ``cache.acquire(tokens, limit)`` would get now, without touching the cache (no
    recency refresh, no edge split): what a perfectly informed router may ask."""
    if limit is not None:
        tokens = tokens[:limit]
    if isinstance(cache, RadixCache):
        page = cache.page_size
        key = tokens[: len(tokens) - len(tokens) % page]
        node, matched = cache.root, 0
        while matched < len(key):
            child = node.children.get(cache._child_key(key, matched))
            if child is None:
                break
            k = common_prefix_length(child.key, key[matched:])
            k -= k % page
            matched += k
            if k < len(child.key):
                break
            node = child
        return matched
    if isinstance(cache, BlockHashCache):
        return len(cache._lookup(cache.block_keys(tokens), len(tokens))) * cache.block_size
    if isinstance(cache, NoCache):
        return 0
    raise BadInput(f"router=oracle cannot read a {type(cache).__name__}; "
                   "use cache=radix, block_hash or none")


class Oracle(Router):
    """Perfect information: what each worker really holds or is about to compute.

    A worker's hit for a prompt is the longer of what its real cache holds now (asked without
    touching it: `peek_match`) and the longest common prefix with a prompt routed to it and not
    yet finished (queued or running there: it will be cached by the time this request is
    admitted), at most ``len(prompt) - 1`` as the scheduler's own lookup. Then `CacheAware`'s
    rules with those hits instead of the approximate tree: the imbalance rule first (the same
    thresholds as ``cache_aware`` by default), then the longest hit if it covers more than
    ``cache_threshold`` of the prompt (ties: least loaded), otherwise the least loaded worker.
    ``cache_threshold`` is 0 by default (any real hit counts): with 0.5, a conversation whose
    history was partly evicted would be sent to the least loaded worker and lose the part that
    is left, which ``cache_aware``'s optimistic tree keeps by sending it back. A heuristic with
    perfect information, to measure what the tree's approximation costs; neither deployable nor a
    bound: routing changes what later requests find (an earlier study's 8-replica chat had it
    below ``cache_aware``; docs/results/routing.md has today's figures).
    """

    name = "oracle"
    wants_completions = True

    def __init__(self, cache_threshold: float = 0.0, balance_abs_threshold: float = 64,
                 balance_rel_threshold: float = 1.5, load: str = "requests",
                 in_flight: bool = True, tie_break: str = "index") -> None:
        super().__init__()
        _set_balance(self, cache_threshold, balance_abs_threshold, balance_rel_threshold, load,
                     tie_break)
        self.in_flight = in_flight

    def bind(self, num_workers: int, caches: Sequence[PrefixCache] = ()) -> None:
        super().bind(num_workers, caches)
        if len(caches) != num_workers:
            raise ValueError(f"router=oracle needs every replica's cache: got {len(caches)} "
                             f"for {num_workers} replicas")
        self.caches = list(caches)
        # per worker: first token -> prompts routed there and not finished
        self._pending: list[dict[int, list[np.ndarray]]] = [{} for _ in range(num_workers)]

    def held(self, tokens: np.ndarray, limit: int) -> list[int]:
        """Every worker's cached prefix of ``tokens`` (at most ``limit``), from its real cache."""
        return [peek_match(c, tokens, limit) for c in self.caches]

    def hits(self, tokens: np.ndarray) -> list[int]:
        """Every worker's hit for a prompt ``tokens`` (see the class docstring)."""
        limit = max(len(tokens) - 1, 0)
        lengths = self.held(tokens, limit)
        if self.in_flight and limit:
            for w, pending in enumerate(self._pending):
                for p in pending.get(int(tokens[0]), ()):
                    lengths[w] = max(lengths[w], min(common_prefix_length(p, tokens), limit))
        return lengths

    def _choose(self, tokens, loads, now):
        load, up = loads.of(self.load), loads.up()
        among = range(self.num_workers) if up is None else up
        if is_imbalanced(load, self.balance_abs_threshold, self.balance_rel_threshold, up):
            worker, why = _least(self, load, up), "balance"
        else:
            lengths = self.hits(tokens)
            best = max(lengths[w] for w in among)
            if best > 0 and best / len(tokens) > self.cache_threshold:
                worker = _least(self, load, [w for w in among if lengths[w] == best])
                why = "cache"
            else:
                worker, why = _least(self, load, up), "low_match"
        if len(tokens):
            self._pending[worker].setdefault(int(tokens[0]), []).append(tokens)
        return worker, why

    def on_complete(self, worker, prompt, output, now):
        if not len(prompt):
            return
        bucket = self._pending[worker].get(int(prompt[0]), [])
        for i, p in enumerate(bucket):  # the very array routed; an equal one otherwise
            if p is prompt:
                break
        else:
            i = next((i for i, p in enumerate(bucket) if np.array_equal(p, prompt)), None)
            if i is None:
                raise RuntimeError(f"oracle: worker {worker} finished a request never routed to it")
        bucket.pop(i)
        if not bucket:
            del self._pending[worker][int(prompt[0])]

    def info(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight}
