"""The served-step benchmark's reading of a server's step log
(`experiments/benchmarks/served_step.py`): only decode steps of the loop's batch that follow one
count (no admission between them), and each figure is the median over those, split as the log
says; a workload's "about B" groups B ± max(1, B/4) requests."""

from __future__ import annotations

import pytest

from experiments.benchmarks.served_step import own_decode_ms, served_decode, steady_decodes


def step(n, kind, requests, turn, cpu, runqueue=0.0, idle=0.0):
    return {"step": n, "kind": kind, "requests": requests, "turn_s": turn, "idle_s": idle,
            "thread_cpu_s": cpu, "process_cpu_s": cpu + 0.002, "runqueue_s": runqueue,
            "handing_s": 0.001}


LOG = [step(0, "prefill", 4, 1.0, 1.0), step(1, "decode", 4, 0.9, 0.1),  # after a prefill
       step(2, "decode", 4, 0.12, 0.1, runqueue=0.015), step(3, "decode", 4, 0.13, 0.1),
       step(4, "decode", 3, 0.5, 0.1), step(5, "decode", 4, 0.5, 0.1),  # the batch changed
       step(6, "decode", 4, 0.14, 0.1, runqueue=0.03, idle=0.01)]


def test_only_decodes_of_the_batch_after_one_count_and_each_figure_is_a_median():
    assert [s["step"] for s in steady_decodes(LOG, 4)] == [2, 3, 6]
    d = served_decode(LOG, 4)
    assert d.steps == 3
    assert d.step_s == pytest.approx(0.13)  # turn + idle: 0.12, 0.13, 0.15
    assert d.engine_cpu_s == pytest.approx(0.1)
    assert d.waited_s == pytest.approx(0.03)  # 0.02, 0.03, 0.04
    assert d.runqueue_s == pytest.approx(0.015)
    assert d.http_cpu_s == pytest.approx(0.002)
    with pytest.raises(RuntimeError, match="no steady decode step at batch 16"):
        served_decode(LOG, 16)


def test_a_workloads_decodes_about_a_batch_are_grouped_as_the_recovered_ones():
    log = [step(0, "decode", 1, 0.05, 0.05), step(1, "decode", 2, 0.07, 0.07),
           step(2, "decode", 3, 0.2, 0.1), step(3, "prefill", 1, 1.0, 1.0)]
    assert own_decode_ms(log, 1) == pytest.approx(60.0)  # batches 0..2
    assert own_decode_ms(log, 4) == pytest.approx(200.0)  # 3..5
    assert own_decode_ms(log, 16) is None
