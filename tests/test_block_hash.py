"""Exact behaviour of the block-hash cache (vLLM V1 prefix caching, docs/design.md §4)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.cache.block_hash import BlockHashCache
from testbed.backends.replay import replay
from testbed.workloads.request import Request
from tests.conftest import toks


def serve(cache: BlockHashCache, prompt, output=()) -> tuple[int, int]:
    """One replayed request; returns (hit, evicted)."""
    (rec,) = replay([Request("r", toks(*prompt), toks(*output))], cache)
    cache.check_invariants()
    return rec.cached_tokens, rec.evicted_tokens


def test_a_partial_block_is_never_cached():
    cache = BlockHashCache(capacity=64, block_size=4)
    serve(cache, range(6))          # one full block [0..3], partial [4, 5]
    assert cache.total_size == 4
    assert serve(cache, [0, 1, 2, 3, 4, 5, 6, 7, 8])[0] == 4


def test_the_last_prompt_token_is_never_a_hit():
    cache = BlockHashCache(capacity=64, block_size=4)
    serve(cache, range(8))
    assert cache.match(toks(*range(8))) == 4  # both blocks cached, only (8-1)//4 = 1 eligible
    assert serve(cache, range(8))[0] == 4
    assert serve(cache, range(9))[0] == 8


def test_output_blocks_are_cached_for_later_turns():
    cache = BlockHashCache(capacity=64, block_size=4)
    serve(cache, [1, 2, 3, 4], [5, 6, 7, 8])
    assert serve(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9])[0] == 8


def test_least_recently_freed_blocks_are_evicted_first():
    cache = BlockHashCache(capacity=16, block_size=4)  # 4 blocks
    serve(cache, range(0, 4))      # A
    serve(cache, range(10, 14))    # B
    serve(cache, range(20, 24))    # C
    serve(cache, range(30, 34))    # D: the queue is now A, B, C, D (all keyed)
    # A is reused (taken out of the queue); the partial block pops the head: B loses its key.
    assert serve(cache, range(0, 5)) == (4, 4)
    # Freed: the unkeyed partial block to the head, A to the tail: queue free, C, D, A.
    assert serve(cache, range(40, 48)) == (0, 4)  # the free block, then C (evicted)
    assert cache.match(toks(*range(10, 15))) == 0
    assert cache.match(toks(*range(20, 25))) == 0
    assert cache.match(toks(*range(30, 35))) == 4
    assert cache.match(toks(*range(0, 5))) == 4


def test_a_requests_blocks_are_evicted_tail_first():
    cache = BlockHashCache(capacity=12, block_size=4)  # 3 blocks
    serve(cache, range(12))   # blocks X0 X1 X2 freed last to first: queue X2, X1, X0
    hit, evicted = serve(cache, range(100, 104))
    assert (hit, evicted) == (0, 4)
    # X2 (the tail of the sequence) went first; the first two blocks still hit.
    assert cache.match(toks(*range(9))) == 8


def test_a_request_with_more_blocks_than_the_cache_is_served_uncached():
    cache = BlockHashCache(capacity=8, block_size=4)
    serve(cache, range(4))
    (rec,) = replay([Request("big", toks(*range(12)), toks())], cache)
    assert (rec.cached_tokens, rec.evicted_tokens, rec.inserted) == (0, 0, False)
    assert cache.match(toks(*range(5))) == 4  # nothing changed


def test_a_duplicate_key_is_registered_twice_and_lookups_use_the_older_block():
    cache = BlockHashCache(capacity=64, block_size=4)
    a = cache.acquire(toks(1, 2, 3, 4, 5))
    b = cache.acquire(toks(1, 2, 3, 4, 5))
    cache.extend(a, 5)
    cache.extend(b, 5)
    cache.check_invariants([a, b])
    cache.release(a, toks(1, 2, 3, 4, 5))
    cache.release(b, toks(1, 2, 3, 4, 5))
    assert cache.total_size == 8  # the same key on two blocks
    lease = cache.acquire(toks(1, 2, 3, 4, 5))
    assert lease.handle.blocks == a.handle.blocks[:1]
    cache.release(lease, toks(), insert=False)
    cache.check_invariants()


def test_slots_are_block_contiguous_and_skip_slot_zero():
    cache = BlockHashCache(capacity=8, block_size=4)
    lease = cache.acquire(toks(1, 2, 3))
    cache.extend(lease, 6)
    assert lease.slots.tolist() == [1, 2, 3, 4, 5, 6]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 6), st.lists(st.tuples(st.lists(st.integers(0, 2), max_size=12),
                                             st.lists(st.integers(0, 2), max_size=4),
                                             st.booleans()), min_size=30, max_size=50))
def test_block_accounting_stays_consistent_with_overlapping_requests(blocks, ops):
    cache = BlockHashCache(capacity=4 * blocks, block_size=4)
    held = []
    for prompt, output, keep in ops:
        prompt, seq = toks(*prompt), toks(*prompt, *output)
        lease = cache.acquire(prompt)
        evicted = cache.extend(lease, len(seq) - lease.hit)
        if evicted is None:
            cache.release(lease, seq, insert=False)
        elif keep and len(held) < 2:
            held.append((lease, seq))
        else:
            cache.release(lease, seq)
        if held and not keep:
            cache.release(*held.pop(0))
        cache.check_invariants([lease for lease, _ in held])
        assert cache.total_size <= 4 * blocks
    for lease, seq in held:
        cache.release(lease, seq)
    cache.check_invariants()
    assert cache.protected_size == 0
    assert np.isclose(cache.evictable_size % 4, 0)


def test_unbounded_cache_never_evicts_and_hits_like_a_cache_too_big_to_fill():
    from testbed.workloads.synthetic import shared_prefix

    requests = shared_prefix(num_groups=5, prompts_per_group=4, system_prompt_len=70,
                             question_len=9, output_len=11, seed=2)
    unbounded = replay(requests, BlockHashCache(None, block_size=4))
    huge = replay(requests, BlockHashCache(10**6, block_size=4))
    assert sum(r.evicted_tokens for r in unbounded) == 0
    assert [r.cached_tokens for r in unbounded] == [r.cached_tokens for r in huge]
    assert sum(r.cached_tokens for r in unbounded) >= 5 * 3 * 68


def block_state(cache: BlockHashCache) -> list:
    """What a block-hash cache holds that a later request or a policy could see."""
    keyed = np.flatnonzero(cache._keyed[: cache._minted]).tolist()
    stats = sorted((b, s.created, s.last_access, s.access_count, s.priority, s.start)
                   for b, s in cache._stats.items())
    return [cache._free.blocks(), keyed, cache._key[keyed].tolist(), stats,
            sorted(cache._index.holders().items()), cache.evictable_size, cache.protected_size]


@pytest.mark.parametrize("policy", ["lru", "lfu", "mru", "gdsf"])
@pytest.mark.parametrize("capacity", [None, 400, 120])
def test_block_hash_replay_in_one_pass_equals_acquire_extend_release(policy, capacity):
    # Two-token vocabularies and 3-token blocks: duplicate keys, hits, evictions all common.
    from testbed.cache import EVICTION, PrefixCache, Requester
    from testbed.workloads.synthetic import random_tree

    requests = random_tree(num_requests=300, root_len=9, segment_len=5, output_len=3, vocab_size=2,
                           seed=5)
    fused, calls = (BlockHashCache(capacity, block_size=3, policy=EVICTION.build(policy))
                    for _ in range(2))
    duplicates = False
    for r in requests:
        who = Requester(r.id, r.priority, r.category)
        assert fused.replay_one(r.prompt, r.output, who) == \
            PrefixCache.replay_one(calls, r.prompt, r.output, who)
        assert block_state(fused) == block_state(calls)
        duplicates |= fused._index.has_duplicates
    fused.check_invariants()
    assert duplicates, "the case should make duplicate keys"


def test_block_keys_are_the_same_however_a_sequence_is_cut():
    # Whole, or a known head then the rest (as release extends a prompt's keys), in short runs
    # (the chain in Python ints) or long ones (one cumulative sum): the same keys.
    cache = BlockHashCache(None, block_size=4)
    tokens = np.random.default_rng(0).integers(0, 50, 4 * 60 + 3).astype(np.int32)
    whole = cache.block_keys(tokens)
    assert len(whole) == 60 and len(set(whole.tolist())) == 60
    for head in (0, 1, 5, 17, 44, 59, 60):
        known = cache.block_keys(tokens[: 4 * head])
        assert cache.block_keys(tokens, known=known).tolist() == whole.tolist()
    assert cache.block_keys(tokens[:7]).tolist() == whole[:1].tolist()


# ---------------------------------------------------------------- against vLLM's rules, brute force
def sibling_tree(num_requests: int = 1200):
    """Random-tree calls whose siblings repeat their parent's continuation (no fresh segment), so
    many blocks are registered again under a key another block holds: duplicates that a tight
    pool pops together."""
    from testbed.workloads.synthetic import random_tree

    return random_tree(num_requests=num_requests, root_len=64, segment_len=0, output_len=16,
                       seed=1)


def capacities(requests, block_size: int) -> list[int | None]:
    """From the smallest pool that holds the largest request (whole blocks) to unbounded."""
    b = block_size
    total = sum(len(r.prompt) + len(r.output) for r in requests)
    fit = -(-max(len(r.prompt) + len(r.output) for r in requests) // b) * b
    return [fit, fit + b, fit * 5 // 4 // b * b, fit * 3 // 2 // b * b, 2 * fit,
            total // 50 // b * b, total // 10 // b * b, None]


@pytest.mark.parametrize("block_size", [4, 16])
def test_tight_pools_replay_hits_and_evictions_exactly_as_vllms_rules(block_size):
    # Before the fix, 13 of these 16 replays stopped in _forget with "list.remove(x): x not in
    # list": a pop took a key's first holder and then its heir, already promoted in the same pop.
    from tests.vllm_blocks import VllmBlocks

    requests = sibling_tree()
    for capacity in capacities(requests, block_size):
        cache = BlockHashCache(capacity, block_size)
        reference = VllmBlocks(None if capacity is None else capacity // block_size, block_size)
        got = [(r.cached_tokens, r.evicted_tokens) for r in replay(requests, cache)]
        want = [reference.serve(r.prompt.tolist(), r.output.tolist()) for r in requests]
        assert got == want, f"capacity {capacity}"
        cache.check_invariants()
        assert sum(e for _, e in want) > 0 or capacity is None or capacity > 20000


@settings(max_examples=150, deadline=None, derandomize=True)
@given(block_size=st.sampled_from([1, 2, 3, 4, 16]), extra_blocks=st.integers(0, 4),
       unbounded=st.booleans(), vocab=st.sampled_from([1, 2, 3]),
       calls=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 12), st.integers(0, 8),
                                st.integers(0, 2**16)), min_size=1, max_size=40))
def test_batched_replay_equals_a_brute_force_model_of_vllms_rules(block_size, extra_blocks,
                                                                  unbounded, vocab, calls):
    # Requests continue earlier ones (shared prefixes, repeated prompts, duplicate keys), over a
    # vocabulary of 1-3 token ids (token 0 included); the pool is as small as the largest request,
    # in whole blocks, or a few blocks more, or unbounded.
    from tests.vllm_blocks import VllmBlocks

    rng = np.random.default_rng(calls[0][3])
    seqs: list[list[int]] = []
    requests = []
    for parent, prompt_len, output_len, _ in calls:
        head = seqs[parent % len(seqs)][: prompt_len] if seqs and parent % 3 else []
        prompt = head + rng.integers(0, vocab, max(prompt_len - len(head), 0)).tolist()
        output = rng.integers(0, vocab, output_len).tolist()
        seqs.append(prompt + output)
        requests.append(Request(f"r{len(requests)}", toks(*prompt), toks(*output)))
    longest = max(len(s) for s in seqs)
    num_blocks = None if unbounded else -(-longest // block_size) + extra_blocks
    cache = BlockHashCache(None if unbounded else num_blocks * block_size, block_size)
    reference = VllmBlocks(num_blocks, block_size)
    for r in requests:
        (rec,) = replay([r], cache)
        assert (rec.cached_tokens, rec.evicted_tokens) == \
            reference.serve(r.prompt.tolist(), r.output.tolist())
        cache.check_invariants()


def test_a_leading_block_of_token_zero_is_not_keyed_like_no_block():
    # The digest of an all-zero block was 0 and the chain starts from 0, so [0] + X was keyed
    # like X: a request starting with X hit the blocks of one starting with 0.
    cache = BlockHashCache(capacity=64, block_size=1)
    serve(cache, [0, 1, 2, 3])
    assert cache.match(toks(1, 2, 3, 4)) == 0
    assert cache.match(toks(0, 1, 2, 9)) == 3


def test_popping_every_holder_of_a_key_at_once_evicts_them_all():
    # Three requests compute the same prompt at once: three holders of each key. One pop then
    # takes all six blocks; it used to promote a holder popped in the same call as the heir.
    cache = BlockHashCache(capacity=24, block_size=4)
    prompt = toks(*range(8))
    leases = [cache.acquire(prompt) for _ in range(3)]  # all miss: three holders of each key
    for lease in leases:
        cache.extend(lease, 8)
    for lease in leases:
        cache.release(lease, prompt)
    cache.check_invariants()
    big = cache.acquire(toks(*range(100, 124)))  # every block of the pool, all six cached
    assert cache.extend(big, 24) == 24
    cache.check_invariants([big])
    assert cache.match(prompt) == 0


def test_peek_counts_a_hit_and_its_blocks_in_the_free_queue_without_touching_anything():
    """What vLLM's admission counts (`testbed.scheduler.vllm`): the hit, and how many of its
    blocks taking it would pull out of the free queue; a look-up changes nothing."""
    cache = BlockHashCache(capacity=40, block_size=4)
    prompt = np.arange(1, 14, dtype=np.int32)  # 13 tokens: 3 whole blocks
    held = cache.acquire(prompt)
    cache.extend(held, 13)
    cache.commit(held, prompt)
    assert cache.peek(prompt) == (12, 0)  # all three blocks held by the running request
    cache.release(held, prompt)
    free = cache.free_blocks
    assert cache.peek(prompt) == (12, 3) and cache.peek(prompt, limit=5) == (4, 1)
    assert cache.free_blocks == free == 10 and cache.protected_size == 0


def test_unkeyed_blocks_freed_together_go_to_the_head_the_last_block_first():
    # vLLM's BlockPool.free_blocks: the request's blocks, last first, unhashed ones prepended to
    # the free queue as one list (FreeKVCacheBlockQueue.prepend_n), so its last block is reused
    # first, then the one before it
    cache = BlockHashCache(16, block_size=4)
    lease = cache.acquire(toks(1))
    cache.extend(lease, 10)  # blocks 0, 1, 2
    cache.release(lease, toks(*range(1, 11)), insert=False)
    assert cache._free.blocks() == [2, 1, 0, 3]


def test_rewind_keeps_the_blocks_past_the_kept_tokens_and_the_next_extend_reuses_them():
    cache = BlockHashCache(16, block_size=4)
    lease = cache.acquire(toks(1, 2, 3, 4, 5))
    cache.extend(lease, 9)  # 9 tokens: blocks 0, 1, 2
    cache.commit(lease, toks(1, 2, 3, 4, 5, 6))  # block 0 keyed
    cache.rewind(lease, 6)
    assert lease.num_tokens == 6 and cache.free_blocks == 1
    assert cache.extension_cost(lease, 6) == 0
    cache.extend(lease, 6)  # 12 tokens still fit its 3 blocks
    assert cache.free_blocks == 1
    with pytest.raises(ValueError):
        cache.rewind(lease, 3)  # inside the keyed block
    cache.check_invariants([lease])
