"""``scheduler=vllm``: vLLM V1's scheduler over the block cache (docs/design.md §4), as exact step
sequences on hand-made cases. Each step is listed as ``(request, context, new)`` per entry, in
the order the scheduler put them. (Against vLLM's own code: experiments/validation/vllm/scheduler.py.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from testbed.config.assembly import assemble, compose_config
from testbed.cache.block_hash import BlockHashCache
from testbed.errors import BadInput, WorkloadRefused
from testbed.execute import execute
from testbed.scheduler.vllm import VllmScheduler
from testbed.scheduler.vllm_config import VllmSchedulerConfig
from testbed.sim.executor import predetermined_tokens
from testbed.workloads.request import TOKEN_DTYPE, Request
from testbed.workloads.traces import save_tokens
from tests.conftest import toks


def request(rid: str, prompt, out: int = 2, arrival_s: float = 0.0) -> Request:
    return Request(rid, np.asarray(prompt, TOKEN_DTYPE),
                   np.arange(900, 900 + out, dtype=TOKEN_DTYPE), arrival_s=arrival_s)


def scheduler(blocks: int | None = None, block_size: int = 4, **settings) -> VllmScheduler:
    cache = BlockHashCache(None if blocks is None else blocks * block_size, block_size)
    return VllmScheduler(cache, VllmSchedulerConfig(**settings), check_invariants=True)


def step(s: VllmScheduler) -> list[tuple[str, int, int]] | None:
    """Form one step, run it with the workload's tokens; its entries."""
    batch = s.next_batch(0.0)
    if batch is None:
        return None
    s.complete(batch, predetermined_tokens(batch), 0.0)
    return [(e.req.id, e.context, e.new) for e in batch.entries]


def run(s: VllmScheduler, *reqs: Request) -> list[list[tuple[str, int, int]]]:
    for r in reqs:
        s.submit(r, 0.0)
    steps = []
    while s.has_work:
        steps.append(step(s))
    s.check_drained()
    return steps


def test_the_token_budget_splits_a_long_prompt_into_chunks():
    steps = run(scheduler(max_num_batched_tokens=8, max_num_seqs=4),
                request("a", range(1, 21), out=2))
    assert steps == [[("a", 0, 8)], [("a", 8, 8)], [("a", 16, 4)], [("a", 20, 1)]]


def test_a_step_mixes_decodes_and_prefill_chunks_under_one_budget():
    s = scheduler(max_num_batched_tokens=6, max_num_seqs=4)
    s.submit(request("a", [1, 2], out=4), 0.0)
    s.submit(request("b", [3, 4], out=4), 0.0)
    first = s.next_batch(0.0)
    assert first.kind == "prefill"
    s.complete(first, predetermined_tokens(first), 0.0)
    s.submit(request("c", range(10, 20), out=1), 0.0)
    # running requests first, each one decode token; the waiting one gets what is left
    assert [step(s) for _ in range(3)] == [
        [("a", 2, 1), ("b", 2, 1), ("c", 0, 4)],
        [("a", 3, 1), ("b", 3, 1), ("c", 4, 4)],
        [("a", 4, 1), ("b", 4, 1), ("c", 8, 2)]]
    batch = s.next_batch(0.0)
    assert batch is None and not s.has_work  # every request is done


def test_a_step_of_decodes_only_is_a_decode_batch_and_a_mixed_one_a_prefill_batch():
    s = scheduler(max_num_batched_tokens=64)
    s.submit(request("a", [1, 2, 3], out=3), 0.0)
    kinds = []
    for n in range(3):
        if n == 1:
            s.submit(request("b", [4, 5], out=1), 0.0)
        batch = s.next_batch(0.0)
        kinds.append(batch.kind)
        s.complete(batch, predetermined_tokens(batch), 0.0)
    assert kinds == ["prefill", "prefill", "decode"]


def test_running_requests_are_scheduled_before_waiting_ones():
    s = scheduler(max_num_batched_tokens=4, max_num_seqs=4)
    s.submit(request("a", [1, 2, 3, 4, 5, 6], out=2), 0.0)
    assert step(s) == [("a", 0, 4)]
    s.submit(request("b", [7, 8, 9], out=1), 0.0)  # waits behind a's last chunk
    assert step(s) == [("a", 4, 2), ("b", 0, 2)]
    assert step(s) == [("a", 6, 1), ("b", 2, 1)]


def test_max_num_seqs_caps_the_requests_running_at_once():
    steps = run(scheduler(max_num_batched_tokens=64, max_num_seqs=2),
                request("a", [1, 2, 3, 4]), request("b", [5, 6, 7, 8]), request("c", [9, 10]))
    assert steps == [[("a", 0, 4), ("b", 0, 4)], [("a", 4, 1), ("b", 4, 1)],
                     [("c", 0, 2)], [("c", 2, 1)]]


def test_when_blocks_run_out_the_last_running_request_is_preempted_and_its_blocks_freed():
    s = scheduler(blocks=3, block_size=4, max_num_batched_tokens=64)
    a, b = s.submit(request("a", [1, 2, 3, 4], out=5), 0.0), \
        s.submit(request("b", [5, 6, 7, 8], out=3), 0.0)
    assert step(s) == [("a", 0, 4), ("b", 0, 4)]
    assert s.cache.free_blocks == 1
    # a's decode takes the last free block; b's finds none: b, the last running, is preempted,
    # its block freed (hashed: it stays cached) and it waits at the front of the queue
    assert step(s) == [("a", 4, 1)]
    assert (b.preemptions, b.lease, b.computed, s.preemptions) == (1, None, 0, 1)
    assert s.waiting[0] is b and s.cache.free_blocks == 1 and s.cache.evictable_size == 4
    # b's fill (prompt + its output) needs 2 blocks beyond its hit, counting the hit block that
    # sits in the free queue: not before a finishes
    assert [step(s) for _ in range(3)] == [[("a", 5, 1)], [("a", 6, 1)], [("a", 7, 1)]]
    assert a.finished
    # readmitted, b hits its own old block and recomputes only its fill's last token
    assert step(s) == [("b", 4, 1)]
    assert b.cached_tokens == 0  # its hit at first admission
    assert run(s) == [[("b", 5, 1)]]


def test_a_full_block_becomes_a_hit_while_the_request_that_filled_it_still_runs():
    s = scheduler(max_num_batched_tokens=64)
    prompt = list(range(1, 10))
    a = s.submit(request("a", prompt, out=6), 0.0)
    same_step = s.submit(request("a2", prompt, out=1), 0.0)
    assert step(s) == [("a", 0, 9), ("a2", 8, 1)]  # a's blocks were hashed when scheduled
    later = s.submit(request("b", prompt[:8] + [50, 51], out=1), 0.0)
    assert step(s) == [("a", 9, 1), ("b", 8, 2)]
    assert not a.finished and (same_step.cached_tokens, later.cached_tokens) == (8, 8)


def test_a_block_of_decoded_tokens_is_hashed_in_the_step_that_fills_it():
    s = scheduler(max_num_batched_tokens=64)
    s.submit(request("a", [1, 2, 3], out=4), 0.0)
    step(s)  # tokens 0-2
    assert s.cache.total_size == 0
    step(s)  # feeds output 0 at position 3: the first block is full
    assert s.cache.total_size == 4


def test_the_last_prompt_token_is_computed_even_when_the_whole_prompt_is_cached():
    s = scheduler(max_num_batched_tokens=64)
    prompt = list(range(1, 9))  # two whole blocks
    run(s, request("a", prompt, out=1))
    b = s.submit(request("b", prompt, out=1), 0.0)
    assert step(s) == [("b", 4, 4)]  # the hit stops before the block holding the last token
    assert b.cached_tokens == 4
    c = s.submit(request("c", prompt + [9], out=1), 0.0)
    assert step(s) == [("c", 8, 1)] and c.cached_tokens == 8


def test_without_chunked_prefill_a_prompt_beyond_the_budget_waits_for_the_next_step():
    s = scheduler(max_num_batched_tokens=8, max_num_seqs=2, enable_chunked_prefill=False)
    assert run(s, request("a", range(1, 6)), request("b", range(10, 15))) == [
        [("a", 0, 5)], [("a", 5, 1), ("b", 0, 5)], [("b", 5, 1)]]
    with pytest.raises(WorkloadRefused, match="max_num_batched_tokens=8"):
        s.submit(request("c", range(1, 10)), 0.0)


def test_long_prefill_token_threshold_caps_each_request_only_while_others_run_or_wait():
    steps = run(scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=3),
                request("a", range(1, 8), out=1), request("b", [20, 21], out=1))
    assert steps == [[("a", 0, 3), ("b", 0, 2)], [("a", 3, 4)]]  # then a is alone


def test_a_request_that_could_never_fit_the_pool_is_aborted_at_submission():
    s = scheduler(blocks=2, block_size=4)
    r = s.submit(request("a", range(1, 9), out=2), 0.0)  # 9 tokens of KV: 3 blocks
    assert r.aborted and not s.has_work


def test_an_aborted_request_frees_its_blocks_and_its_hashed_ones_stay_cached():
    s = scheduler(blocks=8, block_size=4, max_num_batched_tokens=6)
    a = s.submit(request("a", range(1, 10), out=5), 0.0)
    b = s.submit(request("b", range(20, 25), out=2), 0.0)
    assert step(s) == [("a", 0, 6)]
    assert s.abort(a, 1.0) and a.aborted and a.finish_s == 1.0
    assert s.cache.protected_size == 0 and s.cache.evictable_size == 4  # its one full block
    assert s.abort(b, 1.0) and not s.has_work  # a waiting one just leaves the queue
    assert not s.abort(b, 2.0)
    s.check_drained()
    assert s.cache.free_blocks == 8
    c = s.submit(request("c", range(1, 10), out=1), 2.0)
    assert step(s) == [("c", 4, 5)] and c.cached_tokens == 4


def test_per_request_stops_end_a_generated_request_once_min_tokens_came():
    """A generated call stops on its own stop tokens (EOS too unless ``ignore_eos``), but not
    before ``min_tokens`` of output (the same rule as SGLang's scheduler)."""
    cache = BlockHashCache(None, 4)
    s = VllmScheduler(cache, VllmSchedulerConfig(), eos_token_ids=[7], check_invariants=True)
    calls = [Request("eos", np.asarray([1, 2], TOKEN_DTYPE), np.zeros(0, TOKEN_DTYPE),
                     max_new_tokens=5),
             Request("late", np.asarray([1, 3], TOKEN_DTYPE), np.zeros(0, TOKEN_DTYPE),
                     max_new_tokens=5, min_tokens=2),
             Request("own", np.asarray([1, 4], TOKEN_DTYPE), np.zeros(0, TOKEN_DTYPE),
                     max_new_tokens=5, ignore_eos=True, stop_token_ids=(9,))]
    reqs = [s.submit(c, 0.0) for c in calls]
    script = [7, 5, 7, 9, 5]
    while s.has_work:
        batch = s.next_batch(0.0)
        s.complete(batch, [script[len(e.req.output)] for e in batch.entries], 0.0)
    assert [r.output for r in reqs] == [[7], [7, 5, 7], [7, 5, 7, 9]]


def test_the_online_engine_serves_with_vllms_scheduler(tmp_path):
    """``python -m testbed.serve`` builds the scheduler the config asks for: vLLM's here, over
    the block cache, on the tiny model; a request generates its tokens."""
    from testbed.api.online import generating_request
    from testbed.api.server import build_engine
    from testbed.api.settings import assemble_serve

    run, settings = assemble_serve(compose_config(
        ["model=tiny", "device=cpu", "cache=block_hash", "cache.capacity_tokens=512",
         "scheduler=vllm"], name="serve"))
    engine, _ = build_engine(run, settings)
    assert type(engine.scheduler).__name__ == "VllmScheduler"
    req = engine.scheduler.submit(generating_request("x", np.arange(1, 20, dtype=TOKEN_DTYPE), 3,
                                                     ignore_eos=True), 0.0)
    while engine.scheduler.has_work:
        assert engine._step()
    assert len(req.output) == 3 and req.finished


def test_scheduler_vllm_needs_the_block_cache_and_its_own_keys(compose):
    with pytest.raises(BadInput, match=r"^scheduler=vllm needs cache=block_hash .*got cache=radix$"):
        assemble(compose("scheduler=vllm", "cache=radix"))
    with pytest.raises(BadInput, match="scheduler.overlap is not a setting of scheduler=vllm"):
        assemble(compose("scheduler=vllm", "cache=block_hash", "+scheduler.overlap=true"))
    with pytest.raises(BadInput, match="max_num_batched_tokens must be >= scheduler.max_num_seqs"):
        assemble(compose("scheduler=vllm", "cache=block_hash", "scheduler.max_num_seqs=4096"))
    with pytest.raises(BadInput, match="^scheduler.max_num_seqs must be set for scheduler=vllm"):
        assemble(compose("scheduler=vllm", "cache=block_hash", "scheduler.max_num_seqs=null"))
    with pytest.raises(BadInput, match="^scheduler.enable_chunked_prefill must be true or false"):
        assemble(compose("scheduler=vllm", "cache=block_hash",
                         "scheduler.enable_chunked_prefill=2"))


def test_a_sim_run_end_to_end_has_vllms_exact_hits(tmp_path):
    """Four requests at once share a 40-token prefix (two 16-token blocks); the first hashes
    them when scheduled, so the other three hit 32 tokens each in the same step. A fifth, later,
    repeats the first prompt: its hit stops before the block of its last token (48 of 50)."""
    rng = np.random.default_rng(1)
    shared = rng.integers(1, 500, 40).tolist()
    reqs = [request(f"r{i}", shared + rng.integers(1, 500, 10).tolist(), out=3)
            for i in range(4)]
    reqs.append(request("again", reqs[0].prompt.tolist(), out=3, arrival_s=100.0))
    save_tokens(reqs, tmp_path / "trace.jsonl")
    cfg = compose_config(["progress=false", "backend=sim", "scheduler=vllm", "cache=block_hash",
                          "workload=trace", f"workload.path={tmp_path / 'trace.jsonl'}"])
    summary = execute(cfg, tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert [r["cached_tokens"] for r in lines] == [0, 32, 32, 32, 48]
    assert summary["cached_tokens"] == 144 and summary["scheduler"] == "vllm"
    steps = [json.loads(x) for x in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert steps[0]["admitted"] == 4 and steps[0]["new_tokens"] == 50 + 3 * 18


def test_the_engine_runs_mixed_steps_and_generates_what_it_generates_under_sglangs_scheduler(
        tmp_path):
    """A small chat on the tiny random model, generating (greedy): with a 64-token budget
    vLLM's steps mix prefill chunks with decodes; every request's tokens equal those of the same
    run under SGLang's scheduler (fcfs), which never mixes them."""
    base = ["progress=false", "backend=engine", "model=tiny", "device=cpu", "cache=block_hash",
            "cache.capacity_tokens=4096", "workload=chat", "workload.num_sessions=3",
            "workload.turns=2", "forced=false", "save_token_ids=true"]
    outputs = {}
    for name, extra in (("vllm", ["scheduler=vllm", "scheduler.max_num_batched_tokens=64",
                                  "scheduler.max_num_seqs=8"]), ("fcfs", ["scheduler=fcfs"])):
        execute(compose_config(base + extra), tmp_path / name)
        lines = (tmp_path / name / "requests.jsonl").read_text().splitlines()
        outputs[name] = {r["id"]: r["output_ids"] for r in map(json.loads, lines)}
    steps = [json.loads(x) for x in (tmp_path / "vllm" / "steps.jsonl").read_text().splitlines()]
    assert any(s["kind"] == "prefill" and 0 < s["admitted"] < s["batch_size"] for s in steps)
    assert outputs["vllm"] == outputs["fcfs"] and all(outputs["vllm"].values())


# ------------------------------------------------------------------ speculative decoding
def spec_scheduler(drafts: dict[int, list[int]], blocks: int = 4, k: int = 3) -> VllmScheduler:
    """A ``scheduler=vllm`` with drafts: ``drafts[n]`` is what a request drafts after its n-th
    output token (none where absent)."""
    from testbed.scheduler.speculative import SpeculativeConfig
    cache = BlockHashCache(blocks * 4, 4)
    s = VllmScheduler(cache, VllmSchedulerConfig(), check_invariants=True,
                      speculative=SpeculativeConfig(method="ngram", num_tokens=k))
    s.spec.drafts = lambda reqs: [(np.asarray(drafts.get(len(r.output), []), TOKEN_DTYPE), None)
                                  for r in reqs]
    return s


def test_drafts_take_blocks_but_only_blocks_full_of_verified_tokens_get_a_hash():
    # prompt 1..5, output 6..13; B = 4. After output 6 it drafts 7, 8, 0 (accepts 2); after
    # output 9 it drafts 10, 11, 12 (accepts all, and finishes with the bonus 13)
    s = spec_scheduler({1: [7, 8, 0], 4: [10, 11, 12]})
    cache = s.cache
    s.submit(Request("r", toks(1, 2, 3, 4, 5), toks(*range(6, 14))), 0.0)
    drafts, hashed, free = [], [], []
    while s.has_work:
        batch = s.next_batch(0.0)
        drafts.append([(e.req.id, e.context, e.new, None if e.draft is None else e.draft.tolist())
                       for e in batch.entries])
        s.complete(batch, predetermined_tokens(batch), 0.0)
        hashed.append(np.flatnonzero(cache._keyed[: cache.num_blocks]).tolist())
        free.append(cache.free_blocks)
    assert drafts == [[("r", 0, 5, None)], [("r", 5, 4, [7, 8, 0])], [("r", 8, 4, [10, 11, 12])]]
    # step 1: block 1 (5, 6, 7, 8) fills with verified tokens only when its results apply; it is
    # hashed at the next allocate_slots (step 2). Step 2's accepted drafts fill block 2
    # (9, 10, 11, 12), but the request finishes: vLLM's _free_request hashes nothing
    assert hashed == [[0], [0], [0, 1]]
    # the rejected draft's block stays the request's (3 blocks held after step 1), all come back
    # at the finish: the unhashed block 2 to the head, the hashed ones to the tail, last first
    assert free == [2, 1, 4]
    assert cache._free.blocks() == [2, 3, 1, 0]
    s.check_drained()


def test_a_budget_that_cuts_a_requests_tokens_cuts_its_drafts_first():
    from testbed.scheduler.speculative import SpeculativeConfig
    cache = BlockHashCache(64, 4)
    s = VllmScheduler(cache, VllmSchedulerConfig(max_num_batched_tokens=3),
                      check_invariants=True, speculative=SpeculativeConfig(method="ngram"))
    s.spec.drafts = lambda reqs: [(np.asarray([7, 8, 9, 10], TOKEN_DTYPE), None) for _ in reqs]
    s.submit(Request("r", toks(1, 2), toks(6, 7, 8, 9, 10, 11)), 0.0)
    s.complete(s.next_batch(0.0), [6], 0.0)
    (entry,) = s.next_batch(0.0).entries
    assert (entry.context, entry.new, entry.draft.tolist()) == (2, 3, [7, 8])
