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
from testbed.engine.quality import (KL_POSITIONS, exact_logits,  # noqa: E402
                                    first_divergence, greedy_continuation, kl_per_position,
                                    log_probs, measure, rouge_l)
from testbed.engine.runner import ModelRunner  # noqa: E402
from tests.blend_helpers import (CopyBatch, ReuseEntry, make_req, moved_docs,  # noqa: E402
                                 rag_prompt, tiny_model)

OUT = 6


@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=3)


def test_kl_is_the_exact_distributions_expectation_of_the_log_ratio():
    e = torch.tensor([[0.5, 0.5], [0.1, 0.9]], dtype=torch.float64).log()
    a = torch.tensor([[0.25, 0.75], [0.1, 0.9]], dtype=torch.float64).log()
    kl = kl_per_position(e, a)
    assert kl.dtype == torch.float64
    assert kl[0].item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75),
                                         rel=1e-12)
    assert kl[1].item() == 0.0  # identical rows: exactly 0, not a rounding residue


def textbook_kl(e: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return (e.exp() * (e - a)).sum(-1)


@pytest.mark.parametrize("scale", [1e-9, 1e-6, 1e-3, 1.0, 10.0])
def test_kl_is_never_negative_and_equals_the_textbook_formula(scale):
    """Random logits over a SmolLM2-sized vocabulary, the approximate ones perturbed by ``scale``
    (1e-9: the near-identical rows of exact recomputation, where the textbook sum in fp32 went
    negative): KL ≥ 0 in every row and equal to Σ p (log p − log q) in float64 within 1e-12
    (relative, for the large ones)."""
    gen = torch.Generator().manual_seed(int(-math.log10(scale) * 7) + 3)
    logits = torch.randn(64, 49152, generator=gen) * 4
    approx = logits + scale * torch.randn(64, 49152, generator=gen)
    e, a = log_probs(logits), log_probs(approx)
    kl = kl_per_position(e, a)
    assert (kl >= 0).all()
    assert torch.allclose(kl, textbook_kl(e, a), rtol=1e-12, atol=1e-12)
    assert (kl_per_position(e, e) == 0).all()


def test_kl_of_a_token_far_more_likely_under_the_approximation_does_not_overflow():
    e = torch.tensor([[0.0, -800.0, -800.0]], dtype=torch.float64)
    a = log_probs(torch.tensor([[0.0, 0.0, -5.0]], dtype=torch.float64))
    e = torch.log_softmax(e, -1)
    kl = kl_per_position(e, a)
    assert torch.isfinite(kl).all() and kl.item() == pytest.approx(
        textbook_kl(e, a).item(), rel=1e-12)


def test_first_divergence_and_rouge_l_on_token_sequences():
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([7], [8]) == 0
    assert rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert rouge_l([1, 2, 3, 4], [5, 6, 7, 8]) == 0.0
    assert rouge_l([1, 2, 3, 4], [2, 9, 4, 1]) == pytest.approx(2 * 2 / 8)  # LCS 2, 4
    assert rouge_l([1, 2], [1, 3, 2, 4]) == pytest.approx(2 * 2 / 6)  # P 1, R 1/2
    assert rouge_l([], []) == 1.0


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
    assert rec.first_divergence == 2 and rec.rouge_l == pytest.approx((OUT - 1) / OUT)


def test_kl_covers_the_first_kl_positions_and_agreement_every_position(model):
    """A request longer than KL_POSITIONS whose approximate argmax differs only after them: KL 0
    (those positions are exact), agreement and first divergence see the later difference."""
    n = KL_POSITIONS + 4
    prompt = np.arange(10, 22)
    out = greedy_continuation(model, prompt, n)
    exact = exact_logits(model, [*prompt, *out[:-1]])[len(prompt) - 1:]
    tokens = list(out)
    tokens[KL_POSITIONS + 1] = (out[KL_POSITIONS + 1] + 1) % 256
    rec = measure(model, prompt, out, range(n), exact[:KL_POSITIONS], forced=False,
                  approx_tokens=tokens)
    assert rec.tokens == n and rec.kl_mean == 0.0
    assert rec.token_agreement == pytest.approx((n - 1) / n)
    assert rec.first_divergence == KL_POSITIONS + 1


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
    assert summary == {"token_agreement_mean": 1.0, "kl_mean": results[10].kl_mean,
                       "first_divergence_mean": OUT, "rouge_l_mean": 1.0}
    assert results[10].kl_mean >= 0


@pytest.mark.parametrize("recompute", [0, 3, 10])
def test_generate_mode_agreement_compares_with_the_exact_greedy_continuation(model, recompute):
    ex, prompt, spans = blend_executor(model, recompute, forced=False)
    out = serve_blend(ex, prompt, spans, generates=True)
    exact = greedy_continuation(model, prompt, OUT)
    rec = ex.quality.records()["r"]
    assert rec.token_agreement == pytest.approx(np.mean(np.array(out) == np.array(exact)))
    assert rec.first_divergence == first_divergence(out, exact)
    assert rec.rouge_l == rouge_l(out, exact)
    if recompute == 10:
        assert out == exact and rec.kl_mean == pytest.approx(0.0, abs=1e-6)


def test_the_monitor_keeps_logits_of_the_first_kl_positions_only(model, monkeypatch):
    """A request of KL_POSITIONS + 4 output tokens: every greedy token is recorded, logits (vocab
    floats each, on the host) only for the first KL_POSITIONS."""
    import testbed.engine.quality as quality

    seen = {}
    real = quality.measure

    def spy(*args, **kwargs):
        seen["logits"], seen["tokens"] = args[4].shape[0], len(kwargs["approx_tokens"])
        return real(*args, **kwargs)

    monkeypatch.setattr(quality, "measure", spy)
    ex, prompt, spans = blend_executor(model, 0, forced=False)
    n = KL_POSITIONS + 4
    out = serve_blend(ex, prompt, spans, output=(0,) * n, generates=True)
    rec = ex.quality.records()["r"]
    assert seen == {"logits": KL_POSITIONS, "tokens": n} and rec.tokens == n
    assert rec.kl_mean >= 0 and rec.first_divergence == first_divergence(
        out, greedy_continuation(model, prompt, n))


def test_requests_without_reuse_are_not_measured(model):
    ex, prompt, _ = blend_executor(model, 0, forced=True)
    serve_blend(ex, prompt, ())
    assert ex.quality.records() == {}
    assert set(ex.quality.summary().values()) == {None}


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
