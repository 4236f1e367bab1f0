"""What history an eviction policy sees under SGLang 0.4.10's single insert and 0.5.23's checkpoint
insert (docs/design.md §4, *Checkpoint insert* and *What a policy sees*; issue 48).

The cause of "learned and LRU-K fall back to LRU under 0.5.23", node by node:

- 0.5.23's checkpoint cuts every finished request's leaf at its prompt's end by an insert walk.
  SGLang's own node keeps its statistics across the cut (the new head copies ``hit_count`` and
  ``priority``; checked field by field against the wheel: ``experiments/validation/
  sglang/checkpoint_fields.py``), and so does ours. But a policy that keeps history by entry id
  heard nothing of the cut: the head, the prompt a continued conversation re-reads, was a new id
  with no history, and the history stayed with the output tail, which nobody reads again. The
  tree now tells policies of every cut (`EvictionPolicy.on_split`).
- The checkpoint then touches the request's path twice more (the prompt's insert and a look-up of
  the whole key): the cache's clock runs 2.5x as fast per request on a conversation trace, and a
  policy that reads a change of ``last_access`` as a use (the LRU-K example did) sees two uses of
  every entry at its creation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from testbed.cache import RadixCache
from testbed.cache.eviction import EvictionPolicy
from testbed.cache.learned import LearnedEviction
from tests.conftest import toks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from my_policies import LRUK  # noqa: E402


def serve(cache: RadixCache, prompt: list[int], output: list[int]) -> int:
    """One request through acquire, extend and release (the replay backend's calls)."""
    seq = toks(*prompt, *output)
    lease = cache.acquire(toks(*prompt))
    cache.extend(lease, len(seq) - lease.hit)
    cache.release(lease, seq)
    return lease.hit


class Heard(EvictionPolicy):
    """LRU that writes down every hook call: (hook, the node's tokens, its id)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_create(self, entry) -> None:
        self.calls.append(("create", tuple(entry.key.tolist()), entry.id))

    def on_hit(self, entry) -> None:
        self.calls.append(("hit", tuple(entry.key.tolist()), entry.id))

    def on_split(self, head, tail) -> None:
        self.calls.append(("split", tuple(head.key.tolist()), head.id,
                           tuple(tail.key.tolist()), tail.id))


@pytest.mark.parametrize("release, calls", [
    ("0.4.10", [("create", (1, 2, 3, 4, 5), 1)]),
    # the checkpoint's prompt insert cuts the new leaf: head [1, 2, 3] is a new node (id 2), the
    # output [4, 5] keeps the leaf's id; no create or hit for the head
    ("0.5.23", [("create", (1, 2, 3, 4, 5), 1), ("split", (1, 2, 3), 2, (4, 5), 1)])])
def test_a_checkpoint_cuts_the_new_leaf_at_the_prompt_and_the_policy_hears_of_it(release, calls):
    policy = Heard()
    serve(RadixCache(None, policy=policy, sglang=release), [1, 2, 3], [4, 5])
    assert policy.calls == calls


def test_the_prompts_head_keeps_the_statistics_sglang_copies_and_the_tail_keeps_its_own():
    cache = RadixCache(None)
    serve(cache, [1, 2, 3], [4, 5])
    head, tail = sorted(cache.nodes(), key=lambda n: n.start)
    assert (head.key.tolist(), tail.key.tolist()) == ([1, 2, 3], [4, 5])
    # hits copied (SGLang's _split_node: hit_count, priority), the head a new, newer node
    assert (head.hits, tail.hits) == (1, 1)
    assert (head.priority, tail.priority) == (-1, 0)  # the prompt's insert: one more urgent
    assert head.created > tail.created and head.id > tail.id


class WithoutSplits(LearnedEviction):
    """The learned policy as it was before it heard of splits."""

    on_split = EvictionPolicy.on_split


@pytest.mark.parametrize("policy_class, labels", [(LearnedEviction, [1]), (WithoutSplits, [])])
@pytest.mark.parametrize("release", ["0.5.23", "0.4.10"])
def test_a_continued_conversation_labels_its_previous_turn_reused(release, policy_class, labels):
    """Turn 2 re-reads turn 1's prompt but not its output, and its walk stops inside turn 1's last
    prompt block (a Mooncake trace's partial last block), cutting the node there. Under 0.4.10
    that cut is of the leaf the label waits on; under 0.5.23 the checkpoint has cut it before, at
    the prompt's end, and the label waits on the output tail: without `on_split` the reuse goes
    unseen and the label, when it comes, is 0 (the Mooncake conversation trace at 3M tokens:
    64 labels 1 of 11,741, against 3,317 of 12,693 under 0.4.10)."""
    policy = policy_class(horizon=10**6)
    cache = RadixCache(None, policy=policy, sglang=release)
    serve(cache, [1, 2, 3, 4], [5, 6])
    assert serve(cache, [1, 2, 3, 9, 10], [11]) == 3
    got = [label for _, _, label in policy.window]
    assert got == (labels if release == "0.5.23" else [1])


def test_under_a_checkpoint_the_prompts_head_carries_the_turn_and_the_pending_label():
    policy = LearnedEviction(horizon=10**6)
    cache = RadixCache(None, policy=policy)
    serve(cache, [1, 2, 3], [4, 5])
    serve(cache, [1, 2, 3, 6], [7])  # turn 2 below turn 1's prompt
    by_key = {tuple(n.key.tolist()): n for n in cache.nodes()}
    assert policy._turn[by_key[1, 2, 3].id] == 1 and policy._turn[by_key[6,].id] == 2
    assert [label for _, _, label in policy.window] == [1]  # turn 1 reused by turn 2
    # turn 2's new leaf and its output tail are pending; turn 1's output tail too (as a tail)
    assert {by_key[6,].id, by_key[7,].id, by_key[4, 5].id} <= set(policy._pending)
    assert policy._pending[by_key[4, 5].id][1][6] == 1  # flagged as a split's tail
    cache.check_invariants()


@pytest.mark.parametrize("release, ticks", [("0.4.10", 9), ("0.5.23", 22)])
def test_the_checkpoint_walks_tick_the_cache_clock_but_not_the_learned_policys(release, ticks):
    policy = LearnedEviction()
    cache = RadixCache(None, policy=policy, sglang=release)
    serve(cache, [1, 2, 3], [4, 5])
    serve(cache, [1, 2, 3, 6], [7])
    assert (cache._clock, policy.now) == (ticks, 2)  # requests: the same under both releases


@pytest.mark.parametrize("release", ["0.5.23", "0.4.10"])
def test_lru_k_counts_uses_its_hooks_saw_not_every_refresh_of_recency(release):
    """The checkpoint's look-up refreshes the new leaf's ``last_access`` right after its insert;
    LRU-K read that as a second use, so under 0.5.23 every entry had two uses at its creation and
    the K=2 order was LRU's. It counts creations and hits now (its hooks)."""
    policy = LRUK(k=2)
    cache = RadixCache(None, policy=policy, sglang=release)
    serve(cache, [1, 2, 3], [4, 5])
    leaves = [n for n in cache.nodes() if not n.children]
    assert [policy.priority(n)[0] for n in leaves] == [-1]  # one use: below any used twice


WHEEL = Path.home() / ".cache" / "radix-testbed" / "sglang-0.5.23" / "src"


@pytest.mark.parametrize("strategy", ["lru", "lfu", "slru", "size_aware"])
def test_every_node_field_agrees_with_sglang_0_5_23s_own_tree_after_each_checkpoint(strategy):
    """Where the wheel has been fetched (python -m experiments.validation.sglang.checkpoint_fields
    fetches it): one random case, every request's hit and evictions and, after each, every node's
    hit count, priority, creation order and access order as 0.5.23's RadixCache keeps them."""
    if not (WHEEL / "sglang" / "srt" / "mem_cache" / "radix_cache.py").exists():
        pytest.skip(f"SGLang 0.5.23's wheel is not unpacked at {WHEEL}")
    from experiments.validation.sglang import checkpoint_fields as fields
    from experiments.validation.sglang import replay, wheel

    sgl = wheel.load(WHEEL, fields.RELEASE)
    runs = replay.random_runs(5)
    counts = fields.check_case(sgl, runs, replay.capacities(runs, fields.RELEASE)["evict"],
                               strategy)
    assert counts["agree"] == counts["requests"] == 100
    assert all(counts[f] == counts["snapshots"] == 100 for f in fields.FIELDS)
