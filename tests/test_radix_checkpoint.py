"""SGLang 0.5.23's checkpoint insert rule on the radix cache (docs/design.md §4, "SGLang releases").

Under ``scheduler.sglang=0.5.23`` (the default) every insert of a request is followed, as in
0.5.23's ``RadixCache.checkpoint`` (``_insert_cache(split_prompt=True)``), by an insert of its
prompt alone, page-aligned, when the prompt ends inside what was inserted: the node splits at the
prompt's end, the prompt's nodes become one priority more urgent, no hit is counted; then a
look-up of the whole key. Under ``0.4.10`` the insert alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.cache import RadixCache, Requester
from testbed.errors import BadInput
from testbed.backends.replay import replay
from testbed.workloads.request import Request
from tests.conftest import toks
from tests.test_radix_properties import lcp, path_of


def serve(cache: RadixCache, prompt: list[int], output: list[int], requester=None):
    """One request through acquire, extend and release (the replay backend's calls)."""
    seq = toks(*prompt, *output)
    lease = cache.acquire(toks(*prompt), requester=requester)
    cache.extend(lease, len(seq) - lease.hit)
    cache.release(lease, seq)
    return lease.hit


def ends(cache: RadixCache) -> set[tuple[int, ...]]:
    """Every node's path from the root (where a node ends)."""
    return {path_of(node) for node in cache.nodes()}


def test_a_finished_request_is_split_at_its_prompt_so_lru_evicts_its_output_alone():
    cache = RadixCache(16)
    serve(cache, [1, 2, 3], [4, 5])
    assert ends(cache) == {(1, 2, 3), (1, 2, 3, 4, 5)}
    assert cache.evict(1) == 2  # the output [4, 5] only
    assert ends(cache) == {(1, 2, 3)} and cache.total_size == 3
    cache.check_invariants()


def test_under_sglang_0_4_10_the_sequence_stays_one_node_and_is_evicted_whole():
    cache = RadixCache(16, sglang="0.4.10")
    serve(cache, [1, 2, 3], [4, 5])
    assert ends(cache) == {(1, 2, 3, 4, 5)}
    assert cache.evict(1) == 5
    assert cache.total_size == 0


def test_the_prompt_reinsert_counts_no_insert_hit():
    cache = RadixCache(None)
    serve(cache, [1, 2, 3], [4, 5])
    assert sorted((path_of(n), n.hits) for n in cache.nodes()) == [((1, 2, 3), 1),
                                                                   ((1, 2, 3, 4, 5), 1)]
    serve(cache, [1, 2, 3], [4, 5])  # the same again: one insert hit more on each
    assert sorted(n.hits for n in cache.nodes()) == [2, 2]


@pytest.mark.parametrize("priority, prompt_priority", [(5, 4), (0, -1), (None, -1)])
def test_the_prompts_nodes_become_one_priority_more_urgent(priority, prompt_priority):
    # SGLang's ``priority + 1`` (higher more urgent there; lower here); no requester: 0, then -1
    cache = RadixCache(None)
    requester = None if priority is None else Requester("r", priority)
    serve(cache, [1, 2, 3], [4, 5], requester)
    by_path = {path_of(n): n.priority for n in cache.nodes()}
    assert by_path == {(1, 2, 3): prompt_priority, (1, 2, 3, 4, 5): priority or 0}


@pytest.mark.parametrize("prompt_len, expected", [
    (6, {4, 12}),   # the prompt's whole pages (4) end inside the 12 inserted: split there
    (3, {12}),      # no whole page of prompt: nothing to insert again
    (12, {12}),     # the prompt is all that was inserted (the output's tail page is not)
    (13, {12})])    # a chunk of a prompt longer than what is inserted: no split
def test_pages_the_prompt_is_inserted_again_only_as_whole_pages_inside_the_key(prompt_len,
                                                                                 expected):
    cache = RadixCache(None, page_size=4)
    seq = list(range(1, 14))  # 13 tokens: 12 in whole pages
    lease = cache.acquire(toks(*seq[:prompt_len]))
    lease.prompt = prompt_len
    cache.extend(lease, len(seq))
    cache.release(lease, toks(*seq))
    assert {len(p) for p in ends(cache)} == expected
    cache.check_invariants()


def test_an_insert_after_prefill_splits_at_the_prompt_and_keeps_the_request_locked():
    # a retracted request's fill holds its outputs: the scheduler sets lease.prompt back
    cache = RadixCache(16)
    lease = cache.acquire(toks(1, 2, 3, 4, 5))
    lease.prompt = 3
    cache.extend(lease, 5)
    cache.commit(lease, toks(1, 2, 3, 4, 5))
    assert ends(cache) == {(1, 2, 3), (1, 2, 3, 4, 5)}
    assert cache.protected_size == 5 and cache.evict(5) == 0
    cache.extend(lease, 1)  # a decoded token
    cache.release(lease, toks(1, 2, 3, 4, 5, 6))
    assert cache.protected_size == 0 and cache.total_size == 6
    cache.check_invariants([])


@pytest.mark.parametrize("release, evicted", [("0.5.23", 2), ("0.4.10", 5)])
def test_replay_short_of_room_evicts_an_older_requests_output_before_its_prompt(release,
                                                                               evicted):
    # a's output [4, 5] is its own leaf under 0.5.23, so c's shortfall of 2 frees just it;
    # under 0.4.10 a's whole sequence is one leaf
    cache = RadixCache(10, sglang=release)
    records = replay([Request("a", toks(1, 2, 3), toks(4, 5)),
                      Request("b", toks(7, 8, 9), toks(6)),
                      Request("c", toks(11, 12), toks(13))], cache)
    assert [(r.cached_tokens, r.evicted_tokens) for r in records] == [(0, 0), (0, 0),
                                                                       (0, evicted)]
    assert cache.match(toks(1, 2, 3)) == (3 if release == "0.5.23" else 0)
    cache.check_invariants()


def test_an_unknown_release_is_refused_naming_the_key():
    with pytest.raises(BadInput, match="scheduler.sglang must be one of 0.5.23, 0.4.10; "
                                       "got '0.5'"):
        RadixCache(None, sglang="0.5")


requests_st = st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=6),
                                 st.lists(st.integers(0, 2), min_size=1, max_size=4)),
                       min_size=1, max_size=12)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(requests_st, st.sampled_from(["0.5.23", "0.4.10"]), st.booleans())
def test_node_boundaries_are_exactly_the_walks_ends_brute_force(requests, release, one_pass):
    """Unlimited cache, page size 1: a node ends exactly where some walk stopped inside or at
    the end of cached tokens: each match of a prompt (its cached length), each insert (where
    the sequence left the cached tokens, and its end) and, under 0.5.23, each request's prompt
    end when an output follows; and every hit is the prompt's longest cached prefix."""
    cache = RadixCache(None, sglang=release)
    cached: list[tuple[int, ...]] = []
    cuts: set[tuple[int, ...]] = set()
    for prompt, output in requests:
        seq = tuple(prompt + output)
        hit = max((lcp(list(c), prompt) for c in cached), default=0)
        diverge = max((lcp(list(c), list(seq)) for c in cached), default=0)
        cuts |= {seq[:hit], seq[:diverge], seq}
        if release == "0.5.23":
            cuts.add(tuple(prompt))
        cached.append(seq)
        if one_pass:
            got = cache.replay_one(np.asarray(prompt), np.asarray(output))[0]
        else:
            got = serve(cache, prompt, output)
        assert got == hit
    assert ends(cache) == cuts - {()}
    cache.check_invariants()
