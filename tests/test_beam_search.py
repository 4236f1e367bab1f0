"""Beam search on the engine (testbed/scheduler/beam.py): HF's selection rule on hand-made
log-probs; beam calls in token traces; on tiny random Llamas the best sequence and its score equal
HF ``generate(num_beams=W)`` for W = 1 (greedy), 2, 4, 8, with the model's EOS ending hypotheses;
beams share their history through the radix tree (every beam request after round 0 hits all but
its newest token); ``beams.jsonl`` and ``beam_trace.jsonl`` are written, and the trace replays."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

from testbed.engine.loader import save_random_hf_model, tiny_config  # noqa: E402
from testbed.scheduler.beam import BeamSearch  # noqa: E402
from testbed.workloads.request import Request  # noqa: E402
from testbed.workloads.traces import TraceError, load_tokens  # noqa: E402
from tests.test_engine_generate import hf_generate, run, write_trace  # noqa: E402
from tests.test_real_model import smollm2  # noqa: E402,F401  (the real model's fixture)

EOS = 224  # the tiny model (seed 5) continues call c2's prompt with it first


def hf_beam(hf, prompt: list[int], width: int, n: int) -> tuple[list[int], float]:
    """HF's best beam (generated tokens) and its score, with HF's defaults."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                      do_sample=False, num_beams=width, pad_token_id=0,
                      return_dict_in_generate=True, output_scores=True)
    return out.sequences[0, len(prompt):].tolist(), float(out.sequences_scores[0])


def beam_run(tmp_path: Path, records: list[dict], *overrides: str) -> tuple[dict, list, list]:
    trace = write_trace(tmp_path / "beams_in.jsonl", records)
    summary, requests = run(tmp_path, "backend=engine", "device=cpu", "workload=trace",
                            f"workload.path={trace}", *overrides)
    beams = [json.loads(x) for x in (tmp_path / "run" / "beams.jsonl").read_text().splitlines()]
    return summary, requests, beams


# ---------------------------------------------------------------------------- the rule
def search(width: int, n: int, eos: int = 9) -> BeamSearch:
    call = Request("c", np.array([1, 2, 3]), np.zeros(0, np.int32), max_new_tokens=n,
                   beam_width=width)
    return BeamSearch(call, call.prompt, frozenset({eos}))


def feed(s: BeamSearch, table: dict[tuple[int, ...], dict[int, float]]) -> list[list[int]]:
    """Run ``s`` on log-probs looked up by each beam's tokens; the rounds' beams."""
    rounds, requests = [], s.start()
    while requests:
        rounds.append([list(b.tokens) for b in s.beams])
        for r, b in zip(requests, s.beams):
            ids, lps = zip(*sorted(table[b.tokens].items(), key=lambda kv: -kv[1]))
            s.observe(r.id, np.array(ids), np.log(np.array(lps, np.float32)))
        following = []
        for r in requests:
            following += s.finished(r.id)
        requests = following
    return rounds


def test_two_beams_keep_the_second_token_that_wins_later_and_score_by_length():
    """Greedy takes 5 (0.5) then EOS (0.4); the beam through 6 (0.4, then 0.9) wins: 0.36 > 0.2.
    At the N-th token the first W continuations become hypotheses scored by their length."""
    s = search(width=2, n=2)
    rounds = feed(s, {(): {5: 0.5, 6: 0.4, 7: 0.05, 8: 0.05},
                      (5,): {1: 0.2, 2: 0.2, 3: 0.2, 9: 0.4},
                      (6,): {4: 0.9, 9: 0.05, 1: 0.03, 2: 0.02}})
    assert rounds == [[[]], [[5], [6]]]
    assert s.result()["sequences"] == [[6, 4], [5, 9]]
    assert s.result()["scores"] == pytest.approx([np.log(0.36) / 2, np.log(0.2) / 2], rel=1e-6)
    assert [r.request.id for r in s.tree] == ["c/r0b0", "c/r1b0", "c/r1b1"]
    assert s.tree[1].request.prompt.tolist() == [1, 2, 3, 5]
    assert s.tree[1].request.after == ["c/r0b0"] and s.tree[1].request.top_logprobs == 4


def test_the_search_stops_once_no_live_beam_can_beat_the_worst_hypothesis():
    """Both beams' best continuation is EOS: two hypotheses at length 2 (0.48, 0.27), and the
    best live beam (0.06) cannot beat the worse one: the search stops after round 1 of 5."""
    s = search(width=2, n=5)
    rounds = feed(s, {(): {5: 0.6, 6: 0.3, 7: 0.05, 8: 0.05},
                      (5,): {9: 0.8, 1: 0.1, 2: 0.05, 3: 0.05},
                      (6,): {9: 0.9, 1: 0.05, 2: 0.03, 3: 0.02}})
    assert len(rounds) == 2 and s.done
    assert s.result()["sequences"] == [[5, 9], [6, 9]]


# ---------------------------------------------------------------------------- trace lines
@pytest.mark.parametrize("record, message", [
    ({"prompt": [1], "max_new_tokens": 3, "beam_width": 0}, "'beam_width' must be >= 1"),
    ({"prompt": [1], "output": [2], "beam_width": 2}, "needs 'max_new_tokens' >= 1"),
    ({"prompt": [1], "max_new_tokens": 0, "beam_width": 2}, "needs 'max_new_tokens' >= 1"),
])
def test_a_bad_beam_line_is_named(tmp_path, record, message):
    with pytest.raises(TraceError, match=message):
        load_tokens(write_trace(tmp_path / "t.jsonl", [record]))


def test_only_the_engine_runs_beam_calls():
    from testbed.errors import WorkloadRefused
    from testbed.workloads.request import refuse_beams
    call = Request("c", np.array([1]), np.zeros(0, np.int32), max_new_tokens=2, beam_width=2)
    refuse_beams([], "server")
    with pytest.raises(WorkloadRefused, match="request c has 'beam_width': only backend=engine "
                                              r"runs beam search \(backend=server\)"):
        refuse_beams([call], "server")


# ---------------------------------------------------------------------------- tiny models
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("beam")
    hf = save_random_hf_model(base / "ckpt", tiny_config(eos_token_id=EOS), seed=5)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 20).tolist() for _ in range(3)]
    return base / "ckpt", hf, prompts


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_the_best_beam_equals_hf_generate_num_beams_on_a_tiny_llama(tmp_path, tiny, width):
    ckpt, hf, prompts = tiny
    n = 10
    records = [{"id": f"c{i}", "prompt": p, "max_new_tokens": n, "beam_width": width}
               for i, p in enumerate(prompts)]
    summary, requests, beams = beam_run(tmp_path, records, f"model.path={ckpt}")
    assert [b["id"] for b in beams] == ["c0", "c1", "c2"]
    for rec, got in zip(records, beams):
        if width == 1:
            assert got["sequences"] == [hf_generate(hf, rec["prompt"], n)], rec["id"]
            continue
        tokens, score = hf_beam(hf, rec["prompt"], width, n)
        assert got["sequences"][0] == tokens, rec["id"]
        assert got["scores"][0] == pytest.approx(score, abs=1e-5)
        assert len(got["sequences"]) == width and got["scores"] == sorted(got["scores"])[::-1]
    if width > 1:  # the model's EOS ended some hypotheses early
        assert any(seq[-1] == EOS and len(seq) < n for b in beams for seq in b["sequences"])
    assert summary["aborted_requests"] == 0


def test_beam_requests_hit_all_but_their_newest_token_and_the_saved_tree_replays_and_simulates(
        tmp_path, tiny):
    ckpt, hf, prompts = tiny
    records = [{"id": "c0", "prompt": prompts[0], "max_new_tokens": 6, "beam_width": 4}]
    summary, requests, beams = beam_run(tmp_path, records, f"model.path={ckpt}",
                                        "debug.check_invariants=true")
    assert [r["id"] for r in requests[:6]] == ["c0/r0b0", "c0/r1b0", "c0/r1b1", "c0/r1b2",
                                               "c0/r1b3", "c0/r2b0"]
    assert len(requests) == 1 + 4 * 5  # the 6th round's candidates end without a request
    for r in requests:
        assert r["cached_tokens"] == (0 if r["id"] == "c0/r0b0" else r["prompt_tokens"] - 1)
        assert r["output_tokens"] == 0
    trace = load_tokens(tmp_path / "run" / "beam_trace.jsonl")
    assert [t.id for t in trace] == [r["id"] for r in requests]
    assert trace[5].after == [f"c0/r1b{i}" for i in range(4)] and trace[5].program == "c0"
    for backend in ("replay", "sim"):  # the tree the engine ran, served again
        _, again = run(tmp_path / backend, f"backend={backend}", "workload=trace",
                       f"workload.path={tmp_path / 'run' / 'beam_trace.jsonl'}")
        assert [r["cached_tokens"] for r in again] == [r["cached_tokens"] for r in requests]


# ---------------------------------------------------------------------------- the real model
def real_records(tok, width: int, n: int, questions: list[str]) -> list[dict]:
    from tests.test_real_model import chat_ids
    return [{"id": f"q{i}", "prompt": chat_ids(tok, q), "max_new_tokens": n, "beam_width": width}
            for i, q in enumerate(questions)]


@pytest.mark.parametrize("width", [2, 4])
def test_the_best_beam_equals_hf_generate_on_the_real_model_with_evictions(tmp_path, smollm2,
                                                                         width):
    """A chat prompt and a pool of it plus about one beam's worth of tokens: the beams pruned
    earlier are evicted as the search goes."""
    from tests.test_real_model import QUESTIONS
    path, tok, hf = smollm2
    n = 8
    records = real_records(tok, width, n, QUESTIONS[:1])
    capacity = len(records[0]["prompt"]) + n + width
    summary, requests, beams = beam_run(tmp_path, records, "model=smollm2_135m",
                                        f"cache.capacity_tokens={capacity}")
    assert summary["evicted_tokens"] > 0 and summary["aborted_requests"] == 0
    for rec, got in zip(records, beams):
        tokens, score = hf_beam(hf, rec["prompt"], width, n)
        assert got["sequences"][0] == tokens, rec["id"]
        assert got["scores"][0] == pytest.approx(score, abs=1e-4)


def test_the_best_beam_equals_hf_generate_on_the_real_model_when_greedy_calls_retract(
        tmp_path, smollm2):
    """A beam call (W = 4) beside two greedy chats that reserve one output token each
    (``clip_max_new_tokens=1``): their decoding outgrows the pool and they are retracted while
    the beams run; the best beam and the greedy outputs still equal HF's."""
    from tests.test_real_model import QUESTIONS, chat_ids
    path, tok, hf = smollm2
    n = 8
    records = real_records(tok, 4, n, QUESTIONS[2:3])
    greedy = [{"id": f"g{i}", "prompt": chat_ids(tok, q), "max_new_tokens": 10}
              for i, q in enumerate(QUESTIONS[3:5])]
    prompts = [r["prompt"] for r in records + greedy]
    distinct = len(prompts[0]) + sum(len(p) - 32 for p in prompts[1:])  # ≥ 32 shared, each
    summary, requests, beams = beam_run(tmp_path, records + greedy, "model=smollm2_135m",
                                        f"cache.capacity_tokens={distinct + 10}",
                                        "scheduler.clip_max_new_tokens=1", "save_token_ids=true")
    assert summary["preemptions"] > 0 and summary["aborted_requests"] == 0
    tokens, score = hf_beam(hf, records[0]["prompt"], 4, n)
    assert beams[0]["sequences"][0] == tokens
    by_id = {r["id"]: r for r in requests}
    for rec in greedy:
        assert by_id[rec["id"]]["output_ids"] == hf_generate(hf, rec["prompt"], 10), rec["id"]


# ---------------------------------------------------------------------------- workload=beam_search
def test_the_beam_search_workload_forks_the_best_beams_one_token_apart():
    from testbed.workloads.beam_search import beam_search
    calls = beam_search(num_prompts=2, prompt_len=40, beam_width=4, depth=8, seed=1)
    assert len(calls) == 2 * (1 + 4 * 7)
    by_id = {c.id: c for c in calls}
    children = {}
    for c in calls[1:29]:  # program beam0 after its round 0
        rnd = int(c.id.split("/r")[1].split("b")[0])
        parent = next(p for p in c.after if (by_id[p].prompt == c.prompt[:-1]).all())
        assert c.after == [f"beam0/r{rnd - 1}b{i}" for i in range(1 if rnd == 1 else 4)]
        assert len(c.prompt) == 40 + rnd and len(c.output) == 0 and c.program == "beam0"
        children.setdefault(parent, []).append(c.id)
    # some beams fork twice or more, so others are pruned (no child)
    assert max(map(len, children.values())) >= 2
    assert len(children) < 1 + 4 * 6


def test_radix_page_1_hits_more_than_16_token_blocks_on_beam_search_in_replay(tmp_path):
    """W = 4: a beam request's prompt is its parent's plus one token, so page 1 hits all but
    that token and 16-token blocks lose what follows the last whole block (here 8 of 41..47)."""
    base = ["backend=replay", "workload=beam_search", "workload.num_prompts=2",
            "workload.prompt_len=40", "workload.beam_width=4", "workload.depth=8"]
    radix, radix_requests = run(tmp_path / "radix", *base, "cache=radix")
    block, block_requests = run(tmp_path / "block", *base, "cache=block_hash",
                                "cache.block_size=16")
    for r, b in zip(radix_requests, block_requests):
        first = r["id"].endswith("/r0b0")
        assert r["cached_tokens"] == (0 if first else r["prompt_tokens"] - 1)
        assert b["cached_tokens"] == (0 if first else 32)
    assert radix["cached_tokens"] == 2 * sum(4 * (40 + t - 1) for t in range(1, 8)) == 2408
    assert block["cached_tokens"] == 2 * 28 * 32 == 1792
    assert radix["hit_rate"] > block["hit_rate"]


def test_an_aborted_beam_request_ends_its_call_once_its_round_has_finished():
    s = search(width=2, n=4)
    first = s.start()
    s.observe(first[0].id, np.array([5, 6, 7, 8]), np.log(np.array([.4, .3, .2, .1], np.float32)))
    second = s.finished(first[0].id)
    assert [r.id for r in second] == ["c/r1b0", "c/r1b1"] and not s.done
    assert s.finished("c/r1b0", aborted=True) == [] and not s.done  # c/r1b1 still runs
    assert s.finished("c/r1b1") == [] and s.done
    assert s.result() == {"id": "c", "sequences": [], "scores": [], "aborted": True}
