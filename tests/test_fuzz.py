"""The config fuzzer (`python -m testbed.fuzz`): a slice of the config space runs clean, its checks
catch what they claim to, and the configs it once failed on stay fixed."""

from __future__ import annotations

import json

import numpy as np
import pytest
from testbed.fuzz.bad_traces import KINDS, bad_trace_path, malformed_kind, spoil
from testbed.fuzz.checks import check_run
from testbed.fuzz.cli import main, run_one
from testbed.fuzz.space import write_token_trace


def test_a_slice_of_200_random_configs_runs_without_internal_errors_leaks_or_inconsistencies(
        capsys):
    assert main(["--runs", "200", "--seed", "0", "--repeat", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "200 configs in" in out and " 0 failed" in out


# Configs the fuzzer failed on, each fixed at its cause (the test named in the comment fails on
# the code before the fix; these run the whole config through the run and its checks).
FOUND = {
    # GDSF's queued value keeps the clock of its time (tests/test_eviction.py)
    "gdsf_clock": "backend=sim seed=35 eviction=gdsf workload=shared_prefix "
                  "workload.num_groups=2 workload.prompts_per_group=5 "
                  "workload.system_prompt_len=14 workload.question_len=11 workload.output_len=6 "
                  "workload.vocab_size=50 cache=radix cache.page_size=4 scheduler=random "
                  "scheduler.overlap=true model=tiny hardware=cpu replicas=4 router=oracle "
                  "arrival.kind=poisson arrival.rate=50.0 arrival.max_in_flight=3 "
                  "cache.capacity_tokens=93",
    # the oracle's queued next use, passed by 'now' in the simulator
    "oracle_now": "backend=sim seed=498 eviction=oracle workload=random_tree "
                  "workload.num_requests=12 workload.root_prob=0.2 workload.max_burst=4 "
                  "workload.root_len=16 workload.segment_len=3 workload.output_len=3 "
                  "workload.vocab_size=2 cache=radix cache.page_size=1 scheduler=dfs_weight "
                  "scheduler.overlap=true scheduler.max_prefill_tokens=16 model=tiny "
                  "hardware=h100 arrival.kind=auto cache.capacity_tokens=47",
    # overlap needs the last token's slot (tests/test_scheduler.py)
    "overlap_last_slot": "backend=sim seed=158 eviction=fifo workload=paraphrase "
                         "workload.num_originals=3 workload.paraphrases=1 workload.prompt_len=22 "
                         "workload.edits=4 workload.edit_kind=delete workload.edit_at=0.5 "
                         "workload.system_prompt_len=8 workload.output_len=3 "
                         "workload.vocab_size=50 cache=radix cache.page_size=4 scheduler=fcfs "
                         "scheduler.overlap=true scheduler.retract_order=longest_prompt "
                         "model=llama3_8b hardware=a10g arrival.kind=poisson arrival.rate=50.0 "
                         "arrival.max_in_flight=4 cache.capacity_tokens=34",
    # nothing runs and the full flag was cleared after a load-back: prefill is tried at once
    "full_flag_after_load": "backend=sim seed=732 eviction=lfu workload=multimodal "
                            "workload.num_requests=8 workload.num_images=2 "
                            "workload.images_per_request=2 workload.image_len=11 "
                            "workload.system_prompt_len=2 workload.question_len=1 "
                            "workload.output_len=4 workload.vocab_size=256 cache=radix "
                            "cache.page_size=4 cache.host_tokens=512 cache.disk_tokens=256 "
                            "cache.write_policy=write_back cache.load_back=cost scheduler=lof "
                            "model=llama3_8b hardware=a10g cache.capacity_tokens=29",
    # blend donors whose locks leave no room: the admission reuses nothing instead of stalling
    "blend_donors_no_room": "backend=sim seed=292 eviction=slru workload=random_tree "
                            "workload.num_requests=22 workload.root_prob=0.2 "
                            "workload.max_burst=4 workload.root_len=5 workload.segment_len=7 "
                            "workload.output_len=0 workload.vocab_size=2 cache=radix "
                            "cache.split_recency=keep cache.reuse=blend cache.recompute_ratio=1.0 "
                            "cache.chunk_boundaries=4 scheduler=lpm "
                            "scheduler.max_running_requests=1 model=tiny hardware=h100 "
                            "arrival.kind=poisson arrival.rate=1000.0 arrival.max_in_flight=1 "
                            "cache.capacity_tokens=35",
    # in-batch hold at a deprioritize threshold of 0 held every request (tests/test_scheduler.py)
    "hold_threshold_0": "backend=sim workload=few_shot workload.num_tasks=1 "
                        "workload.questions_per_task=2 workload.num_shots=1 "
                        "workload.example_len=7 workload.question_len=4 "
                        "scheduler.in_batch_deprioritize_threshold=0 scheduler.in_batch_hold=true "
                        "cache.capacity_tokens=17",
    # under overlap a prefill's blend donors stay locked until its results are applied; the
    # next decode step, formed before, could not make room and stopped the run: it waits a step
    "blend_donors_locked_at_first_decode": "backend=sim workload=random_tree "
                                           "workload.num_requests=8 workload.root_len=12 "
                                           "workload.segment_len=4 workload.output_len=3 "
                                           "workload.vocab_size=5 seed=5 cache.reuse=blend "
                                           "cache.chunk_boundaries=4 scheduler.overlap=true "
                                           "cache.capacity_tokens=26",
    # router=kv_events at pages of 16: a removed leaf took the tokens its first-page sibling
    # shares out of the index, whose removal then found nothing (seed 6006 #7712)
    "kv_events_pages_of_16": "backend=sim seed=480 eviction=mru workload=random_tree "
                             "workload.num_requests=27 workload.root_prob=0.0 workload.max_burst=4 "
                             "workload.root_len=5 workload.segment_len=6 workload.output_len=4 "
                             "workload.vocab_size=2 cache=radix cache.page_size=16 "
                             "scheduler=random model=tiny hardware=a100 replicas=4 "
                             "router=kv_events arrival.kind=poisson arrival.rate=1000.0 "
                             "cache.capacity_tokens=90",
    # the one running request kept by retraction could not decode: a host load-back in flight
    # held the KV it needed (seed 7007 #1379); it now decodes once the copy is done
    "loadback_holds_the_kept_requests_kv": "backend=sim seed=502 workload=shared_prefix "
                                           "workload.num_groups=2 workload.prompts_per_group=4 "
                                           "workload.system_prompt_len=7 workload.question_len=7 "
                                           "workload.output_len=3 workload.vocab_size=2 "
                                           "cache=radix cache.host_tokens=512 scheduler=lof "
                                           "arrival.kind=offline arrival.max_in_flight=4 "
                                           "cache.capacity_tokens=19",
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_configs_the_fuzzer_once_failed_on_now_pass_its_checks(name, tmp_path):
    outcome = run_one(FOUND[name].split(), None, tmp_path, repeat=True)
    assert outcome.status == "ok", outcome.problems


# Configs the widened fuzzer (issue 58) found crashing or refused only once the workload was
# generated, now refused in one line before it is (their refusal's start)
REFUSED = {
    # an engine pool of no slots was refused only when the engine's KV buffers were made
    "engine_capacity_0": ("backend=engine model=tiny workload=few_shot workload.num_tasks=1 "
                          "cache=none cache.capacity_tokens=0",
                          "cache.capacity_tokens=0 leaves the engine no KV slot"),
    # the draft model's layers were checked when the engine was built
    "draft_layers": ("backend=engine model=tiny device=cpu workload=few_shot workload.num_tasks=1 "
                     "workload.questions_per_task=2 speculative.method=draft "
                     "speculative.draft_layers=8 scheduler.overlap=false",
                     "speculative.draft_layers must be in 1..1 (the model has 2 layers); got 8"),
    # Triton's kernels on a CPU without its interpreter stopped the first step
    "triton_on_cpu": ("backend=engine model=tiny engine.device=cpu engine.attention=cascade_triton "
                      "workload=few_shot workload.num_tasks=1",
                      "engine.attention=cascade_triton runs Triton kernels, which need a CUDA "
                      "device, not cpu"),
    # a cache class without capacity_tokens ran unlimited: slot 91 of an engine pool of 33
    "cache_without_capacity": ("backend=engine model=tiny workload=self_consistency "
                               "workload.num_questions=2 workload.num_samples=3 "
                               "workload.prefix_len=12 workload.question_len=15 "
                               "workload.output_len=5 cache=custom "
                               "cache.target=testbed.cache.BlockHashCache "
                               "arrival.max_in_flight=1 cache.capacity_tokens=33",
                               "cache=testbed.cache.BlockHashCache takes no capacity_tokens"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_configs_the_fuzzer_found_broken_are_refused_in_one_line_before_they_run(
        name, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as outside the test suite
    overrides, refusal = REFUSED[name]
    outcome = run_one(overrides.split(), None, tmp_path, repeat=False)
    assert (outcome.status, outcome.problems) == ("refused", [])
    assert outcome.refusal.startswith(refusal)


def test_an_internal_error_is_a_failure_with_the_command_that_reproduces_it(
        tmp_path, monkeypatch):
    import testbed.backends.dispatch

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(testbed.backends.dispatch, "replay", broken)
    outcome = run_one(["backend=replay", "workload.num_problems=1"], None, tmp_path, False)
    assert outcome.status == "failed"
    assert outcome.problems[0].startswith("internal error: KeyError: 'boom'")
    assert outcome.command.startswith("python -m testbed.run backend=replay "
                                      "workload.num_problems=1 debug.check_invariants=true")


def test_a_config_past_the_time_limit_is_a_failure_named_a_hang(tmp_path, monkeypatch):
    # the fuzzer, seed 6006 #9064: a livelocked run held the whole fuzz run until killed
    import testbed.fuzz.cli as cli

    def livelock(cfg, target, notes):
        while True:
            pass

    config = ["backend=replay", "workload.num_problems=1"]
    # composed, assembled and generated once outside the limit (a first compose or import may take
    # longer than the limit on a slow machine): only the run is inside it
    composed = cli.compose_config([*config, *cli.ALWAYS])
    cli.assemble(composed).requests()
    monkeypatch.setattr(cli, "draw_config", lambda rng, session, index: (config, composed))
    monkeypatch.setattr(cli, "execute", livelock)
    session = cli.Session.start(tmp_path, seed=0)
    try:
        outcome = cli.run_drawn(np.random.default_rng(0), session, 0, 0.0, timeout_s=1.0)
    finally:
        session.stop()
    assert (outcome.status, outcome.overrides) == ("failed", config)
    assert outcome.problems[0].startswith("no result after 1 s (--timeout): a hang")
    assert "in livelock" in outcome.problems[0]
    assert outcome.command.startswith("python -m testbed.run backend=replay")


def test_a_refusal_is_not_a_failure(tmp_path):
    outcome = run_one(["cache.capacity_tokens=-1"], None, tmp_path, False)
    assert outcome.status == "refused" and outcome.problems == []


def test_the_checks_catch_inconsistent_run_files(tmp_path):
    outcome = run_one(["backend=sim", "workload.num_problems=2", "cache.capacity_tokens=2000"],
                      None, tmp_path, False)
    assert outcome.status == "ok", outcome.problems
    run = tmp_path / "0"
    summary = json.loads((run / "summary.json").read_text())
    assert check_run(run, summary) == []
    records = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines()]
    records[1]["cached_tokens"] = records[1]["prompt_tokens"] + 1  # more hits than prompt
    records[2]["first_token_s"] = records[2]["arrival_s"] - 1.0  # a token before arrival
    (run / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    steps[0]["kv_used_tokens"] = 2001  # more KV than the pool
    (run / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    problems = check_run(run, summary)
    assert any(f"request {records[1]['id']}: cached" in p for p in problems)
    assert any(f"request {records[2]['id']}: first token" in p for p in problems)
    assert any("KV in use 2001 > capacity 2000" in p for p in problems)
    assert any(p.startswith("summary cached/prompt") for p in problems)


def test_a_servers_refusal_of_a_call_is_no_defect_but_its_error_is(tmp_path):
    """A trace's token id past the served model's vocabulary is refused by the server (HTTP 400,
    found by the fuzzer on a mooncake trace): the call is recorded failed, the run goes on, its
    prompt counted and its unknown hit left out of the hit rate."""
    rows = [{"id": "a", "prompt_tokens": 3, "cached_tokens": None, "failed": True,
             "status": 400, "error": "token id 1536 at position 0 is outside the model's "
                                     "vocabulary of 256 tokens"},
            {"id": "b", "prompt_tokens": 3, "cached_tokens": 0},
            {"id": "c", "prompt_tokens": 3, "cached_tokens": None, "failed": True,
             "status": 500, "error": "AssertionError"}]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"num_requests": 3, "backend": "server", "cached_tokens": 0, "prompt_tokens": 9,
               "hit_rate": 0.0}
    assert check_run(tmp_path, summary) == [
        "request c: the call failed (HTTP 500): AssertionError"]


def bad_trace(tmp_path, kind: str, seed: int = 3) -> list[str]:
    """The overrides of a run of a spoiled trace of ``kind``."""
    path = bad_trace_path(tmp_path, seed, kind)
    write_token_trace(path, np.random.default_rng(seed), 50)
    spoil(path, kind, np.random.default_rng([seed, 44]))
    return ["workload=trace", f"workload.path={path}", "workload.format=tokens"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_malformed_trace_is_refused_in_one_line_naming_its_file(
        tmp_path, kind):
    backend = ["replay", "sim", "engine"][KINDS.index(kind) % 3]
    overrides = [f"backend={backend}", *bad_trace(tmp_path, kind)]
    if backend == "engine":
        overrides += ["model=tiny", "device=cpu"]
    assert malformed_kind(overrides) == kind
    outcome = run_one(overrides, None, tmp_path / "run", repeat=False)
    assert (outcome.status, outcome.problems) == ("refused", [])
    assert outcome.refusal.startswith(f"{tmp_path}/bad3_{kind}.jsonl:")


def test_a_malformed_trace_that_runs_is_a_failure(tmp_path, monkeypatch):
    import testbed.workloads
    import testbed.workloads.traces

    for module in (testbed.workloads, testbed.workloads.traces):  # as before issue 44
        monkeypatch.setattr(module, "check_workload", lambda *args: None)
    outcome = run_one(["backend=replay", *bad_trace(tmp_path, "after_names_no_call")], None,
                      tmp_path / "run", repeat=False)
    assert (outcome.status, outcome.problems) == (
        "failed", ["a malformed trace (after_names_no_call) ran"])
