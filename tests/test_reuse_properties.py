"""Property tests of chunk reuse in the radix cache (hypothesis, derandomized): random requests,
held leases, commits, evictions, chunk stores from the leases' slots, and chunks locked as donors
keep the invariants, the brute-force model's content and LRU evictions (`PageModel`), the slot
ownership and the donors' KV."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.cache.chunks import find_chunk, store_chunk
from testbed.cache.radix import RadixCache
from testbed.cache.reuse import CHUNK_MARK, ReuseConfig
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.scheduler import Scheduler
from testbed.workloads.beyond_prefix import rag
from tests.test_radix_properties import (SETTINGS, PageModel, cached_pages, drop, held_by_leases,
                                         seqs)


def peek_slots(cache: RadixCache, key: list[int], unlocked: bool = False) -> np.ndarray:
    """The slots of ``key``'s cached prefix, read off the tree without touching it (``unlocked``:
    only those in unlocked nodes)."""
    node, n, out = cache.root, 0, []
    while n < len(key):
        child = next((c for c in node.children.values() if c.key[0] == key[n]), None)
        if child is None:
            break
        k = 0
        while k < child.size and n + k < len(key) and child.key[k] == key[n + k]:
            k += 1
        if not (unlocked and child.lock_ref):
            out.append(child.slots[:k])
        n += k
        if k < child.size:
            break
        node = child
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


op = st.one_of(
    st.tuples(st.just("request"), seqs),
    st.tuples(st.just("hold"), seqs),
    st.tuples(st.just("drop"), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("evict"), st.integers(0, 12)),
    st.tuples(st.just("commit"), st.integers(0, 3)),
    st.tuples(st.just("store"), st.integers(0, 3), st.integers(0, 12), st.integers(1, 12)),
    st.tuples(st.just("donate"), seqs),
    st.tuples(st.just("donate"), st.integers(0, 7), st.integers(1, 12), seqs),
    st.tuples(st.just("undonate"), st.integers(0, 3)),
)


@SETTINGS
@given(st.integers(6, 30), st.lists(op, min_size=40, max_size=60))
def test_chunk_stores_and_donor_locks_keep_invariants_content_and_locked_kv(capacity, ops):
    cache = RadixCache(capacity)
    model = PageModel(cache, "node")  # every eviction checked against a brute-force LRU scan
    held = []  # (lease, its tokens)
    donors = []  # (locked node, chunk key found, its slots then)
    chunks = []  # the chunks stored so far
    for step in ops:
        kind = step[0]
        if kind in ("request", "hold"):
            key = np.asarray(step[1], dtype=np.int32)
            lease = cache.acquire(key)
            assert lease.hit == model.hit(step[1])
            ok = cache.extend(lease, len(key) - lease.hit) is not None
            if kind == "hold" and ok and len(held) < 3:
                held.append((lease, key))
            else:
                cache.release(lease, key, insert=ok)
                if ok:
                    model.insert(step[1])
        elif kind == "drop" and held:
            drop(cache, model, held, step[1], step[2])
        elif kind == "evict":
            cache.evict(step[1])
        elif kind == "commit" and held:
            lease, key = held[step[1] % len(held)]
            cache.commit(lease, key)
            model.insert(key.tolist())
        elif kind == "store" and held:
            lease, key = held[step[1] % len(held)]
            a = min(step[2], len(key))
            b = min(a + step[3], len(key))
            chunk = key[a:b].tolist()
            ckey = [CHUNK_MARK, *chunk]
            present = model.hit(ckey) if chunk else 0
            # the store locks the cached part of the chunk before it evicts
            room = cache.pool.num_free + cache.evictable_size - len(peek_slots(cache, ckey, True))
            copy, _ = store_chunk(cache, key[a:b], lease.slots[a:b], start=a)
            if not chunk or present == len(ckey) or room < len(ckey) - present:
                assert copy is None
                stored = bool(chunk) and present == len(ckey)
            else:
                stored = True
                assert copy.shift == -a
                first = max(present, 1)  # the mark's slot has no source
                assert np.array_equal(copy.src_slots, lease.slots[a + first - 1 : b])
                assert np.array_equal(copy.dst_slots, peek_slots(cache, ckey)[first:])
            if stored:
                model.insert(ckey)
                chunks.append(chunk)
        elif kind == "donate" and (len(step) == 2 or chunks):
            if len(step) == 2:
                tokens = step[1]
            else:  # a chunk stored before (a prefix of it, or more): likely cached
                tokens = chunks[step[1] % len(chunks)][: step[2]] + step[3]
            chunk = [CHUNK_MARK, *tokens]
            expected = max(model.hit(chunk) - 1, 0) if tokens else 0
            found, node, slots = find_chunk(cache, np.asarray(tokens, dtype=np.int32))
            assert found == expected
            assert np.array_equal(slots, peek_slots(cache, chunk)[1 : 1 + found])
            if found and len(donors) < 3:
                cache.lock(node)
                donors.append((node, chunk[: found + 1], slots))
        elif kind == "undonate" and donors:
            node, _, _ = donors.pop(step[1] % len(donors))
            cache.unlock(node)
        leases = [lease for lease, _ in held]
        cache.check_invariants(leases)
        assert cache.pool.num_free + cache.total_size + held_by_leases(leases) == capacity
        assert cached_pages(cache) == model.content
        for node, ckey, slots in donors:  # a locked donor's KV stays where it was read
            assert node.alive and np.array_equal(peek_slots(cache, ckey)[1:], slots)
    for node, _, _ in donors:
        cache.unlock(node)
    for lease, key in held:
        cache.release(lease, key)
    cache.check_invariants()
    assert cache.protected_size == 0
    assert cache.pool.num_free + cache.total_size == capacity


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(0, 10**6), st.sampled_from([0.0, 0.15, 1.0]), st.sampled_from(["segments", 5]),
       st.integers(70, 200), st.sampled_from(["blend", "semantic"]), st.booleans())
def test_the_scheduler_with_reuse_keeps_invariants_and_releases_every_lock(seed, ratio, bounds,
                                                                          capacity, mode, overlap):
    reqs = rag(num_requests=12, corpus_docs=5, docs_per_prompt=2, doc_len=8, question_len=3,
               system_prompt_len=4, output_len=6, vocab_size=50, seed=seed)
    config = (ReuseConfig(reuse="blend", recompute_ratio=ratio, chunk_boundaries=bounds)
              if mode == "blend" else
              ReuseConfig(match="semantic", recompute_ratio=ratio, similarity_threshold=0.2))
    s = Scheduler(RadixCache(capacity), SchedulerConfig(name="lpm", chunked_prefill_size=16,
                                                      overlap=overlap),
                  reuse=config)
    subs = [s.submit(r, 0.0) for r in reqs]
    for _ in range(10_000):  # drive it; with overlap a step's results apply as the next forms
        if not s.has_work:
            break
        batch = s.next_batch()
        s.take_finished()
        s.cache.check_invariants(s.leases())
        if batch is not None:
            s.complete(batch, [int(e.req.request.output[len(e.req.output)])
                               if e.produces_token and e.req.remaining_new_tokens else None
                               for e in batch.entries], 0.0)
    assert not s.has_work
    for r, q in zip(reqs, subs):
        assert q.aborted or q.output == r.output.tolist()
        assert q.aborted or q.cached_tokens + q.approx_hit_tokens < len(r.prompt)
    assert s.cache.protected_size == 0  # every lease and donor lock released
    s.cache.check_invariants()
    assert s.cache.pool.num_free + s.cache.total_size == capacity
