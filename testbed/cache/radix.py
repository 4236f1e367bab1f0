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
from testbed.cache.leaf_eviction import LeafEviction
from testbed.cache.pool import KVSlotPool
from testbed.cache.radix_replay import prompt_requester, replay_fast, replay_walking
from testbed.cache.radix_tree import SPLIT_RECENCY, RadixTree  # noqa: F401 (re-exported)
from testbed.cache.slot_count import SlotCount
from testbed.cache.token_runs import TOKEN_BYTES, TOKEN_DTYPE, as_bytes, joined_bytes
from testbed.cache.tree_checks import check_radix_tree
from testbed.cache.tree_node import TreeNode, common_prefix_length  # noqa: F401 (re-exported)
from testbed.errors import check_choice

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
        check_choice("scheduler.sglang", sglang, SGLANG_RELEASES)
        super().__init__(*args, **kwargs)
        self.sglang = sglang
        self._checkpoints = sglang != "0.4.10"  # 0.5.23's insert rule (module docstring)
        # `replay_one` in one walk: where no hook of the policy (nor a subclass's leaf hook or
        # eviction) may look at a node between the walks it stands for
        self._one_walk = (type(self.eviction) is LeafEviction and self._leaf_hook is None
                          and not self._history and self._on_hit is None
                          and self._on_create is None and self._on_access is None
                          and self._on_split is None)

    def fits(self, num_tokens: int) -> bool:
        return self.pool.capacity is None or self.pool.round_up(num_tokens) <= self.pool.capacity

    # ---------------------------------------------------------------- PrefixCache lifecycle
    def match(self, tokens: np.ndarray, limit: int | None = None,
              requester: Requester | None = None) -> int:
        # A look-up: recency refreshed as SGLang's match_prefix does; no hit, no policy access.
        key = tokens if limit is None else tokens[:limit]
        if type(self).match_prefix is not RadixTree.match_prefix:  # a subclass's own (tiers)
            return self.match_prefix(key, requester, lookup=True)[0]
        return self.match_bytes(as_bytes(key))

    def match_bytes(self, kb: bytes, limit: int | None = None) -> int:
        """`match` of a token run given as its bytes (`testbed.cache.token_runs`: a caller that
        looks the same run up step after step keeps them), its first ``limit`` tokens: the
        look-up's walk, without gathering the path's slots."""
        if type(self).match_prefix is not RadixTree.match_prefix:
            return self.match(np.frombuffer(kb, TOKEN_DTYPE), limit)
        end = len(kb)
        if limit is not None:  # as ``tokens[:limit]`` cuts
            end = min(end, (limit if limit >= 0 else max(end // TOKEN_BYTES + limit, 0))
                      * TOKEN_BYTES)
        end -= end % self._kw
        return self._walk(kb, end, None, False, [])[1] // TOKEN_BYTES if end else 0

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
        """`PrefixCache.replay_one` with the same effects on the tree, the pool and the policy as
        its calls (`acquire`, `extend`, `release`), in one walk where the policy has no hooks
        (page size 1, no lower tiers: `testbed.cache.radix_replay`)."""
        if self.page_size != 1 or self.lower_tiers:
            return super().replay_one(prompt, output, requester)
        kb = joined_bytes(prompt, output)
        n = len(kb) // TOKEN_BYTES
        if self.pool.capacity is not None and n > self.pool.capacity:
            return 0, 0, False, None
        serve = replay_fast if self._one_walk else replay_walking
        return serve(self, kb, len(prompt), n, requester)

    def count_slots(self) -> None:
        """Count the pool's slots rather than name them (`testbed.cache.slot_count.SlotCount`),
        for a backend that holds no KV (the replay): where `replay_one` takes its one-walk path
        (page size 1, no lower tiers) and nothing is allocated yet; else nothing changes. Every
        count, hit and eviction stays the same; the slot ids become placeholders."""
        pool = self.pool
        if self.page_size == 1 and not self.lower_tiers and type(pool) is KVSlotPool \
                and pool.num_free == pool.num_minted and not pool.keep_runs:
            self.pool = SlotCount(pool.capacity)

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

