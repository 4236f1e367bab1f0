"""The simulator end to end: driver, dependencies, closed loop, determinism, every workload."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from testbed.config.assembly import compose_config
from testbed.cache import RadixCache
from testbed.execute import execute
from testbed.sim.cost_model import RooflineCostModel, save_fitted
from testbed.sim.executor import SimExecutor
from testbed.serving.serve import records_of, serve
from testbed.sim.specs import hardware_spec, model_spec
from testbed.workloads import WORKLOADS, generate
from testbed.workloads.paper import chat
from tests.test_workloads import small_config

REPO = Path(__file__).resolve().parents[1]


def config(*overrides: str):
    return compose_config(["progress=false", *overrides])


def a10g_llama2_executor() -> SimExecutor:
    cfg = config()
    model = model_spec(dict(cfg.model))
    return SimExecutor(RooflineCostModel(model, hardware_spec(dict(cfg.hardware))))


def test_same_seed_gives_byte_identical_summary_apart_from_wall_time_and_timing(tmp_path):
    cfg = config("workload=tree_of_thought", "workload.num_problems=6", "cache.capacity_tokens=3000")
    texts = []
    for name in ("a", "b"):
        execute(cfg, tmp_path / name)
        doc = json.loads((tmp_path / name / "summary.json").read_text())
        doc.pop("wall_s")
        doc.pop("timing")
        texts.append(json.dumps(doc, sort_keys=True))
        assert (tmp_path / name / "requests.jsonl").read_bytes() == \
            (tmp_path / "a" / "requests.jsonl").read_bytes()
    assert texts[0] == texts[1]


@pytest.mark.parametrize("name", [w for w in WORKLOADS if w != "trace"])
def test_every_generator_runs_in_the_simulator_and_leaks_no_kv(name):
    requests = generate(small_config(name), seed=0)
    cache = RadixCache(4000)
    scheduler, result = serve(requests, cache, {"name": "lpm"}, a10g_llama2_executor())
    assert len(result.reqs) == len(requests)
    for req in result.reqs:
        assert req.finished and not req.aborted
        assert req.output == req.request.output.tolist()
    cache.check_invariants()
    assert cache.protected_size == 0
    assert cache.pool.num_free + cache.total_size == 4000


def test_a_call_is_submitted_think_time_after_its_dependency_finishes():
    requests = chat(num_sessions=2, turns=3, system_prompt_len=8, min_question_len=4,
                    max_question_len=6, min_output_len=2, max_output_len=3, think_time_s=5.0)
    _, result = serve(requests, RadixCache(10_000), {"name": "fcfs"}, a10g_llama2_executor())
    by_id = {r.id: r for r in result.reqs}
    for r in result.reqs:
        if r.request.after:
            (dep,) = r.request.after
            assert r.submitted_s == pytest.approx(by_id[dep].finish_s + 5.0)
        else:
            assert r.submitted_s == 0.0


def test_closed_loop_keeps_at_most_n_programs_in_flight():
    requests = generate(small_config("tree_of_thought") | {"num_problems": 6}, seed=0)
    _, result = serve(requests, RadixCache(10_000), {"name": "lpm"}, a10g_llama2_executor(),
                      max_in_flight=2)
    spans: dict[str, list[float]] = {}
    for r in result.reqs:
        span = spans.setdefault(r.request.program, [r.submitted_s, r.finish_s])
        span[0], span[1] = min(span[0], r.submitted_s), max(span[1], r.finish_s)
    events = sorted([(s, 1) for s, _ in spans.values()] + [(e, -1) for _, e in spans.values()])
    running = peak = 0
    for _, delta in events:  # finishes sort before starts at the same instant
        running += delta
        peak = max(peak, running)
    assert peak == 2


def test_lpm_with_in_batch_hold_reaches_the_ideal_hit_rate_on_an_offline_batch(tmp_path):
    base = ["workload=few_shot", "workload.num_tasks=4", "workload.questions_per_task=16"]
    sglang = execute(config(*base), tmp_path / "sglang")
    hold = execute(config(*base, "scheduler.in_batch_hold=true"), tmp_path / "hold")
    assert hold["hit_rate"] == hold["ideal_hit_rate"]
    # SGLang's rule only sorts the deprioritized last: those that fit the first batch compute the
    # shared prefix themselves
    assert sglang["hit_rate"] < hold["hit_rate"]


def test_radix_with_lpm_beats_no_cache_on_a_shared_prefix_workload(tmp_path):
    base = ["workload=self_consistency", "workload.num_questions=8"]
    radix = execute(config(*base, "cache=radix", "scheduler=lpm"), tmp_path / "radix")
    none = execute(config(*base, "cache=none", "scheduler=fcfs"), tmp_path / "none")
    assert none["hit_rate"] == 0.0
    assert radix["makespan_s"] < none["makespan_s"]


@pytest.mark.parametrize("cache", ["block_hash", "none"])
def test_other_caches_run_in_the_simulator(cache, tmp_path):
    summary = execute(config(f"cache={cache}", "workload.num_problems=3"), tmp_path)
    assert summary["num_requests"] == 3 * 22 and summary["aborted_requests"] == 0


def test_fitted_cost_model_is_used_from_its_yaml_file(tmp_path):
    coeffs = {kind: {"a": 0.5, "b": 0.0, "c": 0.0, "d": 0.0, "e": 0.0}
              for kind in ("prefill", "decode")}
    path = tmp_path / "fit.yaml"
    save_fitted(path, coeffs, {"model": "llama2_7b", "device": "test"})
    cfg = config("cost_model=fitted", f"cost_model.path={path}", "workload.num_problems=1",
                 "workload.depth=1")
    summary = execute(cfg, tmp_path / "run")
    assert summary["makespan_s"] == pytest.approx(0.5 * (summary["prefill_steps"] + summary["decode_steps"]))


def test_requests_too_large_for_the_cache_are_aborted_and_reported(tmp_path):
    summary = execute(config("cache.capacity_tokens=100", "workload.num_problems=1"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert summary["aborted_requests"] == sum(r["aborted"] for r in rows) > 0
    assert all(r["output_tokens"] == 0 for r in rows if r["aborted"])


def test_records_are_in_submission_order_with_consistent_times():
    requests = generate(small_config("chat"), seed=1)
    _, result = serve(requests, RadixCache(10_000), {"name": "lpm"}, a10g_llama2_executor())
    records = records_of(result.reqs)
    assert [r.arrival_s for r in records] == sorted(r.arrival_s for r in records)
    for r in records:
        assert r.arrival_s <= r.first_token_s <= r.finish_s
        assert 0 <= r.cached_tokens < r.prompt_tokens
    assert np.isclose(max(r.finish_s for r in records), result.end_s)


def cascade_executors() -> tuple[SimExecutor, SimExecutor]:
    plain = a10g_llama2_executor()
    return plain, SimExecutor(plain.cost_model, attention="cascade")


def test_cascade_pricing_changes_durations_only():
    """attention=cascade: the same steps of the same requests (the scheduler decides nothing
    differently), one-token steps no longer and most shorter, chunked prefills priced as before."""
    requests = generate(small_config("tree_of_thought") | {"num_problems": 16}, seed=0)
    runs = []
    for executor in cascade_executors():
        _, result = serve(requests, RadixCache(15_745), {"name": "lpm"}, executor,
                          max_in_flight=12, record_steps=True)
        runs.append((result, executor))
    (plain, _), (cascade, executor) = runs
    shape = [(s.kind, s.ids, s.new, s.context) for s in plain.steps]
    assert shape == [(s.kind, s.ids, s.new, s.context) for s in cascade.steps]
    pairs = list(zip(plain.steps, cascade.steps))
    assert all(c.duration_s <= p.duration_s for p, c in pairs)
    # a step computing more than one token for some request is not cascaded (the engine's rule:
    # a prefill of one-token runs, e.g. fully cached prompts, is)
    assert all(c.duration_s == p.duration_s for p, c in pairs if max(p.new) > 1)
    assert sum(c.duration_s < p.duration_s for p, c in pairs) > len(pairs) / 2
    assert max(r.finish_s for r in cascade.reqs) < max(r.finish_s for r in plain.reqs)
    assert 0 < executor.cascade_saved < 1


class SavingRecorder(SimExecutor):
    """Records the KV reads each step's groups save before the threshold (test instrument)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.saved: list[int] = []

    def launch(self, batch):
        from testbed.scheduler.decode_groups import DecodeGroups, saved_reads

        self.saved.append(saved_reads(DecodeGroups()(batch.entries)))
        return super().launch(batch)


def test_cascade_min_saved_prices_steps_saving_less_as_plain_decode():
    """A step whose groups would save fewer KV reads than ``cascade_min_saved`` is priced as
    plain decode, the others as cascade; above every step's saving the run is the plain one."""
    requests = generate(small_config("tree_of_thought") | {"num_problems": 16}, seed=0)
    plain = a10g_llama2_executor()
    always = SavingRecorder(plain.cost_model, attention="cascade")

    def steps(executor):
        _, result = serve(requests, RadixCache(15_745), {"name": "lpm"}, executor,
                          max_in_flight=12, record_steps=True)
        return [s.duration_s for s in result.steps]

    base, cascaded = steps(plain), steps(always)
    savings = [s for s in always.saved if s > 0]
    threshold = int(np.median(savings))
    some = SimExecutor(plain.cost_model, attention="cascade", cascade_min_saved=threshold)
    mixed = steps(some)
    kinds = {"plain": 0, "cascade": 0}
    for b, c, m, saved in zip(base, cascaded, mixed, always.saved):
        if saved >= threshold:
            assert m == c
            kinds["cascade"] += c < b
        else:
            assert m == b
            kinds["plain"] += c < b  # cascade would have been cheaper in the model: not taken
    assert kinds["cascade"] > 0 and kinds["plain"] > 0
    never = SimExecutor(plain.cost_model, attention="cascade", cascade_min_saved=max(savings) + 1)
    assert steps(never) == base and never.cascade_saved == 0


def test_decode_groups_skip_steps_that_are_not_decode():
    from testbed.scheduler.batch import BatchEntry
    from testbed.scheduler.decode_groups import DecodeGroups

    entries = [BatchEntry(None, context=0, new=n, produces_token=True) for n in (1, 5)]
    assert DecodeGroups()(entries) == []


def test_attention_key_in_the_sim_summary(tmp_path):
    """Null and the non-cascade names price alike (the summary then names the key); cascade
    reports the share of the decode steps' cached KV its groups left unread."""
    base = ["workload.num_problems=4"]
    runs = {a: execute(config(*base, f"attention={a}"), tmp_path / a)
            for a in ("null", "torch", "cascade")}
    for s in runs.values():
        s.pop("wall_s"), s.pop("timing")
    assert "attention" not in runs["null"] and runs["torch"].pop("attention") == "torch"
    assert runs["null"] == runs["torch"]
    cascade = runs["cascade"]
    assert cascade["attention"] == "cascade" and 0 < cascade["cascade_saved_kv"] < 1
    assert cascade["makespan_s"] < runs["null"]["makespan_s"]
    assert cascade["decode_steps"] == runs["null"]["decode_steps"]
    with pytest.raises(ValueError, match="attention must be one of"):
        execute(config(*base, "attention=flash"), tmp_path / "bad")
