"""SGLang 0.5.23's step rules (docs/design.md §4, "SGLang releases"; `ReleaseRules`): what a
prefill admits, how chunks are cut, when the batch is full, what is evicted and how far decode
retracts, each on a hand-made case with its exact outcome under both releases."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.cache import RadixCache
from testbed.scheduler.adder import PrefillAdder
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.release_rules import ReleaseRules
from testbed.scheduler.scheduler import Scheduler
from testbed.workloads.request import Request
from tests.conftest import toks
from tests.test_scheduler import cache_with, request, waiting
from tests.test_scheduler_fidelity import drive


def scheduler(cache, sglang="0.5.23", **config) -> Scheduler:
    return Scheduler(cache, SchedulerConfig(name="fcfs", sglang=sglang, **config))


def admitted(s: Scheduler) -> list[tuple[str, int]]:
    """The next prefill's (request, tokens computed) pairs."""
    return [(e.req.id, e.new) for e in s.next_batch().entries]


# ------------------------------------------------------------------ add_one_req's KV check
@pytest.mark.parametrize("second, ids", [(49, ["r0", "r1"]), (50, ["r0"])])
def test_each_admission_takes_a_page_more_of_the_kv_budget(second, ids):
    # PrefillBudget.check_prefill / reserve: r0 takes 40 + 4 outputs + 1 page of 100; r1 needs
    # second + 4 + 1 < 55 (0.4.10: second + 4 < 56, test_scheduler).
    s = scheduler(RadixCache(100), init_new_token_ratio=0.0)
    waiting(s, list(range(40)), list(range(100, 100 + second)), [7, 7])
    assert [rid for rid, _ in admitted(s)] == ids
    assert s.batch_is_full


@pytest.mark.parametrize("sglang, refused", [("0.5.23", None), ("0.4.10", "no_token")])
def test_a_retracted_request_reserves_only_the_outputs_it_has_left(sglang, refused):
    # add_one_req's max_new: min(max_new - outputs, clip). 10 prompt + 6 outputs to re-prefill,
    # 4 outputs left: 16 + 4 + 1 page < 25; 0.4.10 reserves all 10: 16 + 10 >= 25.
    cache = RadixCache(25)
    s = scheduler(cache, sglang)
    req = s.submit(request("r", range(10), out=10), 0.0)
    req.output = [1000, 1001, 1002, 1003, 1004, 1005]
    adder = PrefillAdder.for_step(cache, [], 0.7, 4096, 16384, None, 1, s.rules)
    result = adder.refusal(req, req.fill_len, 4096, locked=0, first=True)
    assert (result.value if result else None) == refused


@pytest.mark.parametrize("sglang, full", [("0.5.23", True), ("0.4.10", False)])
def test_kv_is_checked_once_with_the_prefix_locked_before_the_input_cap(sglang, full):
    # r1's 40-token prefix is cached (evictable, 100 free + cached): locked it leaves 60, less
    # r0's 10 + 4 (+ a page): r1's 20 + 30 (+ a page) does not fit, and its 20 tokens also pass
    # the input cap (25 - 10). 0.5.23 (_select_prefill_admission) answers NO_TOKEN: the batch is
    # full; 0.4.10 checked the KV before locking (r1 fit then) and answers OTHER.
    s = scheduler(cache_with(range(500, 540), capacity=100), sglang, max_prefill_tokens=25,
                  chunked_prefill_size=None)
    s.submit(request("r0", range(10)), 0.0)
    s.submit(request("r1", [*range(500, 540), *range(20)], out=30), 0.0)
    assert [rid for rid, _ in admitted(s)] == ["r0"]
    assert s.batch_is_full is full


@pytest.mark.parametrize("chunk, ids", [(8192, ["r0", "r1"]), (None, ["r0"])])
def test_the_input_cap_refuses_a_request_only_when_chunking_is_off(chunk, ids):
    # max_prefill_tokens 90: r0 leaves 50; r1's 50 reaches it. With chunking on 0.5.23 admits it
    # (then stops: budget_state is OTHER), without chunking it refuses it; 0.4.10 refuses both.
    s = scheduler(RadixCache(None), max_prefill_tokens=90, chunked_prefill_size=chunk)
    waiting(s, list(range(40)), list(range(100, 150)), [7, 7])
    assert [rid for rid, _ in admitted(s)] == ids
    assert not s.batch_is_full


# ------------------------------------------------------------------ chunks
@pytest.mark.parametrize("sglang, chunks", [("0.5.23", [8, 10, 2]), ("0.4.10", [7, 10, 3])])
def test_a_first_chunk_ends_on_a_page_boundary(sglang, chunks):
    # page 4, chunks of 10: 0.5.23 cuts the first at 8 (a page boundary of prefix + chunk),
    # 0.4.10 at 10 - 4 + 1 = 7; continued chunks take the whole chunk budget in both.
    s = scheduler(RadixCache(1000, page_size=4), sglang, chunked_prefill_size=10)
    s.submit(request("r", range(20)), 0.0)
    news = []
    while s.has_work:
        batch = s.next_batch()
        news += [e.new for e in batch.entries] if batch.kind == "prefill" else []
        s.complete(batch, [1000] * len(batch.entries), 0.0)
    assert news == chunks


@pytest.mark.parametrize("sglang, new", [("0.5.23", 10), ("0.4.10", 25)])
def test_a_continued_chunk_takes_at_most_the_kv_left(sglang, new):
    # PrefillBudget.available_chunk_tokens: 90 of 100 slots locked, 10 left; 0.4.10 takes the
    # whole chunk budget (30) or what is left of the request (25).
    cache = RadixCache(100)
    cache.acquire(toks(*range(90)))
    adder = PrefillAdder.for_step(cache, [], 0.7, 4096, 16384, 30, 1, ReleaseRules.of(sglang))
    cache.extend(cache.acquire(toks(*range(1000, 1090))), 90)
    assert cache.available_size == 10
    assert adder.next_chunk(25) == new


def test_a_continued_chunk_with_no_kv_left_still_takes_the_chunk_budget():
    # ... unless none is left: the request must make progress to release its KV
    cache = RadixCache(100)
    cache.extend(cache.acquire(toks(*range(100))), 100)
    adder = PrefillAdder.for_step(cache, [], 0.7, 4096, 16384, 30, 1, ReleaseRules.of("0.5.23"))
    assert adder.next_chunk(25) == 25


@pytest.mark.parametrize("sglang, third", [("0.5.23", ("prefill", ("r1",))),
                                           ("0.4.10", ("decode", ("a", "r0")))])
def test_a_step_budget_spent_by_the_continued_chunk_stops_admission_before_the_kv_check(
        sglang, third):
    # max_prefill_tokens 20, chunks of 30, "a" running (30 outputs reserved at 0.7): r0's last
    # chunk (20) spends the input budget. 0.5.23 stops there (budget_state OTHER,
    # _get_new_batch_prefill_raw), so the batch is not full and r1 (5 + 20 outputs + a page)
    # fits the next step; 0.4.10 tries r1 at once, 25 >= 98 - 30 - 0.7 * 29 - 20 - 3: the batch
    # is full and decodes until a request finishes.
    s = scheduler(RadixCache(100), sglang, max_prefill_tokens=20, chunked_prefill_size=30)
    s.submit(request("a", range(200, 202), out=30), 0.0)
    s.complete(s.next_batch(), [1000], 0.0)
    s.submit(request("r0", range(50), out=3), 0.0)
    s.submit(request("r1", range(100, 105), out=20), 0.0)
    assert drive(s)[:3] == [("prefill", ("r0",)), ("prefill", ("r0",)), third]


# ------------------------------------------------------------------ the running batch
@pytest.mark.parametrize("sglang, third", [("0.5.23", ("prefill", ("late",))),
                                           ("0.4.10", ("decode", ("long",)))])
def test_finished_requests_leave_the_running_batch_before_the_prefill_is_formed(sglang, third):
    # get_next_batch_to_run filters the running batch first: "short" finished in the first
    # decode, so its slot of max_running_requests=2 is free for "late" at once (0.4.10: after
    # the next decode step, test_scheduler_fidelity).
    out = lambda n: np.arange(1, n + 1, dtype=np.int32)  # noqa: E731
    s = scheduler(RadixCache(10_000), sglang, max_running_requests=2)
    s.submit(Request("short", toks(*range(10)), out(2)), 0.0)
    s.submit(Request("long", toks(*range(100, 110)), out(6)), 0.0)
    s.submit(Request("late", toks(*range(200, 210)), out(2)), 0.0)
    steps = drive(s)
    assert steps[:3] == [("prefill", ("short", "long")), ("decode", ("short", "long")), third]


def test_an_empty_running_batch_is_never_full():
    # _get_new_batch_prefill_raw clears batch_is_full when nothing runs
    s = scheduler(RadixCache(100))
    s.submit(request("r0", range(10)), 0.0)
    s.batch_is_full = True
    batch = s._prefill_batch(0.0)
    assert [e.req.id for e in batch.entries] == ["r0"] and not s.batch_is_full


# ------------------------------------------------------------------ eviction and retraction
@pytest.mark.parametrize("sglang, evicted", [("0.5.23", 10), ("0.4.10", 20)])
def test_an_allocation_evicts_the_shortfall(sglang, evicted):
    # 35 slots, three cached 10-token prompts, 5 free: a 12-token prefill is 7 short. 0.5.23's
    # evict_to_free_tokens evicts 7 (one whole leaf, 10); 0.4.10 asks the tree for all 12 (two).
    cache = cache_with(range(100, 110), range(200, 210), range(300, 310), capacity=35)
    s = scheduler(cache, sglang)
    req = s.submit(request("r0", range(12), out=1), 0.0)
    s.next_batch()
    assert req.evicted_tokens == evicted
    assert cache.total_size == 30 - evicted  # (r0 enters the tree when it finishes)


def retract_once(sglang: str, steps: int) -> Scheduler:
    """4 requests of 10 prompt tokens and 40 outputs in 120 slots, run to their first
    retraction (at 21 outputs each: 4 x 30 slots hold the KV, the step needs 4 more)."""
    s = scheduler(RadixCache(120), sglang, clip_max_new_tokens=1, retract_decode_steps=steps)
    for i in range(4):
        s.submit(request(f"r{i}", range(100 * i, 100 * i + 10), out=40), 0.0)
    while s.preemptions == 0:
        batch = s.next_batch()
        s.complete(batch, [int(e.req.request.output[len(e.req.output)]) for e in batch.entries],
                   0.0)
    return s


@pytest.mark.parametrize("sglang, first", [("0.5.23", (1, 3)), ("0.4.10", (2, 2))])
def test_decode_retracts_until_the_next_step_fits(sglang, first):
    # 0.5.23's retract_decode stops once the rest's next step fits (check_decode_mem): one goes
    # (30 slots free, 3 needed); 0.4.10 goes on until the rest have room for 20 tokens each
    # (60 > 30 free): two go.
    s = retract_once(sglang, 20)
    assert (s.preemptions, len(s.running)) == first


@pytest.mark.parametrize("sglang, ratio", [("0.5.23", (63 + 30) / 121), ("0.4.10", 93 / 120)])
def test_the_ratio_after_a_retraction_divides_by_the_output_budget_plus_one(sglang, ratio):
    # estimate_new_token_ratio_after_retract: the 3 left have 21 outputs each and 10 steps'
    # headroom, over their 3 x 40 outputs (0.5.23: + 1)
    assert retract_once(sglang, 10).new_token_ratio == pytest.approx(ratio, abs=1e-12)


# ------------------------------------------------------------------ overlap
def test_under_overlap_a_request_whose_last_token_is_in_flight_is_not_decoded_again():
    # event_loop_overlap's enable_skip_finishing_decode (_reqs_finishing_inflight): a's second
    # and last token is in flight when the third step forms, so no decode step forms; its
    # results are applied and it finishes (0.4.10 decodes it once more: test_scheduler_fidelity)
    cache = RadixCache(10_000)
    s = scheduler(cache, overlap=True)
    a = s.submit(request("a", range(50), out=2), 0.0)
    s.complete(s.next_batch(0.0), [1000], 1.0)
    b2 = s.next_batch(1.0)
    assert b2.kind == "decode" and a.output == [1000]
    s.complete(b2, [1001], 2.0)
    assert s.next_batch(2.0) is None
    assert a.finished and s.take_finished() == [a] and a.output == [1000, 1001]
    assert not s.has_work and cache.protected_size == 0


@pytest.mark.parametrize("sglang, preemptions", [("0.5.23", 0), ("0.4.10", 1)])
def test_under_overlap_a_step_short_of_kv_waits_for_finishing_results_instead_of_retracting(
        sglang, preemptions):
    # b..e decode (reservations at ratio 0); a is admitted with exactly 3 slots to spare
    # (extend + 1 output + a page < available) and its one token is in flight when the next
    # step forms. 0.5.23 leaves a out; b..e need 4 > 3: no step forms until a's results are
    # applied (it finishes, its prompt becomes evictable), then b..e decode. 0.4.10 needs 5 and
    # retracts a (no outputs yet: it goes first).
    cache = RadixCache(150)
    s = scheduler(cache, sglang, overlap=True, init_new_token_ratio=0.0,
                  min_new_token_ratio_factor=0.0)
    for i in range(4):
        s.submit(request("bcde"[i], range(100 * i, 100 * i + 5), out=30), 0.0)
    for step in range(3):
        batch = s.next_batch(float(step))
        s.complete(batch, [int(e.req.request.output[len(e.req.output)]) for e in batch.entries],
                   float(step + 1))
    a = s.submit(request("a", range(1000, 1000 + cache.available_size - 3), out=1), 3.0)
    batch = s.next_batch(3.0)
    assert [e.req.id for e in batch.entries] == ["a"] and cache.available_size == 3
    s.complete(batch, [1000], 4.0)
    batch = s.next_batch(4.0)
    assert s.preemptions == preemptions
    if sglang == "0.5.23":
        assert a.finished and s.take_finished() == [a]
        assert [e.req.id for e in batch.entries] == ["b", "c", "d", "e"]
