"""The engine under SGLang's overlap loop (``scheduler.overlap=true``) generates exactly the
tokens it generates without it, and hits the same prefixes, on programs with prefill-only fork
calls, with chunked prefill and a pool tight enough to evict and retract, and through the
server's loop with a client's abort. Overlap only moves when a step's results are applied (the
next step is launched first, its decode inputs read on the device); if it changed a token, a
request or the KV of one, the scheduler's bookkeeping would be wrong. And the loop never reads
anything back from the device before it has launched the next step (a recording spy on the
engine's reads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from testbed.config.assembly import compose_config
from testbed.execute import execute
from tests.test_engine_hot_path import sync_spy  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# on a GPU machine (gpu_validate.sh) the loop's tests run there too: CUDA events, the pinned
# readback, two staging buffers, the token table on the device
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]

# The command that crashed in EngineRunner.prepare (a decode step fed a fork no token), and a
# paged tree whose forks left the loop waiting forever with admissible requests queued.
SELF_CONSISTENCY = ["workload=self_consistency", "workload.num_questions=3",
                    "workload.num_samples=3", "workload.prefix_len=16", "workload.question_len=16",
                    "workload.output_len=12", "seed=36", "cache=radix",
                    "cache.capacity_tokens=255", "scheduler=lpm", "arrival.max_in_flight=3"]
TREE_PAGED = ["workload=tree_of_thought", "workload.num_problems=2", "workload.depth=3",
              "workload.instruction_len=16", "workload.problem_len=16",
              "workload.step_prompt_len=8", "workload.thought_len=24", "seed=90", "cache=radix",
              "cache.page_size=4", "cache.capacity_tokens=239", "scheduler=dfs_weight",
              "arrival.max_in_flight=5"]


# chunks of 32 (prompts of 56+), a pool of 290: evicted and retracted while generating, with
# the same admissions either way
TREE_CHUNKED = ["workload=tree_of_thought", "workload.num_problems=2", "workload.depth=3",
                "workload.instruction_len=16", "workload.problem_len=40",
                "workload.step_prompt_len=8", "workload.thought_len=24", "cache=radix",
                "scheduler=lpm", "scheduler.chunked_prefill_size=32",
                "scheduler.clip_max_new_tokens=4", "cache.capacity_tokens=290",
                "workload.vocab_size=256", "forced=false"]


def tokens(tmp_path: Path, name: str, overrides: list[str]) -> tuple[dict, dict]:
    """The run's summary and each request's (prompt ids, output ids, aborted, cached tokens)."""
    cfg = compose_config(["progress=false", "hardware=cpu", "backend=engine", "model=tiny",
                          "device=cpu", "save_token_ids=true", *overrides])
    out = tmp_path / name
    summary = execute(cfg, out)
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return summary, {r["id"]: (r["prompt_ids"], r["output_ids"], r["aborted"], r["cached_tokens"])
                     for r in records}


@pytest.mark.parametrize("overrides", [
    SELF_CONSISTENCY,  # as the failing command ran it: forced (replayed) outputs
    [*SELF_CONSISTENCY, "forced=false"],  # the model's own greedy tokens
    [*TREE_PAGED, "forced=false"],
    TREE_CHUNKED,
    *([[*TREE_CHUNKED, "device=cuda"]] if "cuda" in DEVICES else []),
], ids=["self_consistency", "self_consistency_generated", "tree_of_thought_paged",
        "tree_of_thought_chunked_retracted", *(["cuda"] if "cuda" in DEVICES else [])])
def test_overlap_generates_the_same_tokens_and_hits_as_the_plain_loop(tmp_path, overrides):
    plain_summary, plain = tokens(tmp_path, "plain", [*overrides, "scheduler.overlap=false"])
    overlap_summary, overlap = tokens(tmp_path, "overlap", [*overrides, "scheduler.overlap=true"])
    assert overlap == plain  # token ids and cached tokens, request by request
    assert not any(aborted for _, _, aborted, _ in plain.values())
    assert all(out for rid, (_, out, _, _) in plain.items() if not rid.endswith("fork"))
    assert overlap_summary["aborted_requests"] == plain_summary["aborted_requests"] == 0
    if overrides is TREE_CHUNKED:
        for summary in (plain_summary, overlap_summary):
            assert summary["preemptions"] > 0 and summary["evicted_tokens"] > 0
        assert max(len(prompt) for prompt, *_ in plain.values()) > 32  # chunked


def test_in_a_tighter_pool_overlap_moves_only_hits_as_its_later_insert_does(tmp_path):
    """At 210 slots the retractions and evictions fall differently with and without overlap
    (a prefill's prompt enters the tree one step later under overlap, as in SGLang): some
    forks hit less or more, but every request generates the same tokens."""
    tight = [*TREE_CHUNKED[:-3], "cache.capacity_tokens=210", *TREE_CHUNKED[-2:]]
    _, plain = tokens(tmp_path, "plain", [*tight, "scheduler.overlap=false"])
    _, overlap = tokens(tmp_path, "overlap", [*tight, "scheduler.overlap=true"])
    assert {k: v[:3] for k, v in overlap.items()} == {k: v[:3] for k, v in plain.items()}
    assert any(overlap[k][3] != plain[k][3] for k in plain)


# ---------------------------------------------------------------------------- the server's loop
@pytest.fixture(scope="module", params=DEVICES)
def tiny(request):
    from testbed.engine.loader import build_model, tiny_config
    return build_model(tiny_config(), seed=0, device=request.param)


def engine(tiny, capacity: int = 90):
    from testbed.engine.executor import EngineExecutor
    from testbed.engine.runner import ModelRunner
    return EngineExecutor(ModelRunner(tiny, capacity), forced=False)


@pytest.mark.parametrize("turn", [6, 20])
def test_through_the_servers_loop_an_abort_drops_only_the_token_in_flight(tiny, turn):
    """Six generating requests through `OnlineEngine`'s turns (a pool that evicts and
    retracts, chunks of 16); r2 aborted at a turn's boundary. The others stream the same tokens
    with and without overlap; r2's stream under overlap is the plain one less the token still in
    flight (SGLang drops it), and both leave nothing locked."""
    from tests.test_step_cycle import generating, online_run

    streams = {}
    for overlap in (False, True):
        updates = online_run(engine(tiny), overlap, generating(), abort=("r2", turn))
        streams[overlap] = {rid: [t for u in ups for t in u.tokens] for rid, ups in updates.items()}
        assert [u.finish_reason for u in updates["r2"]][-1:] != ["length"]
        assert all(ups[-1].finish_reason == "length" for rid, ups in updates.items()
                   if rid != "r2")
    plain, over = streams[False], streams[True]
    assert {k: v for k, v in over.items() if k != "r2"} == \
        {k: v for k, v in plain.items() if k != "r2"}
    assert all(len(v) == 25 for k, v in plain.items() if k != "r2")
    assert over["r2"] == plain["r2"][:len(over["r2"])] and len(over["r2"]) == len(plain["r2"]) - 1


# ---------------------------------------------------------------------------- nothing read early
def test_the_engine_loop_reads_nothing_back_before_launching_the_next_step(tiny, sync_spy,
                                                                             monkeypatch):
    """The real engine on the CPU under overlap (the same path a GPU runs, synchronously), with
    a spy on every tensor read to the host from the project's code, armed through the whole
    serving loop: outside a step's ``result()`` (scheduling, launching, applying) it sees
    nothing; and each step's ``result()`` comes after the next step's launch."""
    from testbed.cache import RadixCache
    from testbed.engine.launched import LaunchedStep
    from testbed.serving.serve import serve
    from tests.test_step_cycle import TIGHT, check_order, crowd

    executor = engine(tiny)
    log = []
    launch, result = executor.launch, LaunchedStep.result

    def recorded_launch(batch):
        handle = launch(batch)
        handle.k = sum(1 for op, _ in log if op == "launch")
        log.append(("launch", handle.k))
        return handle

    inside = []  # the reads a step's result() makes: where tokens reach the host

    def recorded_result(self):
        log.append(("read", self.k))
        before = len(sync_spy.calls)
        try:
            return result(self)
        finally:
            inside.extend(sync_spy.calls[before:])
            del sync_spy.calls[before:]

    monkeypatch.setattr(executor, "launch", recorded_launch)
    monkeypatch.setattr(LaunchedStep, "result", recorded_result)
    sync_spy.armed = True
    try:
        scheduler, run = serve(crowd(), RadixCache(90), TIGHT | {"overlap": True}, executor,
                               generate=True, check_invariants=True)
    finally:
        sync_spy.armed = False
    assert sync_spy.calls == [] and inside  # (the spy sees the reads result() makes)
    assert scheduler.preemptions > 0 and all(len(r.output) == 25 for r in run.reqs)
    check_order(log, overlap=True)
