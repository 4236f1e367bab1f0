"""experiments/validation/vllm/caching.py's pure helpers (the vLLM runs themselves need its venv and
minutes of warm-up: `python -m experiments.validation.vllm.caching`, docs/results/vs_vllm.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from experiments.validation.vllm import caching, live
from testbed.config.assembly import compose_config
from testbed.execute import execute

LOG = """\
(EngineCore pid=1) INFO 12-02 08:21:20 [utils.py:347] Using LBHNC KV cache layout.
(EngineCore pid=1) INFO 12-02 08:21:21 [kv_cache_utils.py:2620] Overriding num_gpu_blocks=728 \
with num_gpu_blocks_override=512
"""


def test_the_kv_blocks_come_from_vllms_log():
    assert live.kv_blocks(LOG) == 512
    assert live.kv_blocks(LOG, own=True) == 728  # what vLLM counted before the override
    assert live.kv_blocks("Using LBHNC KV cache layout.") is None


def test_the_testbeds_pool_leaves_out_vllms_null_block():
    served = live.Served("http://127.0.0.1:1", 32, 512, None)
    assert served.capacity_tokens == 511 * 32
    # 1 GiB holds 23,301 fp32 tokens of SmolLM2-135M: 512 blocks of 32 fit, 1,024 need 2
    assert live.kv_gib(512, 32) == 1 and live.kv_gib(1024, 32) == 2


def test_the_server_is_told_the_block_size_and_blocks():
    cmd = live.server_command(Path("py"), Path("/m"), 64, 40, 8000)
    pairs = dict(zip(cmd, cmd[1:]))
    assert (pairs["--block-size"], pairs["--num-gpu-blocks-override"]) == ("64", "40")
    assert "--enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd
    assert pairs["--max-model-len"] == str(39 * 64)  # no more than the pool holds
    assert live.max_model_len(32, 512) == 4096


def rows(*calls):
    return pd.DataFrame([{"id": i, "arrival_s": t, "finish_s": t + 0.3, "prompt_ids": p,
                          "output_ids": o, "failed": False, "error": None,
                          "prompt_tokens": len(p), "cached_tokens": c}
                         for i, t, p, o, c in calls])


def test_the_trace_is_what_ran_in_order_sent_less_each_last_output_token():
    ran = rows(("b", 0.5, [1, 2, 3], [7, 8], 0), ("a", 0.1, [1, 2], [9], 0),
               ("fork", 0.7, [4], [], 0))
    assert caching.token_trace(ran) == [
        {"id": "a", "prompt": [1, 2], "output": []},
        {"id": "b", "prompt": [1, 2, 3], "output": [7]},
        {"id": "fork", "prompt": [4], "output": []}]
    ran.loc[0, ["failed", "error"]] = [True, "HTTP 400"]
    with pytest.raises(live.Fail, match="request b failed"):
        caching.token_trace(ran)


def test_the_last_output_token_decides_whether_a_block_is_cached(tmp_path):
    """A call whose prompt + output fills a block exactly: vLLM never computes the last output
    token's KV, so that block is not hashed and a later call repeating it hits one block less;
    the trace built from what ran (less the last token) replays that."""
    b = 4
    ran = rows(("a", 0.0, [1, 2, 3, 4, 5, 6], [7, 8], 0),
               ("b", 1.0, [1, 2, 3, 4, 5, 6, 7, 8, 9], [5], 4))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in caching.token_trace(ran)))
    served = live.Served("http://127.0.0.1:1", b, 17, None)
    out = tmp_path / "replay"
    execute(compose_config(caching.replay_overrides(trace, served)), out)
    replayed = live.records(out)
    assert replayed.set_index("id")["cached_tokens"].to_dict() == {"a": 0, "b": 4}
    assert caching.same_cached(ran, replayed) == (2, None)
    ran.loc[1, "cached_tokens"] = 8  # what a replay of the whole output would have said
    assert caching.same_cached(ran, replayed) == (1, "b: vLLM 8, replay 4 of 9")


def test_remapped_ids_fit_the_vocabulary_and_keep_equal_ids_equal():
    ids = np.arange(0, 600_000, 7)
    out = caching.remap(ids)
    assert out.min() >= caching.FIRST_ID and out.max() < caching.VOCAB
    assert (caching.remap(ids) == out).all()
    assert len(np.unique(out[:200])) >= 195  # distinct ids stay (almost always) distinct


def test_the_mooncake_case_is_its_first_requests_cut_and_remapped(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    lines = [{"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [0, 1, 2]},
             {"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [0, 3]},
             {"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": [4]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    a, b = caching.mooncake_trace(path, requests=2, prompt=1024, output=16)
    assert (len(a["prompt"]), len(a["output"]), len(b["prompt"]), len(b["output"])) == \
        (1024, 16, 600, 3)
    assert a["prompt"][:512] == b["prompt"][:512] and a["prompt"][512] != b["prompt"][512]
    assert max(a["prompt"] + b["prompt"]) < caching.VOCAB and "arrival_s" not in a


def test_the_as_ran_trace_keeps_the_programs_and_takes_what_ran():
    from testbed.workloads.request import Request
    requests = [Request("a", np.array([1, 2]), np.array([5]), program="p"),
                Request("b", np.array([1, 2, 5, 3]), np.array([6, 6]), program="p", after=["a"],
                        think_time_s=0.5)]
    ran = rows(("b", 1.0, [1, 2, 9, 3], [7, 7], 2), ("a", 0.0, [1, 2], [9], 0))
    assert caching.as_ran_trace(requests, ran) == [
        {"id": "a", "prompt": [1, 2], "output": [9], "arrival_s": 0.0, "think_time_s": 0.0,
         "program": "p"},
        {"id": "b", "prompt": [1, 2, 9, 3], "output": [7, 7], "arrival_s": 0.0,
         "think_time_s": 0.5, "program": "p", "after": ["a"]}]


def test_the_as_ran_trace_sends_the_first_wave_when_the_client_sent_it():
    """Four programs at t = 0 in a closed loop of 3: the three the client sent one by one before
    any call finished arrive at their send times (relative to the first); the fourth, which
    the loop held until a call finished, arrives with the last of them (the simulator's loop
    holds it from there, in the order sent)."""
    from testbed.workloads.request import Request
    requests = [Request(f"q{i}", np.array([1, i]), np.array([5]), program=f"p{i}")
                for i in range(4)]
    ran = rows(("q0", 10.0, [1, 0], [5], 0), ("q1", 10.001, [1, 1], [5], 0),
               ("q2", 10.003, [1, 2], [5], 0), ("q3", 10.4, [1, 3], [5], 0))
    assert [x["arrival_s"] for x in caching.as_ran_trace(requests, ran)] == \
        pytest.approx([0.0, 0.001, 0.003, 0.003])


def test_the_as_ran_trace_takes_the_first_waves_order_from_the_router_that_received_it():
    """The client sent q0, q1, q2 a millisecond apart; the router in front received q2 first
    and q1 last (its own clock): the first wave arrives in the router's order at its times
    relative to the first it received, and the held fourth call with the last of them."""
    from testbed.workloads.request import Request
    requests = [Request(f"q{i}", np.array([1, i]), np.array([5]), program=f"p{i}")
                for i in range(4)]
    ran = rows(("q0", 10.0, [1, 0], [5], 0), ("q1", 10.001, [1, 1], [5], 0),
               ("q2", 10.002, [1, 2], [5], 0), ("q3", 10.4, [1, 3], [5], 0))
    received = {"q2": 500.0, "q0": 500.0015, "q1": 500.004, "q3": 500.41}
    assert [x["arrival_s"] for x in caching.as_ran_trace(requests, ran, received)] == \
        pytest.approx([0.0015, 0.004, 0.0, 0.004])
    with pytest.raises(caching.Fail, match=r"no receipt of 1 first-wave calls \(the first: q1\)"):
        caching.as_ran_trace(requests, ran, {"q0": 1.0, "q2": 1.0})


def test_latency_rounds_are_summarized_as_medians_with_vllms_spread():
    from experiments.validation.vllm.latency import METRICS, summarize_rounds
    runs = pd.DataFrame([{"workload": "w", "loop": 4, "round": r, "held_out": True,
                          "requests": 10, "failed": 0, "step_mape": mape,
                          "ttft_request_err": err,
                          **{f"{m}_vllm": v for m in METRICS},
                          **{f"{m}_sim": s for m in METRICS}}
                         for r, (v, s, mape, err) in enumerate([(1.0, 0.9, 0.1, -0.1),
                                                                 (2.0, 1.8, 0.3, 0.1),
                                                                 (1.6, 1.5, 0.2, 0.0)])])
    (row,) = summarize_rounds(runs).to_dict("records")
    assert row["rounds"] == 3 and row["step_mape"] == pytest.approx(0.2)
    assert row["ttft_request_err"] == pytest.approx(0.0)
    assert row["ttft_p50_s_vllm"] == 1.6 and row["ttft_p50_s_sim"] == 1.5
    assert row["ttft_p50_s_err"] == pytest.approx(1.5 / 1.6 - 1)
    assert row["ttft_p50_s_spread"] == pytest.approx((2.0 - 1.0) / 1.6)
