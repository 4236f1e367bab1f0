"""The replay backend (docs/design.md §4) and the summary it feeds."""

import numpy as np
import pytest

from testbed.cache import CACHES, EVICTION, BlockHashCache, NoCache, RadixCache, Requester
from testbed.results.metrics import ideal_hit_rate, summarize
from testbed.backends.replay import replay
from testbed.workloads.synthetic import shared_prefix
from testbed.workloads.request import TOKEN_DTYPE, Request
from testbed.workloads.traces import load_mooncake
from tests.conftest import toks


def req(i, prompt, output=()):
    return Request(str(i), toks(*prompt), toks(*output))


def test_replay_records_hits_evictions_and_insertion_per_request():
    cache = RadixCache(8)
    records = replay([req(0, [1, 2, 3], [4]), req(1, [1, 2, 3, 4, 5], [6]), req(2, [7, 8, 9], [1])],
                     cache)
    assert [r.cached_tokens for r in records] == [0, 4, 0]
    # Request 2 needs 4 slots with 2 free; the only leaf is [5, 6] ([1, 2, 3, 4] is its parent),
    # and its 2 tokens are enough.
    assert [r.evicted_tokens for r in records] == [0, 0, 2]
    assert all(r.inserted for r in records)
    cache.check_invariants()
    assert cache.total_size == 8 and cache.pool.num_free == 0


def test_output_tokens_already_cached_still_count_in_need_and_their_slots_are_freed():
    cache = RadixCache(7)
    replay([req(0, [1, 2], [3, 4])], cache)
    (rec,) = replay([req(1, [1], [2, 3, 4])], cache)  # whole sequence cached already
    assert (rec.cached_tokens, rec.evicted_tokens) == (1, 0)
    assert cache.total_size == 4 and cache.pool.num_free == 3
    cache.check_invariants()


@pytest.mark.parametrize("release, evicted", [("0.4.10", 3), ("0.5.23", 2)])
def test_need_counts_the_cached_continuation_so_it_may_evict_it_first(release, evicted):
    # SGLang's rule: need = len(prompt + output) - hit even when the rest is cached. With 2 free
    # slots and need 3, the oldest unlocked leaf is the request's own continuation: [2, 3, 4]
    # under 0.4.10; 0.5.23's checkpoint inserted request 0's prompt [1, 2] again, splitting
    # [1, 2, 3, 4] there, so the leaf is its output [3, 4] and 2 tokens are enough.
    cache = RadixCache(6, sglang=release)
    replay([req(0, [1, 2], [3, 4])], cache)
    (rec,) = replay([req(1, [1], [2, 3, 4])], cache)
    assert (rec.cached_tokens, rec.evicted_tokens) == (1, evicted)
    assert cache.total_size == 4 and cache.pool.num_free == 2
    cache.check_invariants()


def test_a_sequence_longer_than_the_cache_is_served_uncached_and_changes_nothing():
    cache = RadixCache(4)
    replay([req(0, [1, 2, 3])], cache)
    (rec,) = replay([req(1, [1, 2, 3, 4, 5])], cache)
    assert (rec.cached_tokens, rec.evicted_tokens, rec.inserted) == (0, 0, False)
    assert cache.total_size == 3


def test_no_cache_never_hits_and_keeps_nothing():
    cache = NoCache(100)
    records = replay([req(0, [1, 2, 3]), req(1, [1, 2, 3])], cache)
    assert [(r.cached_tokens, r.inserted) for r in records] == [(0, False), (0, False)]
    assert cache.pool.num_free == 100
    cache.check_invariants()


def test_unlimited_radix_replay_reaches_exactly_the_ideal_hit_rate():
    requests = shared_prefix(num_groups=4, prompts_per_group=3, system_prompt_len=50,
                             question_len=5, output_len=7, seed=3)
    records = replay(requests, RadixCache(None))
    s = summarize(records, ideal=ideal_hit_rate(requests), wall_s=0.0)
    assert s["hit_rate"] == s["ideal_hit_rate"]
    assert s["cached_tokens"] >= 4 * 2 * 50


def test_ideal_hit_rate_counts_prefixes_of_earlier_outputs():
    # The second prompt continues the first request's output: all 4 of its first tokens hit.
    requests = [req(0, [1, 2], [3, 4]), req(1, [1, 2, 3, 4, 5, 6])]
    assert ideal_hit_rate(requests) == pytest.approx(4 / 8)


def test_summary_has_the_contract_fields_and_nulls_for_time_in_replay():
    records = replay([req(0, [1, 2], [3])], RadixCache(None))
    s = summarize(records, ideal=0.0, wall_s=0.5)
    for key in ["num_requests", "prompt_tokens", "cached_tokens", "hit_rate", "ideal_hit_rate",
                "output_tokens", "evicted_tokens", "preemptions", "makespan_s", "throughput_req_s",
                "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "e2e_p50_s",
                "e2e_p99_s", "wall_s"]:
        assert key in s
    assert s["makespan_s"] is None and s["ttft_p50_s"] is None and s["wall_s"] == 0.5


@pytest.mark.parametrize("name", ["radix", "block_hash", "none"])
def test_every_cache_leaves_no_slot_leaked_after_a_replay(name):
    requests = shared_prefix(num_groups=3, prompts_per_group=4, system_prompt_len=40,
                             question_len=9, output_len=6, seed=1)
    cache = CACHES.build(name, capacity_tokens=150)
    replay(requests, cache)
    cache.check_invariants()
    assert cache.protected_size == 0


def test_cache_and_eviction_choices_name_the_key_and_allowed_values_on_bad_input():
    with pytest.raises(ValueError, match="cache must be one of radix, block_hash, none, custom; "
                                         "got 'lru'"):
        CACHES.build("lru")
    with pytest.raises(ValueError, match="cache.block_size is not a setting of cache=radix"):
        CACHES.build({"name": "radix", "block_size": 16})
    with pytest.raises(ValueError, match="eviction must be one of lru, fifo, filo, lfu"):
        EVICTION.build("nope")


@pytest.mark.parametrize("release, capacity, expected", [
    ("0.5.23", None, 0.373624), ("0.5.23", 3_000_000, 0.135499), ("0.4.10", 3_000_000, 0.135347)])
def test_mooncake_conversation_trace_hit_rates_match_sglang(mooncake_conversation, release,
                                                            capacity, expected):
    # each release's RadixCache fed the same calls gives the same (docs/results/trace_replay.md)
    requests = load_mooncake(mooncake_conversation)
    assert len(requests) == 12031
    records = replay(requests, RadixCache(capacity, sglang=release))
    hit_rate = sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records)
    assert round(hit_rate, 6) == expected


def tree_state(cache: RadixCache) -> list:
    """Everything a radix cache holds that a later request or a policy could see."""
    nodes = [(n.id, n.parent.id, n.key.tolist(), n.slots.tolist(), n.last_access, n.access_count,
              n.created, n.lock_ref, n.priority, n.category, n.start, n.hits, n.history)
             for n in cache.nodes()]
    live = sorted((priority, node) for node, priority in cache.eviction.queued().items())
    return [nodes, live, cache.pool.free_slots().tolist(), cache._clock, cache.evictable_size]


POLICIES_ONE_PASS = ("lru", "fifo", "filo", "lfu", "mru", "slru", "tlru", "size_aware", "wlfu",
                     "priority", "gdsf", "workload_aware", "oracle")
# (policy, release, split recency, capacity, evict unit): every policy unbounded, evicting whole
# nodes and pages; LRU, and GDSF (whose keys drift), under both releases and recencies too
ONE_PASS_CASES = [
    *((policy, "0.5.23", "refresh", capacity, unit) for policy in POLICIES_ONE_PASS
      for capacity, unit in ((None, "node"), (600, "page"), (150, "node"))),
    *((policy, release, recency, capacity, unit) for policy in ("lru", "gdsf")
      for release, recency in (("0.4.10", "refresh"), ("0.5.23", "keep"), ("0.4.10", "keep"))
      for capacity, unit in ((600, "node"), (150, "page")))]


@pytest.mark.parametrize("policy,release,recency,capacity,unit", ONE_PASS_CASES)
@pytest.mark.parametrize("seed", [4, 5])
def test_radix_replay_in_one_pass_equals_acquire_extend_release(policy, release, recency,
                                                                capacity, unit, seed):
    # RadixCache.replay_one serves a request in one walk (testbed.cache.radix_replay) or, where
    # the policy has hooks, in every walk; PrefixCache.replay_one makes the calls. Small
    # vocabularies make accidental matches, splits and cached output tokens common; some
    # requests have no prompt, no output or neither; every node's every field is compared.
    from testbed.cache import PrefixCache
    from testbed.workloads.synthetic import random_tree

    requests = random_tree(num_requests=200, root_len=9, segment_len=5, output_len=3, vocab_size=3,
                           seed=seed)
    for i, r in enumerate(requests):
        r.priority, r.category = i % 3, f"c{i % 2}"
        if i % 37 == 5:
            r.output = r.output[:0]
        if i % 53 == 7:
            r.prompt = r.prompt[:0]
    fused, calls = (RadixCache(capacity, policy=EVICTION.build(policy, requests=requests),
                               evict_unit=unit, sglang=release, split_recency=recency)
                    for _ in range(2))
    for i, r in enumerate(requests):
        who = None if i % 11 == 3 else Requester(r.id, r.priority, r.category)
        assert fused.replay_one(r.prompt, r.output, who) == \
            PrefixCache.replay_one(calls, r.prompt, r.output, who)
        assert tree_state(fused) == tree_state(calls)
    if policy in ("lru", "lfu", "priority"):  # the others' keys drift with global state
        fused.check_invariants()


def test_replay_walks_once_where_the_policy_has_no_hooks():
    # the one-walk path is taken for hookless policies, every walk for hooked ones
    assert RadixCache(10, policy=EVICTION.build("lfu"))._one_walk
    assert not RadixCache(10, policy=EVICTION.build("workload_aware"))._one_walk


@pytest.mark.parametrize("seed", range(6))
def test_the_ideal_trie_gives_every_request_the_hit_of_an_unlimited_radix_replay(seed):
    # Three-token vocabularies: prompts end inside edges, outputs repeat cached runs.
    from testbed.workloads.ideal import ideal_hits
    from testbed.workloads.synthetic import random_tree

    requests = random_tree(num_requests=400, root_len=5, segment_len=3, output_len=2,
                           vocab_size=3, seed=seed)
    requests.insert(7, req("empty", []))
    assert ideal_hits(requests) == [r.cached_tokens for r in replay(requests, RadixCache(None))]


def test_the_ideal_trie_reads_the_requests_own_tokens_instead_of_copying_them():
    from testbed.cache.token_runs import as_bytes, token_view
    from testbed.workloads.ideal import ideal_hits

    tokens = np.arange(12, dtype=TOKEN_DTYPE)
    view = token_view(tokens)
    assert view.readonly and bytes(view) == as_bytes(tokens)
    assert np.shares_memory(np.frombuffer(view, dtype=TOKEN_DTYPE), tokens)
    strided = tokens[::2]  # not contiguous: a copy, the same bytes
    assert not np.shares_memory(np.frombuffer(token_view(strided), TOKEN_DTYPE), tokens)
    assert bytes(token_view(strided)) == as_bytes(strided)
    # the same hits whether the trie views the arrays or copies them
    from testbed.workloads.synthetic import random_tree
    requests = random_tree(num_requests=200, root_len=5, segment_len=3, output_len=2,
                           vocab_size=3, seed=9)
    spread = [Request(r.id, np.repeat(r.prompt, 2)[::2], np.repeat(r.output, 2)[::2])
              for r in requests]
    assert ideal_hits(spread) == ideal_hits(requests)


def test_a_requests_joined_bytes_leave_nothing_on_short_arrays_and_are_the_same_bytes():
    """Reading a numpy array's buffer in place leaves its description (56 bytes) on the array for
    its life: a request's sequence under `SMALL_JOIN` tokens is copied out instead."""
    import tracemalloc

    from testbed.cache.token_runs import SMALL_JOIN, as_bytes, joined_bytes

    for n in (0, 7, SMALL_JOIN - 9, SMALL_JOIN + 5):
        a, b = np.arange(n, dtype=TOKEN_DTYPE), np.arange(8, 0, -1, dtype=TOKEN_DTYPE)
        assert joined_bytes(a, b) == as_bytes(a) + as_bytes(b)
        assert joined_bytes(a[::2], b) == as_bytes(a[::2]) + as_bytes(b)  # strided: copied
        assert joined_bytes(a.astype(np.int64), b) == as_bytes(a) + as_bytes(b)
    short = [(np.arange(40, dtype=TOKEN_DTYPE), np.arange(8, dtype=TOKEN_DTYPE))
             for _ in range(100)]
    tracemalloc.start()
    try:
        out = [joined_bytes(a, b) for a, b in short]
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 100 * (len(out[0]) + 64) + 2_000  # the results alone: nothing per array


def test_an_unlimited_radix_replay_reports_its_own_hit_rate_as_the_ideal():
    from testbed.backends.dispatch import own_hit_rate_is_ideal

    requests = [req(0, [1, 2], [3, 4]), req(1, [1, 2, 3, 4, 5, 6]), req(2, [1, 9])]
    cache = RadixCache(None)
    own = own_hit_rate_is_ideal(cache, replay(requests, cache))
    assert own == ideal_hit_rate(requests) == pytest.approx(5 / 10)
    for other in (RadixCache(100), RadixCache(None, page_size=2), BlockHashCache(None)):
        assert own_hit_rate_is_ideal(other, replay(requests, other)) is None
