"""Reuse beyond exact prefixes in the shared cache and scheduler: chunk storage in the radix tree,
CacheBlend-style chunk reuse (``cache.reuse=blend``) and semantic matching (``cache.match``)."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.config.assembly import assemble, compose_config
from testbed.cache import RadixCache
from testbed.cache.chunks import find_chunk, store_chunk
from testbed.cache.reuse import CHUNK_MARK, ReuseConfig, ReusedSpan, recompute_count
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.reuse_planner import chunk_bounds
from testbed.scheduler.scheduler import Scheduler
from testbed.workloads.program import ProgramBuilder, TokenSource
from testbed.workloads.request import OutputRef, Request
from tests.conftest import toks
from tests.test_scheduler import drive


def seg_request(rid: str, *segments, out: int = 3) -> Request:
    parts = [toks(*s) for s in segments]
    return Request(rid, np.concatenate(parts), np.arange(900, 900 + out, dtype=np.int32),
                   segments=tuple(parts))


def blend_scheduler(capacity=None, ratio=0.25, **sched) -> Scheduler:
    return Scheduler(RadixCache(capacity), SchedulerConfig(name="fcfs", **sched),
                     reuse=ReuseConfig(reuse="blend", recompute_ratio=ratio))


SYS, A, B = list(range(100, 104)), list(range(200, 208)), list(range(300, 306))


# ---------------------------------------------------------------------- records and keys
def test_recompute_is_the_ceiling_of_the_ratio_and_pieces_of_a_span_add_up_to_it():
    assert [recompute_count(10, r) for r in (0, 0.05, 0.15, 0.3, 1)] == [0, 1, 2, 3, 10]
    span = ReusedSpan(dst=5, src_slots=np.arange(10), src_start=0, recompute=3)
    pieces = [span.piece(lo, lo + 4) for lo in range(0, 20, 4)]
    pieces = [p for p in pieces if p is not None]
    assert [(p.dst, len(p), p.src_start) for p in pieces] == [(5, 3, 0), (8, 4, 3), (12, 3, 7)]
    assert sum(p.recompute for p in pieces) == 3
    assert span.piece(0, 5) is None and span.piece(0, 100) is span


@pytest.mark.parametrize("override, message", [
    ("cache.reuse=copy", "cache.reuse must be one of prefix, blend; got 'copy'"),
    ("cache.match=fuzzy", "cache.match must be one of exact, semantic; got 'fuzzy'"),
    ("cache.recompute_ratio=1.5", "cache.recompute_ratio must be a number in [0, 1], got 1.5"),
    ("cache.similarity_threshold=-1", "cache.similarity_threshold must be a number in [0, 1]"),
    ("cache.chunk_boundaries=0", "cache.chunk_boundaries must be segments or a whole number"),
    ("cache.chunk_boundaries=docs", "cache.chunk_boundaries must be segments or a whole number"),
])
def test_a_bad_reuse_value_is_one_line_naming_the_key_and_the_allowed_values(override, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        assemble(compose_config(["workload=rag", override]))


@pytest.mark.parametrize("overrides, message", [
    (["cache=block_hash", "cache.reuse=blend"], "cache.reuse=blend needs cache=radix, got "
                                                "cache=block_hash"),
    (["cache=none", "cache.match=semantic"], "cache.match=semantic needs cache=radix"),
    (["cache.page_size=4", "cache.reuse=blend"], "cache.reuse=blend needs cache.page_size=1"),
    (["cache.host_tokens=100", "cache.reuse=blend"], "does not work with lower tiers"),
    (["cache.reuse=blend", "cache.match=semantic"], "cache.match=semantic works with "
                                                    "cache.reuse=prefix only"),
    (["cache.reuse=blend", "backend=replay"], "need backend=sim or engine"),
])
def test_reuse_beyond_prefixes_is_refused_where_it_is_not_supported(overrides, message):
    with pytest.raises(ValueError, match=message):
        assemble(compose_config(["workload=rag", *overrides]))


def test_chunk_bounds_are_the_literal_segments_or_fixed_runs():
    r = seg_request("r", SYS, A, [1, 2])
    assert chunk_bounds(r, 14, None) == [(0, 4), (4, 12), (12, 14)]
    assert chunk_bounds(r, 14, 5) == [(0, 5), (5, 10), (10, 14)]
    plain = Request("p", toks(*range(7)), toks())
    assert chunk_bounds(plain, 7, None) == [(0, 7)]
    ref = Request("q", toks(*range(9)), toks(), segments=(toks(1, 2), OutputRef("x"), toks(3)))
    assert chunk_bounds(ref, 9, None) == [(0, 2), (2, 9)]  # after an output: one chunk


# ---------------------------------------------------------------------- chunks in the tree
def test_a_stored_chunk_is_found_at_chunk_local_positions_and_real_prompts_never_reach_it():
    cache = RadixCache(64)
    src = cache.pool.alloc(8)  # a request's slots holding A at prompt positions 10..17
    copy, evicted = store_chunk(cache, toks(*A), src, start=10)
    assert evicted == 0 and copy.shift == -10
    assert np.array_equal(copy.src_slots, src) and len(copy.dst_slots) == 8
    found, node, slots = find_chunk(cache, toks(*A, 5))
    assert found == 8 and np.array_equal(slots, copy.dst_slots)
    assert cache.total_size == 9  # the mark's one slot, then the chunk
    assert cache.match(toks(*A)) == 0 and cache.match(toks(CHUNK_MARK, *A)) == 9
    # a second store of the same chunk only refreshes it; a longer one copies only its tail
    assert store_chunk(cache, toks(*A), src, start=3) == (None, 0)
    longer, _ = store_chunk(cache, toks(*A, 7, 7), cache.pool.alloc(10), start=0)
    assert len(longer) == 2 and cache.total_size == 11
    found, _, prefix = find_chunk(cache, toks(*A[:5]))
    assert found == 5 and np.array_equal(prefix, copy.dst_slots[:5])


def test_a_chunk_store_evicts_unlocked_entries_and_gives_up_without_room():
    cache = RadixCache(20)
    lease = cache.acquire(toks(*range(12)))
    cache.extend(lease, 12)
    cache.release(lease, toks(*range(12)))  # 12 evictable, 8 free
    held = cache.pool.alloc(8)  # 0 free now: the source slots are someone's
    copy, evicted = store_chunk(cache, toks(*SYS), held[:4], start=0)
    assert evicted == 12 and len(copy) == 4 and cache.total_size == 5
    cache.pool.free(held)
    cache.check_invariants()
    full = RadixCache(5)
    grab = full.pool.alloc(5)
    assert store_chunk(full, toks(*SYS), grab[:4], start=0) == (None, 0)
    assert full.total_size == 0


# ---------------------------------------------------------------------- blend in the scheduler
def test_a_document_at_another_position_is_reused_with_its_recomputed_share_and_donor_lock():
    s = blend_scheduler(ratio=0.25)
    first = s.submit(seg_request("a", SYS, A, [1, 2]), 0.0)
    batch = s.next_batch()
    assert [len(c) for c in batch.kv_copies] == [4, 8, 2]  # its chunks stored after the step
    assert [c.shift for c in batch.kv_copies] == [0, -4, -12]
    chunk_a = batch.kv_copies[1].dst_slots
    s.complete(batch, [900], 1.0)
    drive(s)
    second = s.submit(seg_request("b", SYS, B, A, [3, 4]), 2.0)
    batch = s.next_batch()
    (entry,) = batch.entries
    assert entry.context == 4  # the system prompt: an exact hit
    (span,) = entry.reuse
    assert (span.dst, span.src_start, span.recompute) == (10, 0, 2)
    assert np.array_equal(span.src_slots, chunk_a)
    assert entry.computed == entry.new - 6
    assert second.approx_hit_tokens == 6 and second.recomputed_tokens == 2
    assert second.cached_tokens == 4 and first.approx_hit_tokens == 0
    donor = find_chunk(s.cache, toks(*A))[1]
    assert donor.lock_ref == 1  # locked until the prefill has run
    s.cache.check_invariants(s.leases())
    s.complete(batch, [900], 3.0)
    assert donor.lock_ref == 0
    drive(s)
    # the exact tree took the second prompt only up to its first approximate position
    assert s.cache.match(toks(*SYS, *B, *A, 3, 4)) == 10
    assert s.cache.protected_size == 0
    s.cache.check_invariants()


def test_a_chunk_straddling_the_exact_hit_reuses_only_its_part_after_it():
    s = blend_scheduler(ratio=0.0)
    s.submit(seg_request("a", A, [1]), 0.0)
    drive(s)
    s.submit(seg_request("b", A[:3], [7], A[3:], [5]), 1.0)  # hit 3; A's tail elsewhere
    s.submit(seg_request("c", SYS, A[:5], [5]), 1.0)  # the chunk's prefix: reused as far as it goes
    batch = s.next_batch()
    spans = {e.req.id: e.reuse for e in batch.entries}
    assert spans["b"] == () and batch.entries[0].context == 3  # A[3:] is no chunk of its own
    (span,) = spans["c"]
    assert (span.dst, len(span), span.src_start) == (4, 5, 0)


def test_blend_with_every_chunk_at_its_original_position_computes_and_hits_as_prefix_caching():
    reqs = [seg_request(f"r{i}", SYS, A, [i, i + 1], out=4) for i in range(6)]
    runs = {}
    for mode in ("prefix", "blend"):
        s = Scheduler(RadixCache(), SchedulerConfig(name="fcfs"),
                      reuse=ReuseConfig(reuse=mode, recompute_ratio=0.0))
        subs = [s.submit(r, 0.0) for r in reqs[:1]]
        shapes = []
        for r in reqs[1:]:
            while s.has_work:
                batch = s.next_batch()
                shapes.append(tuple((e.context, e.new, e.computed) for e in batch.entries))
                tokens = [int(e.req.request.output[len(e.req.output)]) if e.produces_token
                          else None for e in batch.entries]
                s.complete(batch, tokens, 0.0)
            subs.append(s.submit(r, 0.0))
        drive(s)
        runs[mode] = (shapes, [(q.cached_tokens, q.approx_hit_tokens, q.recomputed_tokens,
                                q.output) for q in subs])
    assert runs["blend"] == runs["prefix"]


def test_blend_at_ratio_one_recomputes_every_reused_token_and_keeps_the_tree_exact():
    s = blend_scheduler(ratio=1.0)
    s.submit(seg_request("a", SYS, A, [1, 2]), 0.0)
    drive(s)
    r = s.submit(seg_request("b", SYS, B, A, [3, 4]), 1.0)
    batch = s.next_batch()
    (entry,) = batch.entries
    (span,) = entry.reuse
    assert span.recompute == len(span) == 8 and entry.computed == entry.new
    assert r.approx_hit_tokens == 0 and r.recomputed_tokens == 8
    s.complete(batch, [900], 1.0)
    drive(s)
    assert s.cache.match(toks(*SYS, *B, *A, 3, 4)) == 20  # the whole prompt: its KV is exact


def test_a_retracted_blend_request_releases_its_donors_and_plans_again():
    s = blend_scheduler(capacity=60, ratio=0.0, init_new_token_ratio=0.0,
                        min_new_token_ratio_factor=0.0, clip_max_new_tokens=1)
    s.submit(seg_request("warm", A, [1]), 0.0)
    drive(s)
    reqs = [s.submit(seg_request(f"r{i}", [i], A, [50 + i], out=14), 0.0) for i in range(4)]
    drive(s)
    assert s.preemptions > 0
    assert all(r.finished and r.output == list(range(900, 914)) for r in reqs)
    assert s.cache.protected_size == 0
    s.cache.check_invariants()
    assert s.cache.pool.num_free + s.cache.total_size == 60


# ---------------------------------------------------------------------- semantic matching
def semantic_scheduler(threshold=0.3, ratio=0.0, capacity=None, **sched) -> Scheduler:
    return Scheduler(RadixCache(capacity), SchedulerConfig(name="fcfs", **sched),
                     reuse=ReuseConfig(match="semantic", similarity_threshold=threshold,
                                       recompute_ratio=ratio))


def test_a_paraphrase_reuses_the_aligned_runs_of_its_donor_at_the_donors_positions():
    base = list(range(10, 50))
    s = semantic_scheduler()
    s.submit(Request("orig", toks(*base), toks(900, 901)), 0.0)
    drive(s)
    edited = base[:20] + [7, 7] + base[20:]  # two tokens inserted at 20
    r = s.submit(Request("para", toks(*edited), toks(900, 901)), 1.0)
    batch = s.next_batch()
    (entry,) = batch.entries
    assert entry.context == 20
    (span,) = entry.reuse
    assert (span.dst, len(span), span.src_start) == (22, 19, 20)  # the last token is computed
    assert r.approx_hit_tokens == 19
    s.complete(batch, [900], 2.0)
    drive(s)
    s.cache.check_invariants()


def test_donors_whose_locks_leave_no_room_for_the_later_chunks_are_not_reused():
    # The fuzzer, seed 6006 #9064: the donor (the original's 42 tokens) locked beside the
    # paraphrase's 22 new ones overfills 60 slots; the first chunks fit, the third found no KV,
    # was put back and planned the same way again, forever. Now it reuses nothing and finishes.
    base = list(range(10, 50))
    s = semantic_scheduler(capacity=60, chunked_prefill_size=8)
    s.submit(Request("orig", toks(*base), toks(900, 901)), 0.0)
    drive(s)
    assert (s.cache.total_size, s.cache.pool.num_free) == (41, 19)
    edited = base[:20] + [7, 7] + base[20:]
    r = s.submit(Request("para", toks(*edited), toks(900, 901)), 1.0)
    batch = s.next_batch()
    (entry,) = batch.entries
    assert (entry.context, entry.new, entry.reuse) == (20, 8, ())
    assert s.cache.protected_size == 20  # its own prefix only: no donor locked
    s.complete(batch, [None], 2.0)
    assert drive(s, max_steps=20) == 3  # two more chunks, a decode step
    assert r.output == [900, 901] and (r.cached_tokens, r.approx_hit_tokens) == (20, 0)
    assert s.preemptions == 0 and s.cache.protected_size == 0
    s.cache.check_invariants()


def test_semantic_matching_of_an_identical_prompt_equals_exact_matching():
    tokens = TokenSource(np.random.default_rng(1), 500)
    reqs = []
    for i in range(4):
        prompt = tokens(30)
        for k in range(3):
            reqs.append(ProgramBuilder(f"p{i}.{k}", tokens).call("c", [prompt], 5))
    results = {}
    for sched in (semantic_scheduler(threshold=0.5),
                  Scheduler(RadixCache(), SchedulerConfig(name="fcfs"))):
        subs = []
        for r in reqs:  # one at a time: each repeat finds its original cached
            subs.append(sched.submit(r, 0.0))
            drive(sched)
        results[sched.reuse is None] = [(q.cached_tokens, q.approx_hit_tokens, q.output)
                                        for q in subs]
    assert results[True] == results[False]
