"""Predicted against measured in the report: runs of one workload on the simulator and on a server
or the engine are put side by side (table with relative errors, TTFT/TPOT CDFs, hit per request
matched by id); runs of other workloads are not."""

import json
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest

from testbed.results.metrics import RequestRecord, summarize
from testbed.report import build

WORKLOAD = {"name": "tree_of_thought", "num_problems": 2, "vocab_size": 256}


def write_run(root: Path, name: str, backend: str, requests: list[dict], workload=WORKLOAD
              ) -> dict:
    """A run dir as `testbed.execute` writes it (its summary computed from ``requests``)."""
    run = root / name
    run.mkdir(parents=True)
    config = {"backend": {"name": backend}, "workload": dict(workload), "cache": {"name": "radix"},
              "scheduler": {"name": "lpm"}, "eviction": {"name": "lru"}, "seed": 0,
              "arrival": {"kind": "offline"}}
    records = [RequestRecord(**r) for r in requests]
    for r in records:
        r.cached_tokens = r.cached_tokens or 0  # summarize counts a missing figure as none
    figures = summarize(records, ideal=0.5, wall_s=1.0)
    summary = {"backend": backend, "workload": workload["name"], "cache": "radix",
               "scheduler": "lpm", "eviction": "lru", **figures, "config": config}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    return figures


def request(rid: str, cached, ttft: float, finish: float, out: int = 3, prompt: int = 10) -> dict:
    return {"id": rid, "program": None, "arrival_s": 1.0, "first_token_s": 1.0 + ttft,
            "finish_s": 1.0 + finish, "prompt_tokens": prompt, "cached_tokens": cached,
            "output_tokens": out, "evicted_tokens": 0, "inserted": True, "aborted": False}


@pytest.fixture()
def folder(tmp_path):
    write_run(tmp_path, "sim", "sim", [request("a", 0, 0.1, 0.3), request("b", 5, 0.2, 0.6)])
    write_run(tmp_path, "engine", "engine", [request("a", 0, 0.2, 0.4), request("b", 4, 0.2, 0.8)])
    write_run(tmp_path, "server", "server", [request("b", 4, 0.3, 0.9), request("a", 0, 0.1, 0.5)])
    other = dict(WORKLOAD, num_problems=3)  # another workload: nothing to compare it with
    write_run(tmp_path, "sim_other", "sim", [request("a", 0, 0.1, 0.3)], workload=other)
    return tmp_path


def test_runs_of_one_workload_are_compared_against_the_server_run(folder):
    result = build(folder, progress=False)
    table = result["side_by_side"]
    assert list(table["run"]) == ["sim", "server", "engine"]  # predicted first, then measured
    assert list(table["reference"]) == [False, True, False]
    sim = table.iloc[0]
    assert sim["hit_rate"] == 0.25 and table.iloc[1]["hit_rate"] == 0.2  # 5 and 4 of 20 tokens
    assert sim["hit_rate_error"] == pytest.approx((0.25 - 0.2) / 0.2)
    assert sim["ttft_p50_s_error"] == pytest.approx((0.15 - 0.2) / 0.2)  # medians of 2 TTFTs
    assert sim["tpot_p50_s_error"] == pytest.approx((0.15 - 0.25) / 0.25)
    assert sim["makespan_s_error"] == pytest.approx((0.6 - 0.9) / 0.9)
    assert set(table["group"]) == {1}  # the other workload has no measured run
    csv = pd.read_csv(folder / "side_by_side.csv")
    assert list(csv["run"]) == ["sim", "server", "engine"]


def test_the_report_shows_the_table_and_links_a_real_figure(folder):
    result = build(folder, progress=False)
    text = result["report"].read_text()
    assert "## Predicted against measured" in text
    assert "| 1 | tree_of_thought | sim | sim | False | 0.250 | +25.0% |" in text
    figure = folder / "figures" / "side_by_side_1.png"
    assert figure in result["figures"] and "figures/side_by_side_1.png" in text
    assert matplotlib.image.imread(figure).shape[2] in (3, 4)


def test_per_request_figures_match_requests_by_id_and_skip_unreported_hits(tmp_path):
    from testbed.report.side_by_side import request_table

    write_run(tmp_path, "server", "server", [request("x", None, 0.5, 1.5, out=5),
                                             request("y", 2, 0.1, 0.1, out=1)])
    t = request_table(tmp_path / "server").set_index("id")
    assert pd.isna(t.loc["x", "hit"]) and t.loc["y", "hit"] == pytest.approx(0.2)
    assert t.loc["x", "tpot_s"] == pytest.approx(0.25)  # (1.5 - 0.5) / (5 - 1)
    assert pd.isna(t.loc["y", "tpot_s"])  # one output token: no time per output token


def test_a_folder_without_a_measured_run_has_no_comparison(tmp_path):
    write_run(tmp_path, "sim", "sim", [request("a", 0, 0.1, 0.3)])
    result = build(tmp_path, progress=False)
    assert result["side_by_side"] is None
    assert "Predicted against measured" not in result["report"].read_text()
    assert not (tmp_path / "side_by_side.csv").exists()


def test_a_server_run_is_tabulated_with_the_servers_model_and_cache(tmp_path):
    from testbed.report.table import load_results

    write_run(tmp_path, "sim", "sim", [request("a", 0, 0.1, 0.3)])
    write_run(tmp_path, "server", "server", [request("a", 0, 0.1, 0.3)])
    summary_path = tmp_path / "server" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["server_model"] = "smollm2_135m"
    summary["config"] |= {"model": {"name": "llama2_7b"}, "hardware": {"name": "a10g"},
                          "server": {"url": "http://127.0.0.1:8000", "model": None}}
    summary_path.write_text(json.dumps(summary))
    table = load_results(tmp_path, progress=False).set_index("run")
    assert table.loc["server", "model"] == "smollm2_135m"  # not the client's config default
    assert table.loc["server", "hardware"] is None
    assert table.loc["server", "cache"] == "server" and table.loc["sim", "cache"] == "radix"
    assert "server.url" not in table.columns  # the address is not part of the study
