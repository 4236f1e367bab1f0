"""The real-model quality study (experiments/studies/quality.py) at a tiny size: it runs the engine
on SmolLM2-135M-Instruct through the command line's path, writes its CSV and figure, and on the
real model KL is never negative, blend at r = 1 is exact recomputation to float rounding, and
blend at r = 0 saves prefill tokens. Skips, with the command, where the data folder lacks the
model."""

from __future__ import annotations

import pandas as pd
import pytest

from testbed.data import is_here, lookup

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_study_runs_on_the_real_model_and_kl_is_never_negative(tmp_path):
    if not is_here(lookup("smollm2_135m_instruct")):
        pytest.skip("smollm2_135m_instruct is not in the data folder: python -m testbed.data "
                    "fetch smollm2_135m_instruct (make real)")
    from experiments.studies.quality import main

    # 4 prompts of 2 of 4 documents, one at a time: later prompts find earlier documents' chunks
    df = main(["--tasks", "rag_text", "--modes", "prefix", "blend r=0", "blend r=1",
               "--size", "workload.num_requests=4", "workload.corpus_docs=4",
               "workload.docs_per_prompt=2", "workload.zipf=0", "--in-flight", "1",
               "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs")])
    assert (tmp_path / "out" / "quality.png").stat().st_size > 0
    assert list(pd.read_csv(tmp_path / "out" / "quality.csv")["mode"]) == \
        ["prefix", "blend r=0", "blend r=1"]
    rows = df.set_index("mode")
    assert rows["accuracy"].between(0, 1).all()
    assert pd.isna(rows.loc["prefix", "kl_mean"]) and rows.loc["prefix", "measured"] == 0
    approx = rows.loc[["blend r=0", "blend r=1"]]
    assert (approx["measured"] > 0).all() and (approx["kl_min"] >= 0).all()
    assert rows.loc["blend r=1", "kl_max"] < 1e-6
    assert rows.loc["blend r=1", "prefill_computed"] == rows.loc["prefix", "prefill_computed"]
    assert rows.loc["blend r=0", "saved_vs_prefix"] > 0
