"""Reuse beyond exact prefixes in the simulator: what the cost models charge for it, and what the
rag and paraphrase workloads gain (computed prefill tokens, TTFT)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from testbed.config.assembly import compose_config
from testbed.cache import RadixCache
from testbed.cache.reuse import KVCopy, ReuseConfig, ReusedSpan
from testbed.execute import execute
from testbed.scheduler.batch import Batch, BatchEntry
from testbed.scheduler.request_state import Req
from testbed.sim.cost_model import FittedCostModel, RooflineCostModel, StepShape, kv_move_bytes
from testbed.sim.executor import SimExecutor, reuse_shape
from testbed.serving.serve import serve
from testbed.sim.specs import hardware_spec, model_spec
from testbed.workloads.beyond_prefix import rag
from testbed.workloads.request import Request
from tests.test_vidur_cost import MODEL, vidur, write_profile


def roofline() -> RooflineCostModel:
    cfg = compose_config(["model=llama3_8b", "hardware=h100"])
    return RooflineCostModel(model_spec(dict(cfg.model)), hardware_spec(dict(cfg.hardware)))


PLAIN = StepShape(new=(300, 40), context=(700, 0))
MOVED = StepShape(new=(300, 40), context=(700, 0), rotated=500, copied=64)


def test_the_roofline_adds_the_kv_moves_at_mbu_of_hbm_and_nothing_without_them():
    rf = roofline()
    kv = rf.model.kv_bytes_per_token_per_gpu
    assert kv_move_bytes(rf.model, MOVED) == kv * (3 * 500 + 2 * 64)
    expected = kv * (3 * 500 + 2 * 64) / (rf.hw.mem_bw * rf.mbu)
    assert rf.step_time(MOVED) - rf.step_time(PLAIN) == pytest.approx(expected, rel=1e-12)
    assert rf.step_time(StepShape(new=(300, 40), context=(700, 0), rotated=0)) == \
        rf.step_time(PLAIN)
    assert rf.floor(MOVED) >= rf.floor(PLAIN)
    assert rf.floor(MOVED) <= rf.step_time(MOVED)


def test_the_fitted_model_adds_its_floor_models_price_of_the_moves():
    rf = roofline()
    coeffs = {kind: {"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 0.0}
              for kind in ("decode", "prefill")}
    fitted = FittedCostModel(coeffs, rf)
    assert fitted.step_time(PLAIN) == 1.0
    assert fitted.step_time(MOVED) == 1.0 + rf.move_time(MOVED)


def test_the_vidur_model_prices_the_moves_at_its_move_bandwidth(tmp_path):
    d = write_profile(tmp_path / "profile")
    plain, moving = vidur(d), vidur(d, move_bw=1e12)
    assert moving.step_time(PLAIN) == plain.step_time(PLAIN)
    extra = kv_move_bytes(MODEL, MOVED) / 1e12
    assert moving.step_time(MOVED) - plain.step_time(MOVED) == pytest.approx(extra, rel=1e-12)
    assert plain.step_time(MOVED) == plain.step_time(PLAIN)  # no bandwidth: not priced


def entry_with(spans, context=4, new=20) -> BatchEntry:
    request = Request("r", np.arange(context + new, dtype=np.int32), np.zeros(1, np.int32))
    e = BatchEntry(Req(request, request.prompt, 0.0, 0), context, new, produces_token=True)
    e.reuse = tuple(spans)
    return e


def test_a_reused_step_is_priced_as_its_computed_tokens_over_the_rest_as_context():
    span = ReusedSpan(dst=6, src_slots=np.arange(10), src_start=0, recompute=3)
    whole = ReusedSpan(dst=0, src_slots=np.arange(5), src_start=0, recompute=0)
    copy = KVCopy(np.arange(7), np.arange(7, 14), -3)
    batch = Batch("prefill", [entry_with([span]), entry_with([whole], context=0, new=5)],
                  kv_copies=[copy])
    step = reuse_shape(batch)
    assert step.new == (13, 1) and step.context == (11, 4)  # a wholly reused entry runs one
    assert (step.rotated, step.copied) == (15, 7)
    rf = roofline()
    assert SimExecutor(rf).execute(batch).duration_s == rf.step_time(step)


class Counting(SimExecutor):
    """Counts the prefill tokens the steps compute."""

    computed = 0

    def launch(self, batch):
        if batch.kind == "prefill":
            self.computed += sum(e.computed for e in batch.entries)
        return super().launch(batch)


@pytest.mark.parametrize("ratio", [0.0, 0.15, 1.0])
def test_the_steps_compute_exactly_prompt_less_cached_less_approximate_tokens(ratio):
    reqs = rag(num_requests=40, corpus_docs=12, docs_per_prompt=3, doc_len=24, question_len=6,
               system_prompt_len=10, output_len=4, seed=2)
    executor = Counting(roofline())
    scheduler, result = serve(reqs, RadixCache(), {"name": "fcfs"}, executor, max_in_flight=3,
                              reuse=ReuseConfig(reuse="blend", recompute_ratio=ratio))
    assert scheduler.preemptions == 0
    prompt = sum(len(r.prompt) for r in reqs)
    cached = sum(r.cached_tokens for r in result.reqs)
    approx = sum(r.approx_hit_tokens for r in result.reqs)
    assert executor.computed == prompt - cached - approx
    assert (approx > 0) == (ratio < 1)
    assert (sum(r.recomputed_tokens for r in result.reqs) > 0) == (ratio > 0)


def run(tmp_path, name, *overrides):
    summary = execute(compose_config(["progress=false", *overrides]), tmp_path / name)
    first = json.loads((tmp_path / name / "requests.jsonl").read_text().splitlines()[0])
    return summary, first


RAG = ["workload=rag", "workload.num_requests=96", "workload.corpus_docs=40",
       "workload.doc_len=128", "cache.capacity_tokens=60000", "model=llama3_8b",
       "hardware=h100"]


def computed(summary) -> int:
    """Prefill tokens computed: prompt less exact and approximate hits."""
    return summary["prompt_tokens"] - summary["cached_tokens"] - summary["approx_hit_tokens"]


def test_blend_on_rag_computes_under_half_the_prefill_of_prefix_caching_and_cuts_ttft(tmp_path):
    prefix, row = run(tmp_path, "prefix", *RAG)
    blend, _ = run(tmp_path, "blend", *RAG, "cache.reuse=blend")
    every, _ = run(tmp_path, "all", *RAG, "cache.reuse=blend", "cache.recompute_ratio=1")
    assert row["approx_hit_tokens"] == 0 and row["recomputed_tokens"] == 0
    assert prefix["approx_hit_tokens"] == prefix["recomputed_tokens"] == 0
    assert blend["recomputed_tokens"] > 0
    assert computed(blend) <= computed(prefix) / 2
    assert blend["ttft_p50_s"] < 0.75 * prefix["ttft_p50_s"]
    # every reused token recomputed: the KV is exact, so is the tree; the copies cost a little
    assert every["approx_hit_tokens"] == 0 and every["recomputed_tokens"] > 0
    assert every["cached_tokens"] == prefix["cached_tokens"]
    assert computed(every) == computed(prefix)
    assert prefix["ttft_p50_s"] < every["ttft_p50_s"] < 1.1 * prefix["ttft_p50_s"]


TIMES = ("makespan_s", "throughput_req_s", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s",
         "ttft_p50_cold_s", "ttft_p99_cold_s", "ttft_p99_warm_s", "tpot_p50_s", "e2e_p50_s",
         "e2e_p99_s", "wall_s", "timing", "busy_s", "config")


def test_blend_at_ratio_zero_with_chunks_at_their_positions_equals_prefix_caching_but_time(
        tmp_path):
    """few_shot prompts are [examples, question]: the examples always open the prompt. Every
    count is prefix caching's; the step times differ only by the priced chunk-store copies."""
    base = ["workload=few_shot", "workload.num_tasks=4", "workload.questions_per_task=10",
            "workload.output_len=8", "cache.capacity_tokens=100000"]
    prefix, _ = run(tmp_path, "prefix", *base)
    blend, _ = run(tmp_path, "blend", *base, "cache.reuse=blend", "cache.recompute_ratio=0")
    assert blend["approx_hit_tokens"] == blend["recomputed_tokens"] == 0
    assert {k: v for k, v in blend.items() if k not in TIMES} == \
        {k: v for k, v in prefix.items() if k not in TIMES}
    assert prefix["busy_s"] < blend["busy_s"] < 1.05 * prefix["busy_s"]


def test_semantic_matching_finds_approximate_hits_on_paraphrases(tmp_path):
    base = ["workload=paraphrase", "workload.num_originals=8", "workload.paraphrases=2",
            "workload.prompt_len=128", "workload.edit_at=0.25", "cache.capacity_tokens=20000",
            "arrival.max_in_flight=2"]  # the originals are cached before their variants come
    exact, _ = run(tmp_path, "exact", *base)
    semantic, _ = run(tmp_path, "semantic", *base, "cache.match=semantic")
    assert exact["approx_hit_tokens"] == 0
    # each of the 16 variants: the exact hit ends at the edit (32); the donor's aligned run after
    # the 4 substituted tokens up to the last token (91 tokens) is reused, ceil(0.15·91) of it
    # recomputed
    assert semantic["approx_hit_tokens"] == 16 * (91 - 14)
    assert semantic["recomputed_tokens"] == 16 * 14
    assert semantic["cached_tokens"] == exact["cached_tokens"]


def test_semantic_matching_of_identical_prompts_gives_exact_matchings_summary(tmp_path):
    """Paraphrases with no edit repeat their originals: semantic matching changes nothing."""
    base = ["workload=paraphrase", "workload.num_originals=8", "workload.paraphrases=2",
            "workload.prompt_len=96", "workload.edits=0", "cache.capacity_tokens=1000",
            "arrival.max_in_flight=2"]  # a small pool: evictions, so recency matters too
    exact, _ = run(tmp_path, "exact", *base)
    semantic, _ = run(tmp_path, "semantic", *base, "cache.match=semantic",
                      "cache.similarity_threshold=0.2")
    assert exact["evicted_tokens"] > 0 and exact["cached_tokens"] == 16 * 95  # all but the last
    skip = ("wall_s", "timing", "config")
    assert {k: v for k, v in semantic.items() if k not in skip} == \
        {k: v for k, v in exact.items() if k not in skip}
