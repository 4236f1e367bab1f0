"""The replay's hot loops in C (`testbed.cache._radix_core`) do exactly what their Python twins
(`testbed.cache.native`) do: the same requests through both leave every node's every field, the
eviction queue, the pool and the clock the same, and every record too."""

from __future__ import annotations

import shutil
import sysconfig

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.backends.replay import replay
from testbed.cache import EVICTION, PrefixCache, RadixCache, Requester
from testbed.cache import leaf_eviction, native, radix_replay
from testbed.cache.tree_node import TreeNode
from testbed.workloads.request import Request
from testbed.workloads.synthetic import random_tree
from tests.test_replay import tree_state

needs_c = pytest.mark.skipif(not native.NATIVE, reason="the C loops are not built here "
                             "(pip install -e . builds them where a C compiler is found)")


def c_compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


def test_the_c_loops_are_built_where_a_c_compiler_is_found():
    # The replay is about half as fast without them (docs/results/trace_replay.md, "Speed"): a
    # failed build (the extension is optional to the install) must not pass unnoticed.
    import os

    if os.environ.get("TESTBED_NATIVE") == "0":
        pytest.skip("TESTBED_NATIVE=0: the Python loops were asked for")
    if c_compiler() is None:
        pytest.skip("no C compiler: the Python loops run")
    assert native.NATIVE, "a C compiler is here but testbed.cache._radix_core is not built: " \
                          "run make setup (pip install -e .) and read its warnings"


def use_python_loops(mp: pytest.MonkeyPatch) -> None:
    """From now on (until ``mp`` undoes it), the one-walk replay and caches made run the Python
    twins, whatever is built."""
    mp.setattr(radix_replay, "match", native.match_py)
    mp.setattr(radix_replay, "touch", native.touch_py)
    mp.setattr(radix_replay, "cut_leaf", native.cut_leaf_py)
    mp.setattr(leaf_eviction, "evict_lru", None)
    mp.setattr(leaf_eviction, "offer_lru", None)


def requests_with_everything(seed: int, n: int = 300) -> list[Request]:
    """Three-token vocabularies (cuts, cached outputs), priorities, categories, empty prompts
    and outputs."""
    requests = random_tree(num_requests=n, root_len=9, segment_len=5, output_len=3, vocab_size=3,
                           seed=seed)
    for i, r in enumerate(requests):
        r.priority, r.category = i % 3 - 1, f"c{i % 2}"
        if i % 37 == 5:
            r.output = r.output[:0]
        if i % 53 == 7:
            r.prompt = r.prompt[:0]
    return requests


def served(requests: list[Request], make, calls: bool) -> tuple[list, list]:
    """Each request's outcome and the tree after it: through `replay_one` in one walk, or
    through its calls (`acquire`, `extend`, `release`)."""
    cache = make()
    outcomes, states = [], []
    for i, r in enumerate(requests):
        who = None if i % 11 == 3 else Requester(r.id, r.priority, r.category)
        serve = (lambda *a: PrefixCache.replay_one(cache, *a)) if calls else cache.replay_one
        outcomes.append(serve(r.prompt, r.output, who))
        states.append(tree_state(cache))
    return outcomes, states


@needs_c
@pytest.mark.parametrize("release", ["0.5.23", "0.4.10"])
@pytest.mark.parametrize("recency", ["refresh", "keep"])
@pytest.mark.parametrize("capacity", [None, 400, 120, 40])
@pytest.mark.parametrize("calls", [False, True], ids=["one_walk", "calls"])
def test_the_c_loops_leave_every_node_as_the_python_loops_do(monkeypatch, release, recency,
                                                              capacity, calls):
    requests = requests_with_everything(seed=7)

    def make() -> RadixCache:
        return RadixCache(capacity, sglang=release, split_recency=recency)

    in_c = served(requests, make, calls)
    assert make().eviction._evict_lru is not None  # (the C eviction is the one compared)
    use_python_loops(monkeypatch)
    assert make().eviction._evict_lru is None
    assert served(requests, make, calls) == in_c


def counted_state(cache: RadixCache) -> list:
    """`tree_state` of a replayed cache, whose pool counts slots (`SlotCount`) and names none."""
    nodes = [(n.id, n.parent.id, n.kb, len(n.slots), n.last_access, n.access_count, n.created,
              n.lock_ref, n.priority, n.category, n.start, n.hits, n.offer, n.alive)
             for n in cache.nodes()]
    live = sorted((priority, node) for node, priority in cache.eviction.queued().items())
    return [nodes, live, cache.pool.held, cache._clock, cache.evictable_size, cache.num_nodes]


@needs_c
@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.tuples(st.lists(st.integers(0, 2), max_size=12),
                               st.lists(st.integers(0, 2), max_size=6),
                               st.integers(-2, 2)), min_size=1, max_size=40),
       capacity=st.sampled_from([None, 8, 16, 30, 60]),
       release=st.sampled_from(["0.5.23", "0.4.10"]))
def test_replays_of_any_requests_agree_in_c_and_in_python(seqs, capacity, release):
    requests = [Request(f"r{i}", np.asarray(p, np.int32), np.asarray(o, np.int32), priority=pr)
                for i, (p, o, pr) in enumerate(seqs)]

    def run(loops: str) -> tuple[list, list]:
        with pytest.MonkeyPatch.context() as mp:
            if loops == "python":
                use_python_loops(mp)
            cache = RadixCache(capacity, sglang=release)
            records = replay(requests, cache, check_invariants=True)
            return [(r.cached_tokens, r.evicted_tokens, r.inserted) for r in records], \
                counted_state(cache)

    assert run("c") == run("python")


def node_fields(node: TreeNode) -> dict:
    return {s: (getattr(node, s).id if s == "parent" and node.parent is not None
                else {k: v.id for k, v in node.children.items()} if s == "children"
                else getattr(node, s))
            for s in TreeNode.__slots__}


@needs_c
@pytest.mark.parametrize("requester", [Requester("r", -3, "chat"), None])
@pytest.mark.parametrize("under", ["a leaf", "a node with children"])
def test_the_two_nodes_cut_in_c_are_those_python_makes(requester, under):
    from itertools import count

    def made(cut_leaf) -> tuple:
        node = TreeNode(0, None, b"\x07\x00\x00\x00", range(1), 1, 0)
        if under == "a node with children":
            node.children = {b"\x09\x00\x00\x00": TreeNode(1, node, b"\x09\x00\x00\x00",
                                                           range(1), 2, 1)}
        kb = bytes(range(24))  # six tokens: the node's one, a head of two, a leaf of three
        pair = cut_leaf(count(5), node, kb, 4, 12, range(2), range(3), 40, 38, requester, -2)
        return [node_fields(x) for x in pair], sorted(node.children), \
            [x.id for x in node.children.values()]

    assert made(native.cut_leaf) == made(native.cut_leaf_py)
    head, leaf = made(native.cut_leaf)[0]
    assert (leaf["id"], head["id"], head["priority"], leaf["priority"]) == \
        (5, 6, -3 if requester else -2, -3 if requester else 0)


@needs_c
def test_the_c_walk_stops_where_the_python_walk_stops():
    cache = RadixCache(None)
    for r in requests_with_everything(seed=3, n=80):
        cache.replay_one(r.prompt, r.output, None)
    for r in requests_with_everything(seed=4, n=80):
        kb = r.prompt.tobytes() + r.output.tobytes()
        for end in range(0, len(kb) + 1, 4):
            assert native.match(cache.root, kb, end) == native.match_py(cache.root, kb, end)


@needs_c
def test_the_c_loops_refuse_what_is_not_a_tree_node():
    class Other:
        children, kb = {}, b""

    with pytest.raises(TypeError, match="TreeNode"):
        native.match(Other(), b"\x00" * 8, 8)
    with pytest.raises(TypeError, match="TreeNode"):
        native.touch(Other(), [], [], 0, None)


@needs_c
def test_a_node_class_with_other_fields_is_refused_and_the_bound_one_kept():
    from testbed.cache import _radix_core
    from testbed.cache.tree_node import NO_CHILDREN

    class Grown:
        __slots__ = (*TreeNode.__slots__, "extra")

    class Renamed:
        __slots__ = (*TreeNode.__slots__[:-1], "history2")

    for other in (Grown, Renamed):
        with pytest.raises(TypeError, match="bind"):
            _radix_core.bind(other, NO_CHILDREN)
    cache = RadixCache(None)  # the C loops still serve TreeNode
    cache.replay_one(np.arange(6, dtype=np.int32), np.arange(2, dtype=np.int32))
    assert native.match(cache.root, np.arange(8, dtype=np.int32).tobytes(), 24)[1] == 24


def test_policies_other_than_lru_and_pages_other_than_one_keep_the_python_eviction():
    # The C eviction is LeafEviction's LRU over whole one-token leaves; every other rule keeps
    # the method's own loop (and its hooks).
    assert RadixCache(10, policy=EVICTION.build("lfu")).eviction._evict_lru is None
    assert RadixCache(10, evict_unit="page").eviction._evict_lru is None
    assert RadixCache(10, page_size=2).eviction._evict_lru is None
    assert (RadixCache(10).eviction._evict_lru is not None) == native.NATIVE
