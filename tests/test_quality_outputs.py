"""The engine's quality of approximate KV reuse in a run's outputs (docs/design.md §3): per request
``token_agreement``, ``kl_mean``, ``first_divergence`` and ``rouge_l`` in requests.jsonl (null for a
request that reused no KV), their means (``token_agreement_mean``, ``kl_mean``,
``first_divergence_mean``, ``rouge_l_mean``) in summary.json and the printed summary; runs that do
not measure quality (exact prefix caching, the simulator) leave all of them out."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

from testbed.config.assembly import compose_config  # noqa: E402
from testbed.results.metrics import (RequestRecord, add_quality_fields,  # noqa: E402
                                     quality_summary, summarize)
from testbed.results.rundir import format_summary  # noqa: E402
from testbed.execute import execute  # noqa: E402

# A small rag: 8 documents, 3 a prompt in varying order, so later prompts find earlier documents'
# chunks at other positions; 4 programs at a time, so later requests find them cached.
RAG = ["backend=engine", "model=tiny", "workload=rag", "workload.num_requests=12",
       "workload.corpus_docs=8", "workload.docs_per_prompt=3", "workload.doc_len=24",
       "workload.question_len=6", "workload.system_prompt_len=8", "workload.output_len=6",
       "arrival.max_in_flight=4", "progress=false"]


def engine_run(tmp_path, *overrides: str) -> tuple[dict, pd.DataFrame]:
    out = tmp_path / "run"
    execute(compose_config(RAG + list(overrides)), out)
    return (json.loads((out / "summary.json").read_text()),
            pd.read_json(out / "requests.jsonl", lines=True))


def reused(rows: pd.DataFrame) -> pd.Series:
    """Requests whose prefill reused KV: some tokens approximate or recomputed."""
    return (rows["approx_hit_tokens"] + rows["recomputed_tokens"]) > 0


@pytest.mark.parametrize("forced", [True, False])
def test_blend_without_recompute_reports_kl_per_request_and_its_mean(tmp_path, forced):
    summary, rows = engine_run(tmp_path, "cache.reuse=blend", "cache.recompute_ratio=0",
                               f"forced={str(forced).lower()}")
    assert summary["approx_hit_tokens"] > 0 and summary["recomputed_tokens"] == 0
    measured = reused(rows)
    assert 0 < measured.sum() < len(rows)  # the first requests found nothing to reuse
    assert rows.loc[measured, "kl_mean"].notna().all()
    assert rows.loc[~measured, ["kl_mean", "token_agreement", "first_divergence",
                                "rouge_l"]].isna().all().all()
    assert (rows.loc[measured, "kl_mean"] > 0).all()
    agreement = rows.loc[measured, "token_agreement"]
    assert ((agreement >= 0) & (agreement <= 1)).all()
    assert summary["kl_mean"] > 0
    assert summary["kl_mean"] == pytest.approx(rows.loc[measured, "kl_mean"].mean(), rel=1e-12)
    assert summary["token_agreement_mean"] == pytest.approx(agreement.mean(), rel=1e-12)
    assert summary["forced"] is forced


def test_blend_recomputing_everything_has_no_kl_and_full_agreement(tmp_path):
    summary, rows = engine_run(tmp_path, "cache.reuse=blend", "cache.recompute_ratio=1",
                               "forced=false")
    assert summary["approx_hit_tokens"] == 0 and summary["recomputed_tokens"] > 0
    measured = reused(rows)
    assert measured.any()
    kl = rows.loc[measured, "kl_mean"]
    assert (kl >= 0).all() and kl.max() < 1e-6  # float64, a sum of non-negative terms
    assert (rows.loc[measured, "token_agreement"] == 1.0).all()
    assert (rows.loc[measured, "rouge_l"] == 1.0).all()
    assert (rows.loc[measured, "first_divergence"] == rows.loc[measured, "output_tokens"]).all()
    assert 0 <= summary["kl_mean"] < 1e-6 and summary["token_agreement_mean"] == 1.0


def test_prefix_caching_and_the_simulator_leave_the_quality_fields_out(tmp_path):
    summary, rows = engine_run(tmp_path, "cache.reuse=prefix")
    assert summary["cached_tokens"] > 0
    assert "kl_mean" not in summary and "token_agreement_mean" not in summary
    assert "kl_mean" not in rows and "token_agreement" not in rows
    sim = ["backend=sim" if o == "backend=engine" else o for o in RAG]
    execute(compose_config(sim + ["cache.reuse=blend", "cache.recompute_ratio=0",
                                  "workload.vocab_size=256"]), tmp_path / "sim")
    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["approx_hit_tokens"] > 0 and "kl_mean" not in summary
    assert "kl_mean" not in (tmp_path / "sim" / "requests.jsonl").read_text()


def record(rid: str) -> RequestRecord:
    return RequestRecord(id=rid, program=None, arrival_s=0.0, first_token_s=1.0, finish_s=2.0,
                         prompt_tokens=10, cached_tokens=0, output_tokens=3, evicted_tokens=0,
                         inserted=True)


def test_quality_fields_are_written_null_for_exact_requests_once_a_run_measures_them():
    records = [record("a"), record("b"), record("c")]
    assert "kl_mean" not in records[0].to_json() and quality_summary(records) == {}
    add_quality_fields(records, {
        "a": {"token_agreement": 0.5, "kl_mean": 0.25, "first_divergence": 1, "rouge_l": 0.5},
        "c": {"token_agreement": 1.0, "kl_mean": 0.75, "first_divergence": 3, "rouge_l": 1.0}})
    rows = [r.to_json() for r in records]
    assert [(r["token_agreement"], r["kl_mean"], r["first_divergence"], r["rouge_l"])
            for r in rows] == [(0.5, 0.25, 1, 0.5), (None,) * 4, (1.0, 0.75, 3, 1.0)]
    assert "quality_measured" not in rows[0]
    summary = summarize(records, ideal=0.0, wall_s=0.0)
    assert (summary["token_agreement_mean"], summary["kl_mean"], summary["first_divergence_mean"],
            summary["rouge_l_mean"]) == (0.75, 0.5, 2.0, 0.75)
    assert "token_agreement_mean" in format_summary(summary)
    assert "rouge_l_mean" in format_summary(summary)
    add_quality_fields(records, {})  # measured, but no request reused KV
    assert quality_summary(records) == {"token_agreement_mean": None, "kl_mean": None,
                                        "first_divergence_mean": None, "rouge_l_mean": None}
    assert np.isnan(pd.DataFrame([r.to_json() for r in records])["kl_mean"].astype(float)).all()
