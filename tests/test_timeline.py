"""Steps and timelines (docs/design.md §3): `steps.jsonl` rows and request phases from the
`RunObserver`, and `timeline.json` in the Chrome trace-event format, on the simulator (with
concurrency, chunked prefill, retraction, overlap, load-backs and replicas) and on the engine."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from testbed.config.assembly import compose_config
from testbed.cache import RadixCache
from testbed.cache.tiers import TieredRadixCache
from testbed.execute import execute
from testbed.sim.executor import StepOutcome, predetermined_tokens
from testbed.serving.observer import PHASES, STEP_FIELDS
from testbed.serving.serve import records_of, serve
from testbed.results.timeline import trace_events
from testbed.workloads.request import Request
from tests.conftest import toks
from tests.test_tiers import planner, three_requests

REPO = Path(__file__).resolve().parents[1]


class BinaryTime:
    """Prefill steps take 1/4 s, decode steps 1/8 s: every time is exact in binary."""

    def execute(self, batch):
        return StepOutcome(0.25 if batch.kind == "prefill" else 0.125,
                           predetermined_tokens(batch))


def crowd() -> list[Request]:
    """Five requests arriving 1/16 s apart whose decodes outgrow a 60-token pool."""
    return [Request(f"r{i}", toks(i, *range(10, 18 + 3 * i)),
                    np.arange(1000, 1012, dtype=np.int32), arrival_s=i / 16) for i in range(5)]


CROWDED = {"name": "fcfs", "init_new_token_ratio": 0.0, "min_new_token_ratio_factor": 0.0,
           "chunked_prefill_size": 7, "clip_max_new_tokens": 1,
           "sglang": "0.4.10"}  # the exact steps below were worked out under 0.4.10's rules


def serve_crowd(overlap: bool = False):
    return serve(crowd(), RadixCache(60), CROWDED | {"overlap": overlap}, BinaryTime(),
                 observe=True, record_steps=True)


def phases(life) -> list[tuple[str, float, float]]:
    return [(s.phase, s.start_s, s.end_s) for s in life.spans]


# ---------------------------------------------------------------------------- the observer
@pytest.mark.parametrize("overlap", [False, True])
def test_watching_a_run_changes_none_of_its_decisions(overlap):
    runs = [serve(crowd(), RadixCache(60), CROWDED | {"overlap": overlap}, BinaryTime(),
                  observe=observe, record_steps=True)[1] for observe in (False, True)]
    assert runs[0].observer is None and runs[1].observer is not None
    assert runs[0].steps == runs[1].steps
    assert records_of(runs[0].reqs) == records_of(runs[1].reqs)


@pytest.mark.parametrize("overlap", [False, True])
def test_each_requests_phases_tile_its_life_through_chunks_and_retractions(overlap):
    scheduler, result = serve_crowd(overlap)
    assert scheduler.preemptions > 0
    lives = result.observer.lives
    assert list(lives) == [r.id for r in result.reqs]
    for req in result.reqs:
        life = lives[req.id]
        spans = phases(life)
        assert spans[0][1] == life.arrival_s == req.submitted_s
        assert spans[-1][2] == life.finish_s == req.finish_s
        assert all(a[2] == b[1] for a, b in zip(spans, spans[1:]))  # no gap, no overlap
        assert all(start < end for _, start, end in spans)
        assert {p for p, _, _ in spans} <= set(PHASES)
        names = [p for p, _, _ in spans if p != "queued"]
        if not overlap:
            assert names == ["prefill", "decode"] * (req.preemptions + 1)  # one each admission
        else:  # the step formed as a prefill's token comes in may retract it that instant
            assert [p for p in names if p == "prefill"] == ["prefill"] * (req.preemptions + 1)
            assert "decode" in names and ("decode", "decode") not in zip(names, names[1:])
        first_prefill = next(s for s in spans if s[0] == "prefill")
        if names[1] == "decode":
            assert first_prefill[2] == req.first_token_s  # prefill: admission to first token


def test_the_crowd_runs_as_the_steps_say():
    """Exact phases of the first two requests: r0's 9 tokens take two 7-token chunk steps, r1
    arrives during the first and its first 5 tokens join r0's last 2; r1 decodes from its token
    until the decode step at 2.125 s retracts it, and waits again."""
    _, result = serve_crowd()
    lives = result.observer.lives
    assert phases(lives["r0"]) == [("prefill", 0.0, 0.5), ("decode", 0.5, 6.125)]
    assert phases(lives["r1"])[:4] == [("queued", 0.0625, 0.25), ("prefill", 0.25, 0.75),
                                       ("decode", 0.75, 2.125), ("queued", 2.125, 4.625)]
    assert [s.ids for s in result.steps[:2]] == [("r0",), ("r0", "r1")]
    assert result.reqs[1].preemptions == 2
    rows = result.observer.rows
    assert [(r.kind, r.batch_size, r.new_tokens, r.context_tokens) for r in rows[:3]] == \
        [("prefill", 1, 7, 0), ("prefill", 2, 7, 7), ("prefill", 1, 7, 5)]
    assert [(r.admitted, r.admitted_prompt_tokens, r.waiting, r.running) for r in rows[:3]] == \
        [(1, 9, 3, 1), (1, 12, 3, 2), (0, 0, 3, 2)]


@pytest.mark.parametrize("overlap", [False, True])
def test_step_rows_match_the_steps_run_and_add_up_to_the_run(overlap):
    scheduler, result = serve_crowd(overlap)
    rows = result.observer.rows
    assert [(r.kind, r.batch_size, r.new_tokens, r.context_tokens) for r in rows] == \
        [(s.kind, len(s.ids), sum(s.new), sum(s.context)) for s in result.steps]
    assert all(r.start_s + r.duration_s <= n.start_s for r, n in zip(rows, rows[1:]))
    assert sum(r.admitted for r in rows) == 5
    assert sum(r.admitted_prompt_tokens for r in rows) == sum(len(r.prompt) for r in result.reqs)
    assert sum(r.admitted_hit_tokens for r in rows) == sum(r.cached_tokens for r in result.reqs)
    for r in rows:
        assert r.kv_used_tokens + r.evictable_tokens + r.free_tokens == 60
        assert r.loading == 0 and r.running + r.waiting <= 5
    assert rows[-1].running == rows[-1].waiting == 0 and rows[-1].kv_used_tokens == 0


def test_a_load_back_is_its_own_phase():
    cache = TieredRadixCache(10, host_tokens=20, write_policy="write_back", planner=planner(1))
    _, result = serve(three_requests(), cache, {"name": "fcfs"}, BinaryTime(), observe=True)
    # c is considered on arrival, loads 8 tokens (0.5 s + 8 s), then prefills its last token
    # and finishes (one output token)
    assert phases(result.observer.lives["c"]) == [("load", 2.0, 10.5), ("prefill", 10.5, 10.75)]
    assert [(r.start_s, r.new_tokens) for r in result.observer.rows] == \
        [(0.0, 8), (1.0, 8), (10.5, 1)]


# ---------------------------------------------------------------------------- timeline.json
def ns(us: float) -> int:
    return round(us * 1000)


def check_trace(doc: dict) -> dict[tuple[int, int], list[dict]]:
    """Assert the trace-event structure; returns the complete events per (pid, tid)."""
    doc = json.loads(json.dumps(doc))  # plain JSON all the way
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    names = {}
    tracks: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in events:
        assert {"name", "ph", "pid"} <= set(e)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name",
                                 "thread_sort_index")
            assert set(e["args"]) == {"name" if e["name"].endswith("name") else "sort_index"}
            if e["name"] == "thread_name":
                names[e["pid"], e["tid"]] = e["args"]["name"]
        elif e["ph"] == "X":
            assert {"ts", "dur", "tid", "cat"} <= set(e) and e["ts"] >= 0 and e["dur"] >= 0
            tracks[e["pid"], e["tid"]].append(e)
        elif e["ph"] == "C":
            assert e["ts"] >= 0 and e["args"]
            assert all(isinstance(v, int) and v >= 0 for v in e["args"].values())
        else:
            raise AssertionError(f"unexpected phase {e['ph']}")
    assert set(tracks) <= set(names)
    for (pid, tid), track in tracks.items():
        if names[pid, tid] == "steps":
            assert all(e["cat"] == "step" and e["name"] in ("prefill", "decode") for e in track)
            assert {"batch_size", "new_tokens", "context_tokens", "kv_used_tokens"} <= \
                set(track[0]["args"])
            order = sorted(track, key=lambda e: ns(e["ts"]))
            for a, b in zip(order, order[1:]):
                assert ns(a["ts"]) + ns(a["dur"]) <= ns(b["ts"])  # steps never overlap
            continue
        life, *parts = track  # the request, then its phases in order
        assert life["cat"] == "request" and names[pid, tid] == f"req {life['name']}"
        assert all(p["cat"] == "phase" and p["name"] in PHASES for p in parts)
        edges = [ns(life["ts"])]
        for p in parts:
            assert ns(p["ts"]) == edges[-1] and ns(p["dur"]) > 0  # nested, no gap, no overlap
            edges.append(ns(p["ts"]) + ns(p["dur"]))
        assert edges[-1] == ns(life["ts"]) + ns(life["dur"])  # it tiles the life exactly
    return tracks


def test_the_trace_of_the_crowd_has_every_step_and_request():
    _, result = serve_crowd()
    tracks = check_trace(trace_events(result.observer))
    steps = tracks[1, 1]
    assert len(steps) == len(result.steps)
    assert steps[0] == {"name": "prefill", "cat": "step", "ph": "X", "pid": 1, "tid": 1,
                        "ts": 0.0, "dur": 250000.0, "args": steps[0]["args"]}
    assert steps[0]["args"]["new_tokens"] == 7
    r0 = tracks[1, 2]
    assert [(e["name"], e["ts"], e["dur"]) for e in r0] == \
        [("r0", 0.0, 6.125e6), ("prefill", 0.0, 5e5), ("decode", 5e5, 5.625e6)]  # as above
    assert r0[0]["args"] == {"prompt_tokens": 9, "cached_tokens": 0, "output_tokens": 12,
                             "preemptions": 0, "aborted": False}


# ---------------------------------------------------------------------------- whole runs
def run(tmp_path: Path, *overrides: str) -> dict:
    cfg = compose_config(["progress=false", "timeline=true", *overrides])
    return execute(cfg, tmp_path)


def read_steps(run_dir: Path) -> pd.DataFrame:
    steps = pd.read_json(run_dir / "steps.jsonl", lines=True)
    assert list(steps.columns) == list(STEP_FIELDS)
    return steps


SIM_PRESSURE = ["workload=chat_long", "workload.num_sessions=6", "workload.turns=2",
                "cache.capacity_tokens=3000", "scheduler.chunked_prefill_size=256",
                "scheduler.init_new_token_ratio=0.2",  # admit enough that decode retracts
                "model=llama3_8b", "hardware=h100"]


def test_a_sim_run_writes_steps_and_a_timeline_that_tiles_every_request(tmp_path):
    summary = run(tmp_path, *SIM_PRESSURE)
    assert summary["preemptions"] > 0
    steps = read_steps(tmp_path)
    assert len(steps) == summary["prefill_steps"] + summary["decode_steps"]
    assert steps["admitted_hit_tokens"].sum() == summary["cached_tokens"]
    assert steps["admitted_prompt_tokens"].sum() == summary["prompt_tokens"]
    assert (steps["kv_used_tokens"] + steps["evictable_tokens"] + steps["free_tokens"]
            == summary["kv_capacity_tokens"]).all()
    assert steps["running"].max() > 1  # requests ran together
    tracks = check_trace(json.loads((tmp_path / "timeline.json").read_text()))
    requests = pd.read_json(tmp_path / "requests.jsonl", lines=True)
    lives = {t[0]["name"]: t for t in tracks.values() if t[0]["cat"] == "request"}
    assert set(lives) == set(requests["id"])
    for rec in requests.itertuples():
        life, *parts = lives[rec.id]
        assert ns(life["ts"]) == round(rec.arrival_s * 1e9)
        assert ns(life["ts"]) + ns(life["dur"]) == round(rec.finish_s * 1e9)
        assert [p["name"] for p in parts].count("prefill") == rec.preemptions + 1
    chunked = [t for t in lives.values() if t[0]["args"]["prompt_tokens"] > 256]
    assert chunked  # their prefills span several steps: longer than any one step
    longest_step = max(e["dur"] for e in tracks[1, 1])
    assert any(p["name"] == "prefill" and p["dur"] > longest_step for t in chunked for p in t[1:])


def test_replicas_get_a_process_each_and_the_trip_is_a_phase(tmp_path):
    summary = run(tmp_path, "workload=few_shot", "workload.num_tasks=2",
                  "workload.questions_per_task=4", "replicas=2", "router.network_delay_s=0.001")
    tracks = check_trace(json.loads((tmp_path / "timeline.json").read_text()))
    requests = pd.read_json(tmp_path / "requests.jsonl", lines=True)
    lives = {(pid, tid): t for (pid, tid), t in tracks.items() if t[0]["cat"] == "request"}
    pid_of = {t[0]["name"]: pid for (pid, _), t in lives.items()}
    assert {rid: pid - 1 for rid, pid in pid_of.items()} == dict(zip(requests["id"],
                                                                     requests["replica"]))
    assert set(tracks) - set(lives) == {(1, 1), (2, 2)}  # each replica's steps
    assert sorted(tid for _, tid in lives) == list(range(3, 3 + len(requests)))  # unique tids
    assert {t[1]["name"] for t in lives.values()} == {"network"}  # router to replica: 1 ms
    assert all(abs(ns(t[1]["dur"]) - 1_000_000) <= 1 for t in lives.values())
    assert summary["num_replicas"] == 2
    steps = read_steps(tmp_path)
    assert sorted(steps["replica"].unique()) == [0, 1]


def test_timeline_needs_time(tmp_path):
    with pytest.raises(ValueError, match="timeline=true needs backend=sim or backend=engine"):
        run(tmp_path, "backend=replay", "workload.num_problems=2")


def test_a_tiny_engine_run_writes_a_timeline_of_measured_steps(tmp_path):
    pytest.importorskip("torch")
    summary = run(tmp_path, "backend=engine", "model=tiny", "hardware=cpu", "device=cpu",
                  "workload=few_shot", "workload.num_tasks=2", "workload.questions_per_task=3",
                  "workload.example_len=20", "workload.question_len=9", "workload.output_len=3",
                  "workload.vocab_size=256")
    steps = read_steps(tmp_path)
    assert len(steps) == summary["prefill_steps"] + summary["decode_steps"]
    assert steps["duration_s"].sum() == pytest.approx(summary["busy_s"])
    tracks = check_trace(json.loads((tmp_path / "timeline.json").read_text()))
    assert len([t for t in tracks.values() if t[0]["cat"] == "request"]) == \
        summary["num_requests"] == 6
