"""Speculative decoding in the shared scheduler and the cache: n-gram drafts, the KV slots a
verification takes and gives back, only verified tokens cached, the config block's checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from testbed.cache import BlockHashCache, RadixCache
from testbed.config.assembly import assemble
from testbed.errors import BadInput
from testbed.scheduler.ngram import ngram_draft
from testbed.scheduler.scheduler import Scheduler
from testbed.scheduler.speculative import SpeculativeConfig, check_speculative
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.spec_steps import exact_accepted
from testbed.sim.acceptance import Acceptance
from testbed.workloads.request import Request
from tests.conftest import toks

NGRAM = SpeculativeConfig(method="ngram", num_tokens=3, ngram_min=1, ngram_max=3)


# ------------------------------------------------------------------ the n-gram drafter
def test_ngram_proposes_what_followed_the_longest_earlier_match_of_the_suffix():
    # suffix [1, 2, 3] occurs at 0 (followed by 4, 1); a 2-gram search would find the same
    assert ngram_draft(toks(1, 2, 3, 4, 1, 2, 3), 2, 2, 3).tolist() == [4, 1]


def test_ngram_tries_longer_suffixes_first_and_takes_the_earliest_occurrence():
    # [7, 8] occurs at 0 (-> 1) and at 4 (-> 2); the 3-gram [6, 7, 8] only at 3 (-> 2)
    context = toks(7, 8, 1, 6, 7, 8, 2, 6, 7, 8)
    assert ngram_draft(context, 1, 2, 3).tolist() == [2]
    assert ngram_draft(context, 1, 2, 2).tolist() == [1]


def test_ngram_proposes_fewer_than_k_near_the_end_and_nothing_without_a_match():
    assert ngram_draft(toks(5, 6, 9, 5, 6), 4, 1, 3).tolist() == [9, 5, 6]
    assert ngram_draft(toks(5, 6, 7), 4, 1, 3).tolist() == []
    assert ngram_draft(toks(5), 4, 1, 3).tolist() == []


# ------------------------------------------------------------------ the cache's truncate
def test_truncate_frees_the_slots_past_the_kept_tokens_page_1():
    cache = RadixCache(64)
    lease = cache.acquire(toks(*range(10, 16)))
    cache.extend(lease, 9)
    free = cache.pool.num_free
    kept = lease.slots[:7].copy()
    assert cache.truncate(lease, 7) == 2
    assert cache.pool.num_free == free + 2
    assert lease.slots.tolist() == kept.tolist() and lease.num_tokens == 7


def test_truncate_keeps_the_rest_of_the_last_page_spare_and_frees_whole_pages():
    cache = RadixCache(64, page_size=4)
    lease = cache.acquire(toks(*range(10, 16)))
    cache.extend(lease, 11)  # 11 tokens in 3 pages: one spare slot
    assert len(lease.spare) == 1
    free = cache.pool.num_free
    third_page_first = lease.slots[8]
    assert cache.truncate(lease, 7) == 4  # page 3 (3 slots + the spare) goes back
    assert cache.pool.num_free == free + 4
    assert lease.num_tokens == 7 and len(lease.spare) == 1
    assert third_page_first in cache.pool.free_slots()


def test_block_hash_truncate_gives_back_the_blocks_past_the_last_kept_one():
    cache = BlockHashCache(64, block_size=4)
    lease = cache.acquire(toks(*range(10, 16)))
    cache.extend(lease, 11)  # 3 blocks
    free = cache.available_size
    assert cache.truncate(lease, 7) == 4
    assert cache.available_size == free + 4 and lease.num_tokens == 7
    cache.release(lease, toks(*range(10, 17)), insert=False)
    cache.check_invariants()


# ------------------------------------------------------------------ scheduler steps
PROMPT = (1, 2, 3, 4, 5, 1, 2, 3)


def spec_scheduler(cache) -> Scheduler:
    return Scheduler(cache, SchedulerConfig(), speculative=NGRAM, check_invariants=True)


def prefilled(cache, output=(4, 5, 9, 9)):
    s = spec_scheduler(cache)
    req = s.submit(Request("r", toks(*PROMPT), toks(*output)), 0.0)
    batch = s.next_batch(0.0)
    assert batch.kind == "prefill"
    s.complete(batch, [output[0]], 1.0)
    return s, req


@pytest.mark.parametrize("make", [lambda: RadixCache(64), lambda: BlockHashCache(64, block_size=4)],
                         ids=["radix", "block_hash"])
def test_a_verification_step_keeps_accepted_drafts_and_frees_the_rejected_slots(make):
    cache = make()
    s, req = prefilled(cache)
    free = cache.available_size
    batch = s.next_batch(1.0)
    (entry,) = batch.entries
    # context [.. 2, 3, 4]: the 3-gram [2, 3, 4] at 1 was followed by [5, 1, 2]; the output has
    # room for 3 more tokens, one of them the bonus: two drafts
    assert entry.draft.tolist() == [5, 1]
    assert (entry.context, entry.new) == (8, 3)
    assert entry.input_ids().tolist() == [4, 5, 1]
    assert len(entry.kv_slots()) == 11
    s.complete(batch, [(5, 9)], 2.0)  # draft 5 accepted, 1 rejected; bonus 9
    assert req.output == [4, 5, 9] and req.computed == 10
    assert req.lease.num_tokens == 10
    s.next_batch(2.0)  # (applies nothing more: overlap is off)
    assert s.spec.stats.summary()["spec_accepted"] == 1
    assert s.spec.stats.freed_slots == 1


def test_only_verified_tokens_enter_the_radix_tree_at_finish():
    cache = RadixCache(64)
    s, req = prefilled(cache)
    s.complete(s.next_batch(1.0), [(5, 9)], 2.0)
    batch = s.next_batch(2.0)
    (entry,) = batch.entries
    assert entry.draft.tolist() == [] and entry.new == 1  # one token left: the bonus only
    assert s.complete(batch, [(9,)], 3.0) == [req]
    assert req.output == [4, 5, 9, 9]
    assert cache.match(toks(*PROMPT, 4, 5, 9, 9, 0)) == 11  # all but the last output
    assert cache.match(toks(*PROMPT, 4, 5, 1, 0)) == 10  # the rejected draft is not there
    s.check_drained()
    assert cache.pool.num_free == 64 - 11


def test_block_hash_registers_only_blocks_full_of_verified_tokens():
    cache = BlockHashCache(64, block_size=4)
    s, req = prefilled(cache)
    s.complete(s.next_batch(1.0), [(5, 9)], 2.0)
    s.complete(s.next_batch(2.0), [(9,)], 3.0)
    s.check_drained()
    # 11 tokens with KV: 2 full blocks ([1..4], [5, 1, 2, 3]); the third (4, 5, 9) is partial
    assert cache.match(toks(*PROMPT, 4, 5, 9, 9, 0)) == 8
    assert cache.total_size == 8


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    cache = RadixCache(64)
    s = spec_scheduler(cache)
    s.eos_token_ids = frozenset({5})
    req = s.submit(Request("r", toks(*PROMPT), None, max_new_tokens=6), 0.0)
    s.complete(s.next_batch(0.0), [4], 1.0)
    batch = s.next_batch(1.0)
    assert batch.entries[0].draft.tolist() == [5, 1, 2]
    assert s.complete(batch, [(5, 1, 2, 7)], 2.0) == [req]
    assert req.output == [4, 5]
    s.check_drained()
    assert cache.match(toks(*PROMPT, 4, 5, 0)) == 9  # prompt and the first output only


def test_drafts_are_dropped_when_their_room_is_not_there():
    cache = RadixCache(10)  # prompt 8 + one token: no room for drafts
    s, req = prefilled(cache, output=(4, 5))
    batch = s.next_batch(1.0)
    (entry,) = batch.entries
    assert entry.draft.tolist() == [] and entry.new == 1


# ------------------------------------------------------------------ the simulator's acceptance
def test_exact_acceptance_counts_the_drafts_equal_to_the_workload_output():
    assert exact_accepted(toks(5, 1, 2), toks(5, 1, 7)) == 2
    assert exact_accepted(toks(5, 1), toks(5)) == 1
    cache = RadixCache(64)
    s, req = prefilled(cache, output=(4, 5, 1, 9))
    batch = s.next_batch(1.0)
    assert Acceptance("exact").tokens(batch.entries[0]) == (5, 1, 9)


def test_geometric_acceptance_is_seeded_and_bounded_by_the_drafts():
    cache = RadixCache(64)
    s, req = prefilled(cache, output=(4, 7, 7, 7))
    entry = s.next_batch(1.0).entries[0]
    draws = [Acceptance("geometric", 0.5, seed=3).tokens(entry) for _ in range(2)]
    assert draws[0] == draws[1]
    assert Acceptance("geometric", 1.0).tokens(entry) == (7, 7, 7)
    assert Acceptance("geometric", 0.0).tokens(entry) == (7,)


def write_requests(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_recorded_acceptance_replays_each_requests_counts_in_order_at_most_its_drafts(tmp_path):
    cache = RadixCache(64)
    s, req = prefilled(cache, output=(4, 5, 1, 9))  # drafts 5, 1, 2: exact accepts 2
    entry = s.next_batch(1.0).entries[0]
    path = write_requests(tmp_path / "requests.jsonl", [{"id": "r", "spec_accepted": [0, 1, 7]}])
    recorded = Acceptance("recorded", path=tmp_path)  # the run directory holding it
    assert Acceptance("exact").tokens(entry) == (5, 1, 9)
    assert recorded.tokens(entry) == (5,)  # the run's first step accepted none
    assert recorded.tokens(entry) == (5, 1)
    assert recorded.tokens(entry) == (5, 1, 9)  # 7 recorded: at most the 3 drafts there are
    with pytest.raises(BadInput, match=r"speculative.acceptance_path: request 'r' verifies more "
                                       r"often than the 3 steps .* recorded for it"):
        recorded.tokens(entry)
    recorded.check_requests(["r"])
    with pytest.raises(BadInput, match=r"speculative.acceptance_path: 1 of the workload's "
                                       r"requests are not in .* \(first: 'q'\)"):
        recorded.check_requests(["r", "q"])


@pytest.mark.parametrize("rows, message", [
    (None, "no such run directory or requests.jsonl"),
    ([{"id": "a", "output_tokens": 3}], r"requests.jsonl:1 \(request a\) has no spec_accepted: "
                                        r"not a run with speculative decoding"),
    ([{"id": "a", "spec_accepted": [1, -1]}], "spec_accepted must be a list of integers >= 0"),
    ([], "holds no requests"),
])
def test_recorded_acceptance_refuses_a_bad_record_naming_the_key(tmp_path, rows, message):
    path = tmp_path / "requests.jsonl"
    if rows is not None:
        write_requests(path, rows)
    with pytest.raises(BadInput, match="speculative.acceptance_path: .*" + message):
        Acceptance("recorded", path=path)


def test_a_recorded_acceptance_file_is_read_and_refused_at_assembly(tmp_path, compose):
    # the fuzzer, seed 6006 #2944: an empty file was refused only once the run had begun
    path = tmp_path / "requests.jsonl"
    path.write_text("")
    with pytest.raises(BadInput, match=r"^speculative.acceptance_path: .*requests.jsonl holds "
                                       r"no requests$"):
        assemble(compose("backend=sim", "speculative.method=ngram", "scheduler.overlap=false",
                         "speculative.acceptance=recorded", f"speculative.acceptance_path={path}"))


# ------------------------------------------------------------------ the config block
@pytest.mark.parametrize("cfg, message", [
    ({"method": "eagle"}, "speculative.method must be one of none, ngram, draft; got 'eagle'"),
    ({"method": "ngram", "num_tokens": 0}, "speculative.num_tokens must be >= 1, got 0"),
    ({"method": "ngram", "ngram_min": 3, "ngram_max": 2},
     "speculative.ngram_max (2) must be >= speculative.ngram_min (3)"),
    ({"speed": 1}, "speculative.speed is not a setting of speculative; allowed: method,"),
    ({"method": "ngram", "acceptance": "oracle"},
     "speculative.acceptance must be one of exact, geometric, recorded; got 'oracle'"),
    ({"method": "ngram", "acceptance": "recorded"},
     "speculative.acceptance=recorded needs speculative.acceptance_path"),
])
def test_bad_speculative_values_are_refused_naming_the_key(cfg, message):
    with pytest.raises(BadInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.from_mapping(cfg)


def test_speculative_needs_sglangs_scheduler_without_overlap_on_sim_or_engine():
    with pytest.raises(BadInput, match="needs scheduler.overlap=false"):
        check_speculative(NGRAM, SchedulerConfig(overlap=True), "sim")
    with pytest.raises(BadInput, match="needs backend=sim or backend=engine"):
        check_speculative(NGRAM, SchedulerConfig(), "replay")
    check_speculative(SpeculativeConfig(), SchedulerConfig(overlap=True), "replay")  # none: any


# ------------------------------------------------------------------ token trees (width 2)
TREE = SpeculativeConfig(method="ngram", num_tokens=3, tree_width=2, ngram_min=1, ngram_max=3)
TREE_PROMPT = (5, 1, 2, 9, 8, 6, 1, 2, 7, 6, 1)


def test_ngram_branches_differ_in_their_first_token_and_the_first_is_the_chains_draft():
    from testbed.scheduler.ngram import ngram_branches
    context = toks(*TREE_PROMPT, 2)
    # [6, 1, 2] at 5 -> 7, 6, 1; [1, 2] at 1 -> 9, 8, 6 ([1, 2] at 6 starts with 7 again)
    assert [b.tolist() for b in ngram_branches(context, 3, 1, 3, 2)] == [[7, 6, 1], [9, 8, 6]]
    assert ngram_draft(context, 3, 1, 3).tolist() == [7, 6, 1]


def test_a_tree_keeps_the_accepted_branchs_slots_after_the_root_and_frees_the_rest():
    cache = RadixCache(64)
    s = Scheduler(cache, SchedulerConfig(), speculative=TREE, check_invariants=True)
    req = s.submit(Request("r", toks(*TREE_PROMPT), toks(2, 9, 8, 4, 4, 4)), 0.0)
    s.complete(s.next_batch(0.0), [2], 1.0)
    batch = s.next_batch(1.0)
    (entry,) = batch.entries
    assert entry.draft.tolist() == [7, 6, 1, 9, 8, 6] and entry.branches == (3, 3)
    assert (entry.context, entry.new) == (11, 7)
    slots = entry.kv_slots().copy()
    free = cache.pool.num_free
    s.complete(batch, [(9, 8, 4)], 2.0)  # the second branch: 9, 8 accepted, then 4
    assert req.output == [2, 9, 8, 4] and req.computed == 14
    assert req.lease.slots.tolist() == [*slots[:12], slots[15], slots[16]]
    assert cache.pool.num_free == free + 4  # the first branch's 3 and the last of the second
    assert s.spec.stats.other_branch == 1
    s.complete(s.next_batch(2.0), [(4,)], 3.0)  # no match: no drafts
    s.complete(s.next_batch(3.0), [(4,)], 4.0)
    s.check_drained()
    assert cache.match(toks(*TREE_PROMPT, 2, 9, 8, 4, 4, 4, 0)) == 16
    assert cache.match(toks(*TREE_PROMPT, 2, 7, 0)) == 12  # the rejected branch is not there


def test_tree_width_needs_radix_page_1_and_torch_attention():
    from testbed.scheduler.speculative import check_tree
    with pytest.raises(BadInput, match="needs cache=radix with cache.page_size=1"):
        check_tree(TREE, "block_hash", 1, None, 0.0)
    with pytest.raises(BadInput, match="needs engine.attention=torch"):
        check_tree(TREE, "radix", 1, "triton", 0.0)
    with pytest.raises(BadInput, match="greedy only"):
        check_tree(TREE, "radix", 1, "torch", 0.7)
    check_tree(TREE, "radix", 1, "cascade_torch", 0.0)


def test_the_draft_model_drafts_placeholders_the_engine_fills_and_the_simulator_needs_a_rate():
    config = SpeculativeConfig(method="draft", num_tokens=3)
    assert config.drafter()(toks(1, 2, 3), 3).tolist() == [-1, -1, -1]
    with pytest.raises(BadInput, match="needs speculative.acceptance=geometric"):
        check_speculative(config, SchedulerConfig(), "sim")
    check_speculative(SpeculativeConfig(method="draft", acceptance="geometric"),
                      SchedulerConfig(), "sim")
    with pytest.raises(BadInput, match="speculative.draft_layers must be >= 1, got 0"):
        SpeculativeConfig.from_mapping({"method": "draft", "draft_layers": 0})
