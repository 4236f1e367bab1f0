"""Quality of approximate requests against exact recomputation (`testbed.engine.quality`), measured
by the engine's executor step by step on a tiny random Llama: the definitions on hand-made
distributions, then blend requests served through `EngineExecutor` in forced and generate mode."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

import testbed.engine.executor as executor_module  # noqa: E402
from testbed.engine.executor import EngineExecutor  # noqa: E402
from testbed.engine.quality import (exact_logits, greedy_continuation,  # noqa: E402
                                    kl_per_position, measure)
from testbed.engine.runner import ModelRunner  # noqa: E402
from tests.blend_helpers import (CopyBatch, ReuseEntry, make_req, moved_docs,  # noqa: E402
                                 rag_prompt, tiny_model)

OUT = 6


@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=3)


def test_kl_is_the_exact_distributions_expectation_of_the_log_ratio():
    e = torch.tensor([[0.5, 0.5], [0.1, 0.9]]).log()
    a = torch.tensor([[0.25, 0.75], [0.1, 0.9]]).log()
    kl = kl_per_position(e, a)
    assert kl[0].item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75), abs=1e-6)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("forced", [True, False])
def test_measure_counts_the_positions_whose_greedy_token_differs_and_averages_kl(model, forced):
    """Approximate log-probs equal to the exact ones except at one position, where another token
    is made most likely: agreement (n−1)/n, KL positive from that position alone."""
    prompt, out = np.arange(10, 22), greedy_continuation(model, np.arange(10, 22), OUT)
    exact = torch.log_softmax(exact_logits(model, [*prompt, *out[:-1]])[len(prompt) - 1:], -1)
    approx = exact.clone()
    approx[2, (out[2] + 1) % 256] = 5.0  # a different argmax at position 2
    approx = torch.log_softmax(approx, -1)
    rec = measure(model, prompt, out, range(OUT), approx, forced)
    assert rec.tokens == OUT
    assert rec.token_agreement == pytest.approx((OUT - 1) / OUT)
    assert rec.kl_mean == pytest.approx(kl_per_position(exact[2:3], approx[2:3]).item() / OUT,
                                        rel=1e-4)
    assert rec.kl_mean > 0


def serve_blend(executor: EngineExecutor, prompt, reuse, output=(0,) * OUT,
                generates=False) -> list[int]:
    """One request, prefill with ``reuse`` then decode steps, run by ``executor``: its output."""
    n = len(prompt)
    req = make_req("r", prompt, np.arange(150, 150 + n + len(output)), output, generates)
    entry = ReuseEntry(req, 0, n, True, reuse=tuple(reuse))
    while req.remaining_new_tokens > 0:
        tok = executor.execute(CopyBatch("prefill" if not req.output else "decode",
                                         [entry])).tokens[0]
        req.output.append(tok)
        entry = ReuseEntry(req, req.fill_len - 1, 1, True)
    return req.output


def blend_executor(model, recompute: int, forced: bool):
    runner = ModelRunner(model, 300)
    prompt, starts = rag_prompt(doc_len=10)
    spans = moved_docs(runner, prompt, starts, recompute)
    return EngineExecutor(runner, forced=forced), prompt, spans


def test_forced_mode_a_moved_chunk_has_kl_and_recomputing_it_all_has_none(model):
    workload_out = tuple(int(t) for t in np.random.default_rng(3).integers(0, 256, OUT))
    results = {}
    for r in (0, 10):
        ex, prompt, spans = blend_executor(model, r, forced=True)
        assert serve_blend(ex, prompt, spans, workload_out) == list(workload_out)
        results[r] = ex.quality.records()["r"]
        assert results[r].tokens == OUT
    assert results[0].kl_mean > 1e-4
    assert results[10].kl_mean == pytest.approx(0.0, abs=1e-6)
    assert results[10].token_agreement == 1.0
    summary = ex.quality.summary()
    assert summary == {"token_agreement_mean": 1.0, "kl_mean": results[10].kl_mean}


@pytest.mark.parametrize("recompute", [0, 3, 10])
def test_generate_mode_agreement_compares_with_the_exact_greedy_continuation(model, recompute):
    ex, prompt, spans = blend_executor(model, recompute, forced=False)
    out = serve_blend(ex, prompt, spans, generates=True)
    exact = greedy_continuation(model, prompt, OUT)
    rec = ex.quality.records()["r"]
    assert rec.token_agreement == pytest.approx(np.mean(np.array(out) == np.array(exact)))
    if recompute == 10:
        assert out == exact and rec.kl_mean == pytest.approx(0.0, abs=1e-6)


def test_requests_without_reuse_are_not_measured(model):
    ex, prompt, _ = blend_executor(model, 0, forced=True)
    serve_blend(ex, prompt, ())
    assert ex.quality.records() == {}
    assert ex.quality.summary() == {"token_agreement_mean": None, "kl_mean": None}


def test_the_exact_reference_is_computed_outside_the_measured_step_time(model, monkeypatch):
    """A clock that the quality measurement moves by an hour: no step's duration includes it."""
    ex, prompt, spans = blend_executor(model, 0, forced=True)
    clock = [0.0]
    monkeypatch.setattr(executor_module.time, "perf_counter", lambda: clock[0])
    measure_step = ex.quality.observe

    def slow_observe(*args):
        clock[0] += 3600.0
        measure_step(*args)

    monkeypatch.setattr(ex.quality, "observe", slow_observe)
    durations = []
    execute = ex.execute
    monkeypatch.setattr(ex, "execute", lambda b: (o := execute(b), durations.append(
        o.duration_s))[0])
    serve_blend(ex, prompt, spans)
    assert len(durations) == OUT and max(durations) == 0.0
    assert clock[0] == OUT * 3600.0 and "r" in ex.quality.records()
