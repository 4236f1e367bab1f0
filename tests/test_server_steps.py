"""Recovering a live server's steps from the token times it streamed
(`testbed.calibration.server_steps`), and `testbed.calibrate` fitting a cost model to them
(``calibrate.server_runs``)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from testbed.errors import BadInput
from testbed.calibration.server_steps import (ServerStep, add_rereads, read_run, recover_steps,
                                              usable)
from testbed.sim.fit import fit_coefficients


def record(rid, arrival, prompt, cached, first, itl):
    return {"id": rid, "arrival_s": arrival, "prompt_tokens": prompt, "cached_tokens": cached,
            "first_token_s": first, "itl_s": itl, "failed": False}


def shapes(steps):
    """Each step's (ids, new, context), its requests in id order."""
    return [tuple(map(list, zip(*sorted(zip(s.ids, s.new, s.context))))) for s in steps]


def test_one_request_recovers_its_prefill_then_one_decode_per_token():
    rows = pd.DataFrame([record("a", 0.0, 10, 4, 0.5, [0.1, 0.1])])
    steps = recover_steps(rows, token_budget=None)
    assert shapes(steps) == [(["a"], [6], [4]), (["a"], [1], [10]), (["a"], [1], [11])]
    assert [round(s.duration_s, 9) for s in steps] == [0.5, 0.1, 0.1]


def test_a_prefill_arriving_mid_decode_joins_the_next_step_and_its_jitter_is_one_step():
    rows = pd.DataFrame([record("a", 0.0, 10, 4, 0.5, [0.1, 0.1]),
                         record("b", 0.55, 20, 0, 0.702, [0.1])])
    steps = recover_steps(rows, token_budget=None)
    assert shapes(steps) == [(["a"], [6], [4]), (["a"], [1], [10]),
                             (["a", "b"], [1, 20], [11, 0]), (["b"], [1], [20])]
    assert [round(s.duration_s, 9) for s in steps] == [0.5, 0.1, 0.1, 0.102]


def test_a_step_after_idle_starts_when_its_first_request_was_sent():
    rows = pd.DataFrame([record("a", 0.0, 10, 0, 0.5, []), record("b", 2.0, 8, 0, 2.3, [])])
    steps = recover_steps(rows, token_budget=None)
    assert [round(s.duration_s, 9) for s in steps] == [0.5, 0.3]


def test_a_prefill_past_the_budget_is_chunked_back_into_the_steps_before():
    # budget 16: b came after the first step began; at 0.6 it takes the 15 a's decode leaves,
    # at 0.7 the other 15
    rows = pd.DataFrame([record("a", 0.0, 10, 0, 0.5, [0.1, 0.1]),
                         record("b", 0.05, 30, 0, 0.7, [])])
    steps = recover_steps(rows, token_budget=16)
    assert shapes(steps) == [(["a"], [10], [0]), (["a", "b"], [1, 15], [10, 0]),
                             (["a", "b"], [1, 15], [11, 15])]
    assert not any(s.merged for s in steps)
    assert steps[2].busy_before


def test_tokens_of_one_request_never_share_a_step_however_close():
    rows = pd.DataFrame([record("a", 0.0, 4, 0, 0.010, [0.004, 0.004])])
    assert len(recover_steps(rows, token_budget=None)) == 3


def test_a_prefill_no_earlier_step_can_hold_marks_its_step_merged_and_unusable():
    # b arrives after the step ending at 0.6 began, so its 40 tokens cannot go back past 0.7
    rows = pd.DataFrame([record("a", 0.0, 10, 0, 0.5, [0.1, 0.1]),
                         record("b", 0.55, 40, 0, 0.7, [])])
    steps = recover_steps(rows, token_budget=16)
    assert [s.merged for s in steps] == [False, False, True]
    assert steps[2].new == [1, 40]
    assert len(usable(steps)) == 2


def serve_fcfs(requests, budget, cost):
    """A brute-force server: each step, running requests first (a decode token each, or the
    rest of their prompt within the budget), then waiting ones in arrival order; a step starts
    when the one before ends, or at the first arrival when idle. Returns records and steps."""
    t, waiting, running, steps = 0.0, sorted(requests, key=lambda r: r["arrival"]), [], []
    state = {r["id"]: {"left": r["prompt"] - r["cached"], "out": 0, "times": []} for r in requests}
    while waiting or running:
        if not running and waiting[0]["arrival"] > t:
            t = waiting[0]["arrival"]
        while waiting and waiting[0]["arrival"] <= t:
            running.append(waiting.pop(0))
        left, entries = budget, []
        for r in list(running):
            s = state[r["id"]]
            take = 1 if s["left"] == 0 else min(s["left"], left)
            if take == 0:
                continue
            context = r["prompt"] + s["out"] - 1 if s["left"] == 0 else r["prompt"] - s["left"]
            entries.append((r, take, context))
            left -= take
        t += cost(entries)
        steps.append([(r["id"], n, c) for r, n, c in entries])
        for r, take, _ in entries:
            s = state[r["id"]]
            if s["left"]:
                s["left"] -= take
                if s["left"]:
                    continue
            s["times"].append(t)
            s["out"] += 1
            if s["out"] == r["output"]:
                running.remove(r)
    records = [record(r["id"], r["arrival"], r["prompt"], r["cached"], state[r["id"]]["times"][0],
                      np.diff(state[r["id"]]["times"]).tolist()) for r in requests]
    return pd.DataFrame(records), steps


def test_steps_of_a_brute_force_server_are_recovered_exactly_and_its_cost_model_refitted():
    rng = np.random.default_rng(7)
    requests = [{"id": f"r{i}", "arrival": float(rng.uniform(0, 3)), "prompt": int(p),
                 "cached": int(p // 3), "output": int(rng.integers(2, 12))}
                for i, p in enumerate(rng.integers(20, 300, 24))]

    def cost(entries):  # decode-only steps one way, steps with a prefill another
        new = sum(n for _, n, _ in entries)
        if all(n == 1 for _, n, _ in entries):
            return 0.05 + 1e-3 * len(entries) + 2e-6 * sum(c for *_, c in entries)
        return 0.08 + 4e-4 * new

    rows, truth = serve_fcfs(requests, budget=128, cost=cost)
    steps = recover_steps(rows, token_budget=128)
    assert [sorted(zip(s.ids, s.new, s.context)) for s in steps] == [sorted(s) for s in truth]
    assert not any(s.merged for s in steps)
    coeffs = fit_coefficients([(s.shape, s.duration_s) for s in usable(steps)])
    assert coeffs["decode"]["a"] == pytest.approx(0.05, rel=1e-6)
    assert coeffs["decode"]["d"] + coeffs["decode"]["b"] == pytest.approx(1e-3, rel=1e-6)
    assert coeffs["prefill"]["a"] == pytest.approx(0.08, rel=1e-6)
    assert coeffs["prefill"]["b"] + coeffs["prefill"]["d"] * 0 == pytest.approx(4e-4, rel=1e-4)


def test_calibrate_fits_a_server_run_and_refuses_one_without_cached_tokens(tmp_path):
    from testbed.config.assembly import compose_config
    from testbed.calibrate import calibrate

    requests = [{"id": f"r{i}", "arrival": 0.2 * i, "prompt": 40 + 10 * i, "cached": 8,
                 "output": 6} for i in range(10)]
    rows, _ = serve_fcfs(requests, 64, lambda e: 0.05 + 1e-4 * sum(n for _, n, _ in e))
    run = tmp_path / "run"
    run.mkdir()
    rows.to_json(run / "requests.jsonl", orient="records", lines=True)
    cfg = compose_config(["model=tiny", "scheduler=vllm", "cache=block_hash",
                          f"calibrate.server_runs=[{run}]", "calibrate.token_budget=64"],
                         name="calibrate")
    result = calibrate(cfg, tmp_path / "fit")
    assert result["meta"]["steps_recovered"] == len(recover_steps(rows, 64))
    assert result["meta"]["steps_merged"] == 0
    assert (tmp_path / "fit" / "cost_model.yaml").exists()
    assert json.loads((tmp_path / "fit" / "calibration.json").read_text())["mape"]["decode"] < 1e-6
    rows.assign(cached_tokens=None).to_json(run / "requests.jsonl", orient="records", lines=True)
    with pytest.raises(BadInput, match="did not report cached tokens"):
        read_run(run)


def test_a_burst_of_several_steps_tokens_is_split_into_steps_sharing_its_time():
    # at 0.8 the server delivers two steps at once: a's and b's tokens 2 and 3, c's first token
    # (its prefill ran in the second of those steps); the two steps after 0.6 share 0.2 s
    rows = pd.DataFrame([record("a", 0.0, 10, 0, 0.5, [0.1, 0.2, 0.0005, 0.1]),
                         record("b", 0.0, 10, 0, 0.5001, [0.1, 0.2, 0.0006, 0.1]),
                         record("c", 0.65, 7, 0, 0.8003, [0.1])])
    steps = recover_steps(rows, token_budget=None)
    assert [round(s.end_s, 9) for s in steps] == [0.5, 0.6, 0.7, 0.8, 0.9003]
    assert shapes(steps) == [(["a", "b"], [10, 10], [0, 0]), (["a", "b"], [1, 1], [10, 10]),
                             (["a", "b"], [1, 1], [11, 11]),
                             (["a", "b", "c"], [1, 1, 7], [12, 12, 0]),
                             (["a", "b", "c"], [1, 1, 1], [13, 13, 7])]


def test_a_prefill_only_call_ends_its_prefill_step_when_its_stream_ends():
    fork = {**record("fork", 0.0, 30, 0, None, None), "finish_s": 0.4}
    rows = pd.DataFrame([fork, record("child", 0.45, 40, 30, 0.6, [0.1])])
    steps = recover_steps(rows, token_budget=None)
    assert shapes(steps) == [(["fork"], [30], [0]), (["child"], [10], [30]),
                             (["child"], [1], [40])]
    assert [round(s.duration_s, 9) for s in steps] == [0.4, 0.15, 0.1]


def test_an_excluded_term_is_held_at_zero_and_a_bad_one_is_refused(tmp_path):
    from testbed.config.assembly import compose_config
    from testbed.calibrate import calibrate

    requests = [{"id": f"r{i}", "arrival": 0.1 * i, "prompt": 30 + 7 * i, "cached": 0,
                 "output": 8} for i in range(12)]
    rows, _ = serve_fcfs(requests, 256, lambda e: 0.04 + 2e-4 * sum(c for *_, c in e))
    run = tmp_path / "run"
    run.mkdir()
    rows.to_json(run / "requests.jsonl", orient="records", lines=True)
    base = ["model=tiny", "scheduler=vllm", "cache=block_hash", f"calibrate.server_runs=[{run}]"]
    fitted = calibrate(compose_config([*base, "calibrate.exclude_terms=[e,f]"], name="calibrate"),
                       tmp_path / "fit")
    assert fitted["coefficients"]["decode"]["e"] == fitted["coefficients"]["decode"]["f"] == 0.0
    assert fitted["meta"]["exclude_terms"] == ["e", "f"]
    with pytest.raises(BadInput, match="calibrate.exclude_terms must be a list"):
        calibrate(compose_config([*base, "calibrate.exclude_terms=[z]"], name="calibrate"),
                  tmp_path / "bad")


def test_a_decode_steps_reread_counts_the_full_prompt_blocks_its_requests_hold_in_common():
    """Three requests decoding together: a and b share their first two 4-token blocks (b's
    third differs, and a's last 2 tokens fill no block), c shares only the first. Read again:
    block 0 by b and c, block 1 by b: 3 blocks of 4. A prefill step and a step of one request
    read nothing again; without prompt ids nothing is counted."""
    prompts = {"a": list(range(10)), "b": list(range(8)) + [50, 51, 52, 53, 54],
               "c": [0, 1, 2, 3, 9, 9, 9, 9, 9]}
    rows = pd.DataFrame([{"id": k, "prompt_ids": v} for k, v in prompts.items()])

    def step(ids, new=1):
        return ServerStep(end_s=1.0, ids=list(ids), new=[new] * len(ids),
                          context=[len(prompts[i]) for i in ids])

    steps = [step("abc"), step("ab", new=3), step("a"), step("ac")]
    add_rereads(steps, rows, block_size=4)
    assert [s.reread for s in steps] == [3 * 4, 0, 0, 4]
    assert steps[0].shape.reread == 12
    plain = [step("abc")]
    add_rereads(plain, rows.drop(columns="prompt_ids"), block_size=4)
    assert plain[0].reread == 0


def test_a_server_fit_prices_each_decode_batch_size_with_enough_steps_on_its_own():
    from testbed.calibrate import SERVER_KNOT_STEPS, server_row_knots
    from testbed.sim.step_shape import StepShape

    samples = ([(StepShape.decode((100,) * 2), 0.05)] * SERVER_KNOT_STEPS
               + [(StepShape.decode((100,) * 3), 0.06)] * (SERVER_KNOT_STEPS - 1)
               + [(StepShape.decode((100,) * 8), 0.09)] * (SERVER_KNOT_STEPS + 5)
               + [(StepShape(new=(64,), context=(0,)), 0.2)] * 50)
    assert server_row_knots({}, samples) == {"decode": [2, 8], "prefill": []}
    assert server_row_knots({"row_table": False}, samples) == {}
    assert server_row_knots({}, samples[SERVER_KNOT_STEPS:2 * SERVER_KNOT_STEPS - 1]) == {}
