"""The radix-tree prefix cache: SGLang's RadixCache, exact to docs/design.md §4.

`RadixCache` is the `PrefixCache` lifecycle of requests (`acquire`, `extend`, `release`,
`commit`, SGLang's names) on the tree of `testbed.cache.radix_tree` (token runs, walks, locks and
the eviction it owns; `TreeNode` in `testbed.cache.tree_node`, both re-exported here).

With ``page_size`` P > 1 the KV pool hands out whole pages (SGLang's paged allocator): a running
request holds ``ceil(len/P)`` pages, its last page's unused slots as ``lease.spare``, which `extend`
fills before taking a new page; `release` caches the whole pages of a finished sequence and returns
its unaligned tail page to the pool.

`replay_one` serves one request of the replay backend in a single pass (page size 1): the match,
the eviction, the insert and the unlock of `acquire`/`extend`/`release` with the same effects,
touching the matched path a second time where the insert's walk would, without building a lease.

``sglang`` (the run's ``scheduler.sglang``) picks the release whose insert rule `release` and
`commit` follow: under ``0.5.23`` (the default) every insert of a request is SGLang 0.5.23's
``RadixCache.checkpoint`` (`checkpoint_walks`); under ``0.4.10`` the insert alone.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from testbed.cache.base import EMPTY_SLOTS, Lease, PrefixCache, Released
from testbed.cache.eviction import Requester
from testbed.cache.radix_tree import SPLIT_RECENCY, RadixTree  # noqa: F401 (re-exported)
from testbed.cache.token_runs import TOKEN_BYTES, joined_bytes
from testbed.cache.tree_checks import check_radix_tree
from testbed.cache.tree_node import TreeNode, common_prefix_length  # noqa: F401 (re-exported)
from testbed.errors import BadInput

#: the SGLang releases whose rules the radix cache and the scheduler follow, default first
SGLANG_RELEASES = ("0.5.23", "0.4.10")


class RadixCache(RadixTree, PrefixCache):
    """Radix tree over token sequences with ref-counted locks and policy-ordered leaf eviction,
    serving requests as a `PrefixCache` (constructor: `RadixTree`).

    ``capacity`` is the KV pool size in tokens (None: unbounded), rounded down to whole pages.
    ``page_size > 1`` matches, splits, inserts, allocates and evicts only whole pages.
    ``evict_unit``: ``"node"`` frees whole leaves (SGLang), ``"page"`` only the tail pages needed.
    """

    name = "radix"

    def __init__(self, *args, sglang: str = SGLANG_RELEASES[0], **kwargs) -> None:
        if sglang not in SGLANG_RELEASES:
            raise BadInput(f"scheduler.sglang must be one of {', '.join(SGLANG_RELEASES)}; "
                           f"got {sglang!r}")
        super().__init__(*args, **kwargs)
        self.sglang = sglang
        self._checkpoints = sglang != "0.4.10"  # 0.5.23's insert rule (module docstring)

    def fits(self, num_tokens: int) -> bool:
        return self.pool.capacity is None or self.pool.round_up(num_tokens) <= self.pool.capacity

    # ---------------------------------------------------------------- PrefixCache lifecycle
    def match(self, tokens: np.ndarray, limit: int | None = None,
              requester: Requester | None = None) -> int:
        # A look-up: recency refreshed as SGLang's match_prefix does; no hit, no policy access.
        return self.match_prefix(tokens if limit is None else tokens[:limit], requester,
                                 lookup=True)[0]

    @property
    def available_size(self) -> float:
        return math.inf if self.pool.unbounded else self.pool.num_free + self._evictable

    def acquire(self, prompt: np.ndarray, limit: int | None = None,
                requester: Requester | None = None) -> Lease:
        self.policy.on_access(requester)
        hit, node, slots = self.match_prefix(prompt if limit is None else prompt[:limit], requester)
        self.lock(node)
        return Lease(hit=hit, handle=node, slots=slots, requester=requester, prompt=len(prompt))

    def extend(self, lease: Lease, num_tokens: int) -> int | None:
        """Add ``num_tokens`` slots: the lease's spare ones first, then whole new pages."""
        cost = self.extension_cost(lease, num_tokens)
        evicted = 0
        if not self.pool.can_alloc(cost):
            # Every unlocked token can go (locks cover whole root paths, so no unlocked node sits
            # above a locked one): decide before evicting anything.
            if self.pool.num_free + self._evictable < cost:
                return None
            evicted = self.evict(cost - self.pool.num_free)
        lease.grow(num_tokens, self.pool.alloc(cost))
        return evicted

    def release(self, lease: Lease, tokens: np.ndarray, insert: bool = True) -> Released:
        if insert and len(tokens) > lease.num_tokens:
            raise ValueError(f"release: {len(tokens)} tokens for a lease of {lease.num_tokens} slots")
        present = lease.cached
        slots = lease.slots
        if insert:
            present = self.insert(tokens, slots[: len(tokens)], lease.requester, lease.inserted)
            if self._checkpoints:
                self.checkpoint_walks(tokens, slots, lease.prompt, lease.requester)
            # The tree owned slots[:cached] all along; slots[cached:present] duplicate KV cached
            # meanwhile (whole pages: both ends are aligned); the unaligned tail (page_size > 1)
            # was not inserted, and with the spare slots it makes up the last page.
            self.pool.free(slots[lease.cached : present])
            self.pool.free(np.concatenate([slots[self._aligned(len(tokens)) :], lease.spare]))
        else:
            self.pool.free(lease.owned)
        self.unlock(lease.handle)
        lease.reset(EMPTY_SLOTS, 0)
        return Released(inserted=insert, already_cached=present)

    def replay_one(self, prompt: np.ndarray, output: np.ndarray,
                   requester: Requester | None = None) -> tuple[int, int, bool, dict | None]:
        """`PrefixCache.replay_one` in one pass (page size 1, no lower tiers): the calls of
        `acquire`, `extend` and `release` with the same effects on the tree, the pool and the
        policy, in the same order. The insert's walk passes the locked matched path again (every
        node touched anew, as `insert` does) and goes on from its end; the new leaf takes its slots
        straight from the allocation."""
        if self.page_size != 1 or self.lower_tiers:
            return super().replay_one(prompt, output, requester)
        kb = joined_bytes(prompt, output)
        n = len(kb) // TOKEN_BYTES
        pool = self.pool
        if pool.capacity is not None and n > pool.capacity:
            return 0, 0, False, None
        if self._on_access is not None:
            self._on_access(requester)
        path: list[TreeNode] = []
        node, at = (self._walk(kb, len(prompt) * TOKEN_BYTES, requester, True, path)
                    if len(prompt) else (self.root, 0))
        hit = at // TOKEN_BYTES
        need = n - hit
        evicted = 0
        # The lock matters only while evicting: without eviction, locking and unlocking the path
        # change nothing (its nodes but the last have children, so unlocking offers none of them;
        # the last one is offered at the end of the insert's walk instead, by then unlocked).
        locked = not pool.can_alloc(need)
        if locked:
            self.lock(node)
            if pool.num_free + self._evictable < need:
                raise RuntimeError(f"radix: no room for {n} tokens although they fit")
            evicted = self.evict(need - pool.num_free)
        fresh = pool.alloc(need)
        # The insert's walk: the root and the matched path touched again, then on from its end.
        urgent = requester.priority if requester is not None else None
        clock = self._clock
        clock += 1
        self.root.last_access = clock
        if urgent is not None and urgent < self.root.priority:
            self.root.priority = urgent
        for x in path:
            clock += 1
            x.last_access = clock
            if urgent is not None and urgent < x.priority:
                x.priority = urgent
            x.hits += 1  # the insert's hit (SGLang 0.5.23's ``hit_count``)
        self._clock = clock
        if at < len(kb) and kb[at : at + TOKEN_BYTES] in node.children:
            end, at = self._descend(node, kb, at, len(kb), requester, False, [], 0)
        else:  # the usual case: nothing cached beyond the hit (`_descend` would only offer it)
            end = node
            self.eviction.offer(node)
        present = at // TOKEN_BYTES
        if present < n:
            self._add_leaf(end, kb[at:], fresh[present - hit :], present, requester)
        if present > hit:
            pool.free(fresh[: present - hit])  # output tokens cached meanwhile: duplicates
        if self._checkpoints:  # `checkpoint_walks` on the bytes at hand (page size 1)
            if 0 < len(prompt) < n:
                self._walk(kb, len(prompt) * TOKEN_BYTES, prompt_requester(requester), False, [],
                           len(prompt) * TOKEN_BYTES)
            if n:
                self._walk(kb, len(kb), None, False, [])
        if locked:
            self.unlock(node)
        return hit, evicted, True, None

    def commit(self, lease: Lease, tokens: np.ndarray) -> None:
        if len(tokens) > lease.num_tokens:
            raise ValueError(f"commit: {len(tokens)} tokens for a lease of {lease.num_tokens} slots")
        slots = lease.slots
        present = self.insert(tokens, slots[: len(tokens)], lease.requester, lease.inserted)
        lease.inserted = max(lease.inserted, self._aligned(len(tokens)))
        self.pool.free(slots[lease.cached : present])
        if self._checkpoints:  # checkpoint's prompt insert comes before its look-up (below)
            self.reinsert_prompt(tokens, slots, lease.prompt, lease.requester)
        # now all cached; re-matched as SGLang's cache_unfinished_req does (a look-up, not a hit)
        n, node, cached_slots = self.match_prefix(tokens, lease.requester, lookup=True)
        self.lock(node)
        self.unlock(lease.handle)
        lease.handle = node
        # The unaligned tail (n is page-aligned) and the spare slots stay the request's.
        lease.reset(np.concatenate([cached_slots, slots[n:]]), cached=n, spare=lease.spare)

    # ---------------------------------------------------------------- SGLang 0.5.23's checkpoint
    def checkpoint_walks(self, tokens: np.ndarray, slots: np.ndarray, prompt_len: int,
                         requester: Requester | None) -> None:
        """What SGLang 0.5.23's ``RadixCache.checkpoint`` does after inserting ``tokens`` (a
        finishing request's, through ``release_kv_cache``): `reinsert_prompt`, then
        ``match_prefix`` of the whole key (a look-up: recency only), whose node it relocks."""
        self.reinsert_prompt(tokens, slots, prompt_len, requester)
        self.match_prefix(tokens, requester, lookup=True)

    def reinsert_prompt(self, tokens: np.ndarray, slots: np.ndarray, prompt_len: int,
                        requester: Requester | None) -> None:
        """``_insert_cache(split_prompt=True)``: when the request's prompt (its first
        ``prompt_len`` tokens, SGLang's ``origin_input_ids``) ends, page-aligned, inside the key
        just inserted, insert it again: its walk splits the node at the prompt's end (so the
        output can be evicted without the prompt), touches the prompt's path and gives it the
        priority of a request one more urgent (SGLang's ``priority + 1``; ours counts down),
        counting no hit (``inserted_len`` is the prompt's length)."""
        p = self._aligned(prompt_len)
        if 0 < p < self._aligned(len(tokens)):
            self.insert(tokens[:p], slots[:p], prompt_requester(requester), inserted=p)

    def check_invariants(self, leases: Iterable[Lease] = ()) -> None:
        """Besides the counts and heap: every slot is free xor owned by one node or one lease
        (its spare slots included), and node slots and lease-owned slots are whole pages
        (`testbed.cache.tree_checks.check_radix_tree`)."""
        check_radix_tree(self, leases)


def prompt_requester(requester: Requester | None) -> Requester:
    """Who re-inserts a prompt (`RadixCache.reinsert_prompt`): the request, one more urgent
    (SGLang: ``req.priority or 0``, plus one)."""
    if requester is None:
        return Requester(None, -1, None)
    return requester._replace(priority=requester.priority - 1)
