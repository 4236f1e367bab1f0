"""Speculative decoding on the engine: n-gram drafts verified in one forward give exactly the
tokens plain greedy decoding gives, request for request (tiny random Llama with torch and Triton
attention, under eviction and retraction; SmolLM2-135M when it is in the data folder), the
simulator and the engine replaying one output draft and accept alike, and the acceptance rules
(greedy; rejection sampling) on known distributions."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

from testbed.engine.verify import greedy_accept, rejection_accept  # noqa: E402
from testbed.errors import BadInput  # noqa: E402
from tests.test_engine_generate import hf_generate, run, write_trace  # noqa: E402
from tests.test_real_model import chat_ids, smollm2  # noqa: E402,F401 - the fixture

NGRAM = ("speculative.method=ngram", "speculative.num_tokens=4")


def copying_trace(path: Path, vocab: int = 256, new: int = 24, calls: int = 6) -> Path:
    """``calls`` calls sharing a 40-token prefix, each repeating a 12-token passage in its
    prompt (so prompt lookup has something to find), two arriving at a time."""
    rng = np.random.default_rng(3)
    tok = lambda n: rng.integers(0, vocab, n).tolist()  # noqa: E731
    system = tok(40)
    records = []
    for i in range(calls):
        body = tok(12)
        records.append({"id": f"q{i}", "prompt": system + body + body[:6] + tok(3) + body,
                        "max_new_tokens": new, "arrival_s": float(i // 2)})
    return write_trace(path, records)


def outputs(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, dict[str, list[int]]]:
    summary, records = run(tmp_path / name, "backend=engine", "model=tiny", "device=cpu",
                           "engine.forced=false", "save_token_ids=true",
                           "debug.check_invariants=true", *overrides)
    return summary, {r["id"]: r["output_ids"] for r in records}


@pytest.mark.parametrize("attention, calls", [("torch", 6), ("triton", 2)])  # (the interpreter)
def test_ngram_speculation_gives_plain_greedy_tokens_on_the_tiny_model(tmp_path, attention,
                                                                       calls):
    trace = copying_trace(tmp_path / "t.jsonl", calls=calls, new=16 if calls < 6 else 24)
    common = ("workload=trace", f"workload.path={trace}", f"engine.attention={attention}")
    _, plain = outputs(tmp_path, "plain", *common)
    summary, spec = outputs(tmp_path, "spec", *common, *NGRAM)
    assert spec == plain
    # drafts were proposed, some accepted and some rejected: the equality is not vacuous
    assert summary["spec_accepted"] > 0 and summary["spec_freed_slots"] > 0
    assert summary["spec_mean_accepted_length"] > 1.2
    assert summary["decode_steps"] < sum(len(o) for o in plain.values())


@pytest.mark.parametrize("method, width", [("ngram", 1), ("ngram", 2), ("draft", 1)])
def test_speculation_gives_plain_greedy_tokens_under_eviction_and_retraction(tmp_path, method,
                                                                             width):
    """n-gram chains and trees, and the self-speculative draft model (the tiny model's first
    layer of two), as the pool runs out: evictions and retractions."""
    trace = copying_trace(tmp_path / "t.jsonl")
    common = ("workload=trace", f"workload.path={trace}", "cache.capacity_tokens=130",
              "scheduler.clip_max_new_tokens=1", "engine.attention=torch")
    _, plain = outputs(tmp_path, "plain", *common)
    summary, spec = outputs(tmp_path, "spec", *common, *NGRAM, f"speculative.method={method}",
                            f"speculative.tree_width={width}", "speculative.draft_layers=1")
    assert spec == plain
    assert summary["preemptions"] > 0 and summary["evicted_tokens"] > 0
    assert summary["aborted_requests"] == 0 and summary["spec_accepted"] > 0
    if width == 2:  # some steps accepted a branch the chain would not have drafted
        assert summary["spec_other_branch"] > 0


def test_the_simulator_and_the_engine_replaying_one_output_accept_alike(tmp_path):
    """Forced (the engine replays the workload's output) and ``acceptance=exact`` draft from
    the same contexts and accept the drafts equal to the output: the same figures."""
    trace = copying_trace(tmp_path / "t.jsonl")
    _, generated = outputs(tmp_path, "gen", "workload=trace", f"workload.path={trace}")
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    for r in records:  # the model's own outputs, replayed
        r["output"] = generated[r.pop("id")]
        r.pop("max_new_tokens")
    replay = write_trace(tmp_path / "replay.jsonl", [{"id": f"q{i}", **r}
                                                     for i, r in enumerate(records)])
    keys = ("spec_drafted", "spec_accepted", "spec_verifications", "decode_steps")
    common = ("workload=trace", f"workload.path={replay}", *NGRAM, "hardware=cpu")
    engine, _ = run(tmp_path / "engine", "backend=engine", "model=tiny", "device=cpu", *common)
    sim, _ = run(tmp_path / "sim", "backend=sim", "model=tiny", *common)
    assert {k: engine[k] for k in keys} == {k: sim[k] for k in keys}
    assert engine["forced_agreement"] == 1.0  # the model agrees with its own tokens


def step_rows(run_dir: Path) -> list[tuple]:
    return [(r["kind"], r["batch_size"], r["new_tokens"], r["context_tokens"])
            for r in map(json.loads, (run_dir / "steps.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("pool", [("cache.capacity_tokens=1000",),
                                  ("cache.capacity_tokens=130", "scheduler.clip_max_new_tokens=1")],
                         ids=["roomy", "evicting"])
def test_replaying_an_engine_runs_recorded_acceptance_makes_its_steps_and_accepts_exactly(
        tmp_path, pool):
    """The engine generating with n-gram drafts records each request's accepted drafts per
    verification step (requests.jsonl ``spec_accepted``); the simulator replaying its outputs
    with ``acceptance=recorded`` takes them back step by step: the same steps, the same
    acceptances, request for request (all at t=0 on one KV pool: timing decides nothing)."""
    trace = copying_trace(tmp_path / "t.jsonl")
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    offline = write_trace(tmp_path / "offline.jsonl", [r | {"arrival_s": 0.0} for r in records])
    gen, recs = outputs(tmp_path, "gen", "workload=trace", f"workload.path={offline}", *NGRAM,
                        *pool)
    engine_dir = tmp_path / "gen" / "run"
    engine_lines = [json.loads(line) for line in
                    (engine_dir / "requests.jsonl").read_text().splitlines()]
    accepted = {r["id"]: r["spec_accepted"] for r in engine_lines}
    assert sum(map(sum, accepted.values())) == gen["spec_accepted"] > 0
    replay = write_trace(tmp_path / "replay.jsonl", [
        {"id": r["id"], "prompt": r["prompt_ids"], "output": r["output_ids"], "arrival_s": 0.0}
        for r in engine_lines])
    for path in (engine_dir, engine_dir / "requests.jsonl"):
        sim, sim_recs = run(tmp_path / "sim", "backend=sim", "model=tiny", "workload=trace",
                            f"workload.path={replay}", *NGRAM, *pool,
                            "speculative.acceptance=recorded",
                            f"speculative.acceptance_path={path}")
        assert {r["id"]: r["spec_accepted"] for r in sim_recs} == accepted
        assert step_rows(tmp_path / "sim" / "run") == step_rows(engine_dir)
        keys = ("spec_drafted", "spec_accepted", "spec_verifications", "spec_freed_slots",
                "decode_steps", "prefill_steps", "output_tokens", "preemptions")
        assert {k: sim[k] for k in keys} == {k: gen[k] for k in keys}
    # another run's requests, or a run without speculation: refused in one line
    plain, _ = outputs(tmp_path, "plain", "workload=trace", f"workload.path={offline}")
    for path, message in ((tmp_path / "plain" / "run", "has no spec_accepted"),
                          (tmp_path / "nowhere", "no such run directory")):
        with pytest.raises(BadInput, match="speculative.acceptance_path: .*" + message):
            run(tmp_path / "bad", "backend=sim", "model=tiny", "workload=trace",
                f"workload.path={replay}", *NGRAM, "speculative.acceptance=recorded",
                f"speculative.acceptance_path={path}")
    other = write_trace(tmp_path / "other.jsonl", [
        {"id": "x" + r["id"], "prompt": r["prompt_ids"], "output": r["output_ids"]}
        for r in engine_lines])
    with pytest.raises(BadInput, match=r"speculative.acceptance_path: 6 of the workload's "
                                       r"requests are not in .*\(first: 'xq0'\)"):
        run(tmp_path / "bad", "backend=sim", "model=tiny", "workload=trace",
            f"workload.path={other}", *NGRAM, "speculative.acceptance=recorded",
            f"speculative.acceptance_path={engine_dir}")


def test_greedy_acceptance_takes_drafts_up_to_the_first_mismatch_then_the_bonus():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 9]) == (5, 6, 7)
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == (5, 6, 7, 8)
    assert greedy_accept([4, 6], [5]) == (4,)
    assert greedy_accept([4], []) == (4,)


def test_rejection_sampling_leaves_the_first_token_distributed_as_the_model_says():
    """A draft of probability 1 accepted with p(d), else a sample of p without d: the first
    token emitted is distributed as p itself (5000 seeded draws, within 3 points)."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    gen = torch.Generator().manual_seed(0)
    first = [rejection_accept(p, [1], gen)[0] for _ in range(5000)]
    freq = np.bincount(first, minlength=4) / len(first)
    assert np.abs(freq - p[0].numpy()).max() < 0.03
    accepted = [len(rejection_accept(p, [1], gen)) == 2 for _ in range(5000)]
    assert abs(np.mean(accepted) - 0.3) < 0.03  # accepted with p(1) = 0.3: then the bonus


COPY_TASKS = ["The quick brown fox jumps over the lazy dog near the quiet river bank.",
              "Rain in the hills feeds the streams that run down to the old stone mill.",
              "Every morning the baker lights the oven before the town wakes up."]


@pytest.mark.parametrize("method, width", [("ngram", 1), ("ngram", 2), ("draft", 1)])
def test_smollm2_speculation_equals_hf_greedy_on_copy_prompts_under_retraction(tmp_path, smollm2,
                                                                               method, width):
    """SmolLM2-135M asked to repeat a sentence: drafts (n-gram chains and trees from the prompt;
    its first 10 layers of 30 as a draft model) are accepted, and every output equals HF
    ``generate``'s, while decoding outgrows a small pool (retractions, evictions). Skipped,
    saying how to fetch it, without the model in the data folder."""
    path, tok, hf = smollm2
    prompts = [chat_ids(tok, f"Repeat exactly: {s}") for s in COPY_TASKS]
    new = 16
    shared = len(os.path.commonprefix(prompts))  # the templated system prompt, cached once
    capacity = shared + sum(len(p) - shared for p in prompts) + len(prompts) + 2
    records = [{"id": f"c{i}", "prompt": p, "max_new_tokens": new, "arrival_s": 0.0}
               for i, p in enumerate(prompts)]
    trace = write_trace(tmp_path / "copy.jsonl", records)
    summary, out = run(tmp_path, "backend=engine", "model=smollm2_135m", "device=cpu",
                       "workload=trace", f"workload.path={trace}", *NGRAM,
                       f"speculative.method={method}", f"speculative.tree_width={width}",
                       "speculative.draft_layers=10",
                       f"cache.capacity_tokens={capacity}", "scheduler.clip_max_new_tokens=1",
                       "save_token_ids=true", "debug.check_invariants=true")
    assert summary["preemptions"] > 0 and summary["aborted_requests"] == 0
    if method == "ngram":
        assert summary["spec_accepted"] > 0  # drafts from the prompt were accepted
    else:  # the truncated model rarely agrees with the whole one (speculative.md): it drafted
        assert summary["spec_drafted"] > 0
    for rec, got in zip(records, out):
        assert got["output_ids"] == hf_generate(hf, rec["prompt"], new), rec["id"]


def test_sampling_with_speculation_runs_by_the_rejection_rule_and_is_seeded(tmp_path):
    """Temperature 0.01 (the tiny random model's logits lie close: near greedy there, so some
    drafts pass): the same seed gives the same tokens (the rejection rule draws from the
    sampler's generator), drafts are accepted and rejected, every output runs to its length."""
    trace = copying_trace(tmp_path / "t.jsonl", calls=2)
    common = ("workload=trace", f"workload.path={trace}", *NGRAM, "engine.temperature=0.01")
    first, a = outputs(tmp_path, "a", *common)
    _, b = outputs(tmp_path, "b", *common)
    assert a == b and all(len(o) == 24 for o in a.values())
    assert first["spec_drafted"] > first["spec_accepted"] > 0
