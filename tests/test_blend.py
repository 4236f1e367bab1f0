"""Blend prefill (`testbed.engine.blend`) against exact recomputation on a tiny random Llama, fp32:
recomputing every reused token is exact; donor KV of the same prompt at the same positions with
nothing recomputed is exact; a chunk moved from elsewhere is not, unless recomputed; the picked
tokens are those whose KV deviates most; the runner routes entries with ``reuse`` through it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

from testbed.engine import blend  # noqa: E402
from testbed.engine.blend import attend_by_position, blend_prefill  # noqa: E402
from testbed.engine.runner import ModelRunner  # noqa: E402
from tests.blend_helpers import (CopyBatch, ReuseEntry, ReusedSpan, make_req,  # noqa: E402
                                 moved_docs, prefill, rag_prompt, tiny_model)

LAYERS = 3
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return tiny_model(layers=LAYERS)


def exact_setup(model, slots: int = 200):
    """A runner with the RAG prompt prefilled ordinarily into slots 1..n: (runner, prompt, its
    documents' starts, n, the exact logits)."""
    runner = ModelRunner(model, slots)
    prompt, starts = rag_prompt(doc_len=10)
    n = len(prompt)
    exact = prefill(runner, make_req("exact", prompt, np.arange(1, n + 1)))
    return runner, prompt, starts, n, exact


def assert_kv_close(runner, a, b, atol=ATOL):
    for layer in range(LAYERS):
        for buf in (runner.kv_cache.k[layer], runner.kv_cache.v[layer]):
            torch.testing.assert_close(buf[a], buf[b], rtol=0, atol=atol)


@pytest.mark.parametrize("context, block", [(0, 256), (4, 256), (6, 256), (0, 4), (6, 5)])
def test_recomputing_every_reused_token_reproduces_exact_recomputation(model, context, block,
                                                                        monkeypatch):
    """Documents computed alone and moved into the prompt, all their tokens recomputed: logits and
    every layer's KV equal an ordinary prefill (``context``: an exact cached prefix before;
    ``block``: queries per attention call)."""
    monkeypatch.setattr(blend, "EXTEND_QUERY_BLOCK", block)
    runner, prompt, starts, n, exact = exact_setup(model)
    spans = moved_docs(runner, prompt, starts, recompute=10)
    req = make_req("r", prompt, np.arange(150, 150 + n))
    if context:  # its first chunk, exact
        prefill(runner, req, 0, context)
    logits = prefill(runner, req, context, reuse=spans)
    torch.testing.assert_close(logits, exact, rtol=0, atol=ATOL)
    assert_kv_close(runner, np.arange(150, 150 + n), np.arange(1, n + 1))


def test_donor_kv_of_the_same_prompt_at_the_same_positions_without_recompute_is_exact(model):
    runner, prompt, starts, n, exact = exact_setup(model)  # the donor: slots 1..n
    spans = [ReusedSpan(dst=s, src_slots=np.arange(1 + s, 11 + s), src_start=s, recompute=0)
             for s in starts]
    logits = prefill(runner, make_req("r", prompt, np.arange(100, 100 + n)), reuse=spans)
    torch.testing.assert_close(logits, exact, rtol=0, atol=ATOL)
    assert_kv_close(runner, np.arange(100, 100 + n), np.arange(1, n + 1))


def test_a_moved_chunk_without_recompute_differs_from_exact_in_layers_past_the_first(model):
    runner, prompt, starts, n, exact = exact_setup(model)
    spans = moved_docs(runner, prompt, starts, recompute=0)
    logits = prefill(runner, make_req("r", prompt, np.arange(150, 150 + n)), reuse=spans)
    assert (logits - exact).abs().max() > 1e-3
    kv = runner.kv_cache
    doc = np.arange(150 + starts[1], 160 + starts[1])
    torch.testing.assert_close(kv.k[0][doc], kv.k[0][1 + starts[1]:11 + starts[1]],
                               rtol=0, atol=ATOL)  # layer 0: recomputed for every token
    assert (kv.k[1][doc] - kv.k[1][1 + starts[1]:11 + starts[1]]).abs().max() > 1e-3


@pytest.mark.parametrize("bad, picks", [((3,), 1), ((3, 7), 2), ((1, 5, 8), 3), ((2, 9), 1)])
def test_the_tokens_whose_kv_deviates_most_are_picked_and_their_recompute_is_exact(model, bad,
                                                                                    picks):
    """Donor KV exact except tokens ``bad`` of the document, corrupted in layers >= 1 by growing
    amounts: the ``picks`` most corrupted are picked, and when they are all the corrupted ones the
    result is exact again (unpicked ones keep their corrupted KV)."""
    runner, prompt, starts, n, exact = exact_setup(model)
    s = starts[1]
    donor = np.arange(100, 110)
    kv = runner.kv_cache
    gen = torch.Generator().manual_seed(1)
    for layer in range(LAYERS):
        kv.k[layer][100:110] = kv.k[layer][1 + s:11 + s].clone()
        kv.v[layer][100:110] = kv.v[layer][1 + s:11 + s].clone()
        for rank, j in enumerate(bad):  # later entries of `bad` corrupted more
            if layer >= 1:
                noise = torch.randn(kv.k[layer][0].shape, generator=gen)
                kv.k[layer][donor[j]] += (rank + 1) * noise
                kv.v[layer][donor[j]] += (rank + 1) * noise
    span = ReusedSpan(dst=s, src_slots=donor, src_start=s, recompute=picks)
    req_slots = np.arange(150, 150 + n)
    res = blend_prefill(model, kv, prompt, req_slots, 0, [span])
    assert res.picked.tolist() == sorted(s + j for j in bad[len(bad) - picks:])
    if picks == len(bad):
        torch.testing.assert_close(res.logits, exact, rtol=0, atol=ATOL)
    else:
        assert (res.logits - exact).abs().max() > 1e-4


def test_only_fresh_picked_and_last_tokens_are_carried_past_the_first_layer(model):
    runner = ModelRunner(model, 200)
    prompt, starts = rag_prompt(doc_len=10, q_len=5)
    n = len(prompt)
    spans = moved_docs(runner, prompt, starts, recompute=0)
    spans[0] = ReusedSpan(dst=starts[0], src_slots=spans[0].src_slots, src_start=0, recompute=2)
    res = blend_prefill(model, runner.kv_cache, prompt, np.arange(150, 150 + n), 0, spans)
    fresh = [*range(starts[0]), *range(starts[1] + 10, n)]
    assert len(res.picked) == 2 and all(starts[0] <= p < starts[0] + 10 for p in res.picked)
    assert res.computed.tolist() == sorted(fresh + res.picked.tolist())


def test_a_batch_mixing_plain_and_blend_entries_returns_each_entrys_logits_in_order(model):
    runner, prompt, starts, n, exact = exact_setup(model, slots=300)
    other = np.arange(60, 75)
    alone = prefill(runner, make_req("o", other, np.arange(30, 45)))
    spans = tuple(moved_docs(runner, prompt, starts, recompute=10))
    entries = [ReuseEntry(make_req("p1", other, np.arange(200, 215)), 0, 15, True),
               ReuseEntry(make_req("b", prompt, np.arange(150, 150 + n)), 0, n, True,
                          reuse=spans),
               ReuseEntry(make_req("p2", prompt, np.arange(250, 250 + n)), 0, n, True)]
    logits = runner.run(CopyBatch("prefill", entries))
    torch.testing.assert_close(logits[0], alone, rtol=0, atol=ATOL)
    torch.testing.assert_close(logits[1], exact, rtol=0, atol=ATOL)
    torch.testing.assert_close(logits[2], exact, rtol=0, atol=ATOL)


@pytest.mark.parametrize("spans, match", [
    ([(6, 10, 0), (10, 10, 0)], "disjoint"),
    ([(30, 10, 0)], "inside"),
    ([(6, 10, 11)], "recompute must be in 0..10"),
    ([(2, 10, 0)], "inside"),  # before the entry's context (4)
    ([(6, 10, 0)], "donor slots must not"),  # donor slots 11..20: among those it writes
])
def test_bad_spans_are_refused_with_what_is_allowed(model, spans, match):
    runner = ModelRunner(model, 100)
    prompt, _ = rag_prompt(doc_len=10)
    donor = 60 if match != "donor slots must not" else 11
    reuse = [ReusedSpan(dst=d, src_slots=np.arange(donor, donor + ln), src_start=0, recompute=r)
             for d, ln, r in spans]
    with pytest.raises(ValueError, match=match):
        blend_prefill(model, runner.kv_cache, prompt, np.arange(1, len(prompt) + 1), 4, reuse)


@pytest.mark.parametrize("block", [1, 3, 1000])
def test_position_masked_attention_in_query_blocks_equals_a_naive_softmax(block, monkeypatch):
    """Queries at scattered positions over 20 keys, GQA 4:2, against softmax(q·k) over keys at
    positions <= the query's, computed one query at a time."""
    monkeypatch.setattr(blend, "EXTEND_QUERY_BLOCK", block)
    gen = torch.Generator().manual_seed(0)
    k_buf, v_buf = torch.randn(30, 2, 16, generator=gen), torch.randn(30, 2, 16, generator=gen)
    slots = torch.arange(5, 25)
    pos = np.array([0, 3, 4, 11, 12, 19])
    q = torch.randn(len(pos), 4, 16, generator=gen)
    got = attend_by_position(q, pos, k_buf, v_buf, slots, 0.25)
    for i, p in enumerate(pos):
        for h in range(4):
            keys, vals = k_buf[slots[:p + 1], h // 2], v_buf[slots[:p + 1], h // 2]
            want = torch.softmax(keys @ q[i, h] * 0.25, 0) @ vals
            torch.testing.assert_close(got[i, h], want, rtol=1e-5, atol=1e-5)
