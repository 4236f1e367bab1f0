"""The live routing study's own logic (experiments/studies/routing_live.py and the modules beside
it), without servers: each replica's counts read from its /metrics in vLLM's names (testbed.serve's
and vLLM's alike), the acceptance lines with and without the simulator's twin, and a front's calls
split by the replica that served them for the served fit."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd
import pytest

from experiments.studies import (routing_checks, routing_fronts, routing_live, routing_served_fit,
                                 routing_twin)
from testbed.config.assembly import compose_config
from testbed.errors import BadInput
from testbed.router import ROUTERS
from testbed.api.metrics import ServerMetrics

VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2_135m_instruct"} 1184.0
vllm:prefix_cache_queries_created{engine="0",model_name="smollm2_135m_instruct"} 1.7e+09
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2_135m_instruct"} 768.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="smollm2_135m_instruct"} 1.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="smollm2_135m_instruct"} 5.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="smollm2_135m_instruct"} 0.0
"""


def test_vllm_metrics_give_its_token_counts_and_finished_requests_by_reason():
    assert routing_fronts.metric_counters(VLLM_METRICS) == {
        "prefix_cache_queries": 1184.0, "prefix_cache_hits": 768.0,
        "request_success": {"stop": 1.0, "length": 5.0, "abort": 0.0}}


def test_a_testbed_servers_metrics_read_back_as_its_debug_state_counters():
    m = ServerMetrics("smollm2_135m")
    for prompt, cached, reason in ((40, 0, "length"), (56, 32, "length"), (24, 16, "stop")):
        req = SimpleNamespace(prompt=[0] * prompt, output=[1, 2, 3], cached_tokens=cached,
                              first_token_s=None, finish_s=None, submitted_s=0.0, aborted=False)
        m.request_finished(req, reason)
    read = routing_fronts.metric_counters(m.exposition())
    state = m.counters()
    assert read["prefix_cache_queries"] == state["prefix_cache_queries"] == 120
    assert read["prefix_cache_hits"] == state["prefix_cache_hits"] == 48
    assert read["request_success"] == {"stop": 1, "length": 2, "abort": 0, "error": 0}


def row(front: str, hit: float, rps: float, **sim) -> dict:
    return {"workload": "chat", "front": front, "hit_rate": hit, "requests_per_s": rps, **sim}


def test_checks_compare_with_smg_and_the_simulator_where_there_is_one():
    testbed = pd.DataFrame([
        row("cache_aware", 0.767, 2.85, sim_hit_rate=0.767, sim_requests_per_s=3.117),
        row("kv_events", 0.767, 2.70, sim_hit_rate=0.767, sim_requests_per_s=3.117),
        row("smg_cache_aware", 0.767, 2.90, sim_hit_rate=0.767, sim_requests_per_s=3.117)])
    lines = routing_checks.checks(testbed)
    assert "chat: cache_aware hit 0.767 >= smg's 0.767: True" in lines
    assert "chat: kv_events hit 0.767 >= both: True" in lines
    assert "chat: cache_aware 2.85 req/s >= smg's 2.90: False" in lines
    assert ("chat: smg_cache_aware: simulator's hit rate within 0.03 (0.000): True; "
            "throughput within 10% (7.5%): True") in lines
    vllm = pd.DataFrame([row("round_robin", 0.60, 1.5), row("cache_aware", 0.75, 1.9),
                         row("smg_cache_aware", 0.74, 1.8)])
    assert routing_checks.checks(vllm) == ["chat: cache_aware hit 0.750 >= smg's 0.740: True",
                                         "chat: cache_aware 1.90 req/s >= smg's 1.80: True"]


def test_each_repeat_turns_the_fronts_order_by_one():
    fronts = ["round_robin", "cache_aware", "smg_cache_aware"]
    assert [routing_live.front_order(fronts, r) for r in (1, 2, 3, 4)] == [
        ["round_robin", "cache_aware", "smg_cache_aware"],
        ["cache_aware", "smg_cache_aware", "round_robin"],
        ["smg_cache_aware", "round_robin", "cache_aware"],
        ["round_robin", "cache_aware", "smg_cache_aware"]]


def repeated(*runs: tuple[float, float, float]) -> pd.DataFrame:
    """Three repeats of three fronts: each run's (cache_aware, kv_events, smg) throughput, the
    hit rates 0.75 / 0.77 / 0.75 every time, each twin 1% fast."""
    return pd.DataFrame([
        row(front, hit, rps, repeat=k, sim_hit_rate=hit, sim_requests_per_s=rps * 1.01)
        for k, rates in enumerate(runs, 1)
        for front, hit, rps in zip(("cache_aware", "kv_events", "smg_cache_aware"),
                                   (0.75, 0.77, 0.75), rates)])


def test_with_repeats_smg_is_compared_by_medians_paired_runs_and_the_runs_each_front_led():
    table = repeated((1.30, 1.36, 1.33), (1.35, 1.31, 1.32), (1.34, 1.33, 1.35))
    lines = routing_checks.checks(table)
    assert lines[:4] == [
        "chat: cache_aware hit 0.750 >= smg's 0.750 (median of 3 runs): True; at least theirs "
        "in 3 of 3",
        "chat: kv_events hit 0.770 >= both (median of 3 runs): True; at least theirs in 3 of 3",
        "chat: cache_aware 1.34 req/s beside smg's 1.33 (median of 3 runs); paired -0.2% (95% "
        "CI -6.0%..+5.5%, 3 runs); rules out 2% below smg's: False; at least theirs in 1 of 3",
        "chat: kv_events 1.33 req/s beside smg's 1.33 (median of 3 runs); paired +0.0% (95% CI "
        "-4.9%..+4.9%, 3 runs); rules out 2% below smg's: False; at least theirs in 1 of 3"]
    # every run's twin is checked against that run
    assert ("chat: kv_events (run 2): simulator's hit rate within 0.03 (0.000): True; "
            "throughput within 10% (1.0%): True") in lines
    assert len(lines) == 4 + 9


def test_a_paired_estimate_is_the_mean_ratio_over_repeats_with_students_interval():
    table = repeated((1.30, 1.36, 1.30), (1.32, 1.31, 1.20), (1.21, 1.33, 1.10))
    p = routing_checks.paired(table, "cache_aware")
    ratios = [1.30 / 1.30 - 1, 1.32 / 1.20 - 1, 1.21 / 1.10 - 1]
    mean = sum(ratios) / 3
    sd = (sum((r - mean) ** 2 for r in ratios) / 2) ** 0.5
    half = 4.302652729911275 * sd / 3 ** 0.5  # t(0.975, 2 degrees of freedom)
    assert (p.runs, p.led) == (3, 3)
    assert (p.mean, p.low, p.high) == pytest.approx((mean, mean - half, mean + half))
    # the interval reaches below zero: no deficit ruled out at 2%, one of 80% is
    assert p.low < 0 and not p.not_below(0.02) and p.not_below(0.80)


def test_a_paired_estimate_counts_only_repeats_that_ran_both_fronts():
    table = repeated((1.30, 1.36, 1.30), (1.32, 1.31, 1.20), (1.21, 1.33, 1.10))
    table = table[~((table.front == "smg_cache_aware") & (table.repeat == 3))]
    p = routing_checks.paired(table, "cache_aware")
    assert p.runs == 2 and p.mean == pytest.approx((0.0 + 0.1) / 2)
    one = routing_checks.paired(table[table.repeat == 1], "cache_aware")
    assert one.runs == 1 and not one.not_below(0.5)  # one run gives no interval
    assert "no interval from one run" in one.says()
    assert routing_checks.paired(table, "least_load") is None


def test_the_machines_drift_is_taken_out_by_the_engines_own_step_seconds():
    """smg's runs met a machine 10% slower: the same work took its engines 10% more CPU-clocked
    seconds and it served 10% fewer requests a second; beside the engines' speed the fronts are
    equal."""
    table = repeated((1.10, 1.10, 1.00), (1.21, 1.21, 1.10))
    table["engine_busy_s"] = [70.0, 70.0, 77.0, 70.0, 70.0, 77.0]
    raw = routing_checks.paired(table, "cache_aware")
    assert raw.mean == pytest.approx(0.10) and raw.low == pytest.approx(0.10)
    even = routing_checks.paired(table, "cache_aware", speed="engine_busy_s")
    assert (even.mean, even.low, even.high) == pytest.approx((0.0, 0.0, 0.0))
    lines = routing_checks.checks(table)
    assert ("chat: cache_aware beside smg's with the engines' speed taken out (req/s × their "
            "CPU-clocked step seconds, the repeats in which both reached the same hit rate): "
            "paired +0.0% (95% CI +0.0%..+0.0%, 2 runs)") in lines
    # a repeat in which smg's engines did other work (another hit rate) is left out
    table.loc[5, "hit_rate"] = 0.70
    one = routing_checks.paired(table, "cache_aware", speed="engine_busy_s")
    assert one.runs == 1 and routing_checks.paired(table, "cache_aware").runs == 2
    # behind vLLM no steps are read: no such line
    assert routing_checks.paired(table.drop(columns="engine_busy_s"), "cache_aware",
                                 speed="engine_busy_s") is None


def test_studies_pool_with_each_ones_repeats_numbered_after_the_last(tmp_path):
    a = repeated((1.30, 1.36, 1.30), (1.32, 1.31, 1.20))
    b = pd.DataFrame([row("cache_aware", 0.75, 1.4), row("smg_cache_aware", 0.75, 1.3)])
    a.to_csv(tmp_path / "routing_live.csv", index=False)
    b.to_csv(tmp_path / "single.csv", index=False)
    pooled = routing_checks.read_studies([tmp_path, tmp_path / "single.csv"])
    assert sorted(pooled.repeat.unique()) == [1, 2, 3]
    assert pooled[pooled.repeat == 3].front.tolist() == ["cache_aware", "smg_cache_aware"]
    with pytest.raises(BadInput, match="--pooled: no study table at"):
        routing_checks.read_studies([tmp_path / "nowhere"])


def test_pooled_studies_are_checked_without_starting_a_replica(tmp_path, capsys):
    repeated((1.30, 1.36, 1.30), (1.32, 1.31, 1.20), (1.21, 1.33, 1.10)).to_csv(
        tmp_path / "routing_live.csv", index=False)
    assert routing_live.main(["--pooled", str(tmp_path), "--margin", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "rules out 50% below smg's: True; at least theirs in 3 of 3" in out
    # a study kept without its twins' columns adds pairs, and no twin line for its runs
    live = repeated((1.30, 1.36, 1.30), (1.32, 1.31, 1.20))
    live.drop(columns=[c for c in live.columns if c.startswith("sim_")]).to_csv(
        tmp_path / "live.csv", index=False)
    assert routing_live.main(["--pooled", str(tmp_path), str(tmp_path / "live.csv")]) == 0
    out = capsys.readouterr().out
    assert "at least theirs in 5 of 5" in out and "(run 3): simulator's" in out
    assert "(run 4): simulator's" not in out and "nan" not in out


def test_the_summary_gives_each_fronts_median_least_and_most_over_its_runs():
    table = repeated((1.30, 1.36, 1.33), (1.35, 1.31, 1.32), (1.34, 1.33, 1.35))
    s = routing_checks.summary(table).set_index("front")
    assert list(s.index) == ["cache_aware", "kv_events", "smg_cache_aware"]
    assert s.loc["cache_aware", ["runs", "requests_per_s", "requests_per_s_min",
                                 "requests_per_s_max"]].tolist() == [3, 1.34, 1.30, 1.35]
    assert s.loc["kv_events", "hit_rate"] == 0.77
    assert s.loc["smg_cache_aware", "sim_requests_per_s_error_max"] == pytest.approx(0.01)


@pytest.mark.parametrize("argv, says", [
    (["--replica-kind", "vllm", "--fronts", "cache_aware", "kv_events"],
     "kv_events needs the cache events of testbed.serve replicas"),
    (["--fitted", "/nonexistent/cost_model.yaml"], "--fitted: no file"),
    (["--twin-runs", "0"], "--twin-runs must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--margin", "1.5"], "--margin must be in [0, 1)"),
    (["--pooled", "/nonexistent/study"], "--pooled: no study table at /nonexistent/study"),
    (["--served-fit", "smg_cache_aware"], "--served-fit: smg_cache_aware: each must be a "
                                          "testbed.route front the study runs"),
    (["--served-fit", "round_robin", "--fronts", "cache_aware"], "--served-fit: round_robin:"),
    (["--served-fit", "round_robin", "--fitted", "x.yaml"], "give it without --fitted"),
])
def test_bad_options_are_refused_before_any_replica_starts(argv, says, capsys):
    with pytest.raises(SystemExit) as stop:
        routing_live.entry(routing_live.main, argv)
    assert stop.value.code == 2
    assert says in capsys.readouterr().err


def test_the_twins_first_wave_is_when_the_router_first_routed_each_call():
    """A retried call is routed twice: its first decision is when the router received it; a
    call without an X-Request-Id is left out."""
    routing = [["b", 1, 0.5], ["a", 0, 0.7], [None, 1, 0.8], ["b", 0, 2.0]]
    assert routing_twin.received(routing) == {"b": 0.5, "a": 0.7}


def test_the_twins_decisions_are_compared_call_by_call_with_the_last_live_one():
    routing = [["b", 1, 0.5], ["a", 0, 0.7], ["b", 0, 2.0], ["c", 1, 2.1]]
    assert routing_twin.same_replica(routing, {"a": 0, "b": 0, "c": 0}) == pytest.approx(2 / 3)
    # the same split under the other names of two identical replicas: the same routing
    assert routing_twin.same_replica(routing, {"a": 1, "b": 1, "c": 0}) == 1.0
    assert routing_twin.same_replica(routing, {"a": 2, "b": 2, "c": 0}) == 1.0
    assert routing_twin.same_replica(None, {"a": 0}) is None


def test_a_jittered_twin_moves_only_the_first_waves_arrivals_within_the_bound():
    lines = [{"id": "a", "arrival_s": 0.0}, {"id": "b", "arrival_s": 0.001},
             {"id": "c", "arrival_s": 0.004}, {"id": "d", "arrival_s": 0.004}]
    moved = routing_twin.jittered(lines, ["a", "b", "c"], 3.0, seed=1)
    assert moved == routing_twin.jittered(lines, ["a", "b", "c"], 3.0, seed=1)  # a seed, a run
    assert moved != routing_twin.jittered(lines, ["a", "b", "c"], 3.0, seed=2)
    assert moved[3] == lines[3]  # held by the loop, not sent at will: as it ran
    for before, after in zip(lines[:3], moved[:3]):
        assert after["arrival_s"] >= 0.0 and abs(after["arrival_s"] - before["arrival_s"]) <= 0.003
        assert after["arrival_s"] != before["arrival_s"] or before["arrival_s"] == 0.0
    assert routing_twin.jittered(lines, ["a", "b", "c"], 0.0, seed=1) == lines


def test_the_jittered_twins_range_is_checked_beside_the_exact_run():
    row = {"workload": "chat", "front": "least_load", "hit_rate": 0.716, "requests_per_s": 2.4,
           "sim_hit_rate": 0.654, "sim_requests_per_s": 2.3, "sim_hit_rate_min": 0.63,
           "sim_hit_rate_max": 0.70}
    lines = routing_checks.checks(pd.DataFrame([row]))
    assert lines[-1] == ("chat: least_load: the jittered twins' hit rates 0.630..0.700; the live "
                         "0.716 within 0.03 of that range: True")


def test_the_served_fit_reads_each_replicas_calls_where_the_router_last_sent_them(tmp_path):
    """A retried call ("b") counts for the replica that served it; a replica's folder holds its
    calls' records as the client wrote them, in the client's order."""
    run = tmp_path / "chat" / "round_robin"
    (run / "client").mkdir(parents=True)
    records = [{"id": i, "arrival_s": t} for i, t in (("a", 0.0), ("b", 0.1), ("c", 0.2))]
    (run / "client" / "requests.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records))
    (run / routing_twin.ROUTING).write_text(json.dumps(
        [["a", 0, 0.0], ["b", 0, 0.1], [None, 1, 0.15], ["c", 1, 0.2], ["b", 1, 0.3]]))
    dirs = routing_served_fit.split_by_replica(run, tmp_path / "fit")
    assert [d.name for d in dirs] == ["r0", "r1"]
    read = [[json.loads(x)["id"] for x in (d / "requests.jsonl").read_text().splitlines()]
            for d in dirs]
    assert read == [["a"], ["b", "c"]]
    (run / routing_twin.ROUTING).unlink()
    with pytest.raises(BadInput, match="only a testbed.route front logs"):
        routing_served_fit.split_by_replica(run, tmp_path / "fit2")


def test_the_served_fit_learns_from_every_run_of_a_front_each_in_a_folder_of_its_own(
        tmp_path, monkeypatch):
    """One front's runs in two workloads and two repeats: four runs, eight replica folders, each
    holding its own run's calls (none written over by another run's)."""
    runs = [tmp_path / w / "round_robin" / f"run_{k}" for w in ("chat", "mooncake")
            for k in (1, 2)]
    for run in runs:  # two calls a run, named after it: "<run> a" on replica 0, "<run> b" on 1
        (run / "client").mkdir(parents=True)
        (run / "client" / "requests.jsonl").write_text("".join(
            json.dumps({"id": f"{run} {c}", "arrival_s": 0.0}) + "\n" for c in "ab"))
        (run / routing_twin.ROUTING).write_text(json.dumps([[f"{run} a", 0, 0.0],
                                                            [f"{run} b", 1, 0.1]]))
    called = []
    monkeypatch.setattr(routing_served_fit.subprocess, "run",
                        lambda argv, **_: called.append(argv))
    routing_served_fit.fit_served(runs, tmp_path / "fit", "tiny", tmp_path)
    (given,) = [a for a in called[0] if a.startswith("calibrate.server_runs=")]
    dirs = given.removeprefix("calibrate.server_runs=[").removesuffix("]").split(",")
    assert len(dirs) == len(set(dirs)) == 8
    for run in runs:
        for k, c in enumerate("ab"):
            mine = tmp_path / "fit" / "replicas" / run.relative_to(tmp_path) / f"r{k}"
            assert str(mine) in dirs
            assert json.loads((mine / "requests.jsonl").read_text())["id"] == f"{run} {c}"


def test_a_front_ends_cpu_seconds_are_its_sessions_and_no_one_elses():
    """The child burns 0.3 s of CPU, says so and waits: its session has used that (less the
    kernel's rounding of user and system time down to clock ticks), and a session with no live
    process none."""
    import os
    import subprocess
    import sys

    burn = ("import sys, time\nwhile time.process_time() < 0.3: pass\n"
            "print('burnt', flush=True)\nsys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "burnt"
        assert routing_fronts.session_cpu_s(child.pid) >= 0.3 - 2 / os.sysconf("SC_CLK_TCK")
    finally:
        child.kill()
        child.wait()
    assert routing_fronts.session_cpu_s(child.pid) == 0.0


def test_the_smallest_tree_front_is_cache_aware_sending_a_miss_to_the_smallest_tree():
    # sgl-router's rule for a prompt matched below the threshold, where smg (and the group's
    # default) take the least loaded replica; everything else at the group's defaults
    policy = ROUTERS.build(compose_config(routing_fronts.router_of("cache_aware_smallest_tree"))
                           .router, seed=0, max_tree_size=None)
    assert type(policy).__name__ == "CacheAware" and policy.fallback == "smallest_tree"
    assert policy.update_on_complete
    assert (policy.cache_threshold, policy.balance_abs_threshold, policy.balance_rel_threshold,
            policy.eviction_interval_s) == (0.3, 64, 1.5, 120)
    assert ROUTERS.build(compose_config(routing_fronts.router_of("cache_aware")).router,
                         seed=0, max_tree_size=None).fallback == "least_load"


@pytest.mark.parametrize("front, plain", [("cache_aware_fewest_sent", "cache_aware"),
                                          ("kv_events_fewest_sent", "kv_events")])
def test_the_fewest_sent_fronts_break_a_tie_of_loads_by_requests_sent(front, plain):
    def built(name: str):
        return ROUTERS.build(compose_config(routing_fronts.router_of(name)).router, seed=0,
                             max_tree_size=None)
    assert type(built(front)) is type(built(plain))
    assert (built(front).tie_break, built(plain).tie_break) == ("fewest_sent", "index")


def test_smgs_twin_and_the_at_routing_front_insert_a_prompt_only_when_they_route_it():
    # smg's cache-aware tree learns nothing from answers: its twin, and our front run at its
    # rule, are `cache_aware` with update_on_complete=false (the group's defaults otherwise)
    for front in ("smg_cache_aware", "cache_aware_at_routing"):
        policy = ROUTERS.build(compose_config(routing_fronts.router_of(front)).router,
                               seed=0, max_tree_size=None)
        assert (policy.update_on_complete, policy.wants_completions) == (False, False)
        assert (policy.cache_threshold, policy.balance_abs_threshold,
                policy.balance_rel_threshold, policy.eviction_interval_s) == (0.3, 64, 1.5, 120)
    assert ROUTERS.build(compose_config(routing_fronts.router_of("cache_aware")).router,
                         seed=0, max_tree_size=None).update_on_complete
