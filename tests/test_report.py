"""Sweeps and their reports: `python -m testbed.run -m ...` runs every job, records failures and
skips finished runs; `python -m testbed.report DIR` tabulates, plots and summarises them."""

import json
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
SMALL = ["workload=tree_of_thought", "workload.num_problems=2", "progress=false"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sweep(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    """A multirun with Hydra's basic (in-process, one job at a time) launcher into ``out``."""
    return subprocess.run([sys.executable, "-m", "testbed.run", "-m", "hydra/launcher=basic",
                           *overrides, f"hydra.sweep.dir={out}"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def report(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed.report", str(out), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def same(a, b) -> bool:
    """Exact equality, with a missing figure (None in JSON, NaN in a table) equal to itself."""
    missing = lambda v: v is None or (isinstance(v, float) and np.isnan(v))  # noqa: E731
    return (missing(a) and missing(b)) or a == b


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """A real 2x2 sweep (cache x scheduler) and its report."""
    out = tmp_path_factory.mktemp("sweep")
    proc = sweep(out, "cache=none,radix", "scheduler=fcfs,lpm", *SMALL)
    assert proc.returncode == 0, proc.stderr
    proc = report(out)
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_table_copies_every_summary_figure_exactly(two_by_two):
    out, _ = two_by_two
    for table in (pd.read_parquet(out / "results.parquet"), pd.read_csv(out / "results.csv")):
        assert len(table) == 4 and (table["status"] == "ok").all()
        assert sorted(zip(table["cache"], table["scheduler"])) == \
            [("none", "fcfs"), ("none", "lpm"), ("radix", "fcfs"), ("radix", "lpm")]
        for row in table.to_dict("records"):
            summary = json.loads((out / str(row["run"]) / "summary.json").read_text())
            config = summary.pop("config")
            assert row["workload"] == config["workload"]["name"] == "tree_of_thought"
            assert row["model"] == "llama2_7b" and row["hardware"] == "a10g"
            assert row["cache"] == config["cache"]["name"]
            assert row["scheduler"] == config["scheduler"]["name"]
            for key, value in summary.items():
                if isinstance(value, dict):  # nested figures (timing) stay in summary.json
                    continue
                assert same(row[key], value), (row["run"], key, row[key], value)


def test_throughput_is_normalised_to_the_no_cache_fcfs_run(two_by_two):
    out, _ = two_by_two
    table = pd.read_parquet(out / "results.parquet")
    runs = {(r["cache"], r["scheduler"]): json.loads((out / r["run"] / "summary.json").read_text())
            for r in table.to_dict("records")}
    base = runs["none", "fcfs"]["throughput_req_s"]
    for r in table.to_dict("records"):
        mine = runs[r["cache"], r["scheduler"]]["throughput_req_s"]
        assert r["throughput_vs_nocache"] == mine / base
        assert r["baseline"] == "none/fcfs"
    radix = table[(table["cache"] == "radix") & (table["scheduler"] == "lpm")].iloc[0]
    assert radix["throughput_vs_nocache"] > 1  # sharing the tree's prefixes pays off


def test_figures_are_real_pngs_linked_from_the_report(two_by_two):
    out, proc = two_by_two
    text = (out / "report.md").read_text()
    for name in ("throughput_vs_nocache", "hit_rate", "latency_cdf", "ttft_cold_vs_warm"):
        png = out / "figures" / f"{name}.png"
        data = png.read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC)
        image = matplotlib.image.imread(png)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert f"](figures/{name}.png)" in text
    assert not (out / "figures" / "latency_vs_load.png").exists()  # one arrival rate only
    assert "4 runs (0 failed)" in proc.stdout


def test_table_and_report_show_ttft_of_cache_cold_and_cache_warm_requests(two_by_two):
    out, _ = two_by_two
    for table in (pd.read_parquet(out / "results.parquet"), pd.read_csv(out / "results.csv")):
        for row in table.to_dict("records"):
            if row["cache"] == "none":  # nothing is ever cached: every request is cold
                assert row["cold_requests"] == row["num_requests"] == 44
                assert row["ttft_p50_cold_s"] == row["ttft_p50_s"]
                assert row["ttft_p99_cold_s"] == row["ttft_p99_s"]
                assert np.isnan(row["ttft_p99_warm_s"])
            else:  # each problem's root call is cold, the thoughts below it reuse its prompt
                assert row["cold_requests"] == 2
                assert row["ttft_p99_warm_s"] < row["ttft_p99_cold_s"]
    text = (out / "report.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| variant | status"))
    assert "| ttft_p50_s | ttft_p99_cold_s | ttft_p99_warm_s |" in header
    table = pd.read_parquet(out / "results.parquet").set_index("variant")
    cold, warm = table.loc["radix/lpm", ["ttft_p99_cold_s", "ttft_p99_warm_s"]]
    assert f"| {cold:.3g} | {warm:.3g} |" in text
    assert f"| {table.loc['none/fcfs', 'ttft_p99_cold_s']:.3g} | – |" in text


def test_findings_match_the_table(two_by_two):
    out, _ = two_by_two
    table = pd.read_parquet(out / "results.parquet").set_index("variant")
    text = (out / "report.md").read_text()
    found = re.findall(r"- \*\*(\S+)\*\*: best is `(\S+)`.* at ([\d.]+)× the throughput of "
                       r"`(\S+)`; its hit rate ([\d.]+) is ([\d.]+)% of the ideal ([\d.]+)\.", text)
    assert len(found) == 1
    workload, variant, speedup, baseline, hit, share, ideal = found[0]
    best = table.loc[variant]
    assert workload == best["workload"] == "tree_of_thought" and baseline == "none/fcfs"
    assert best["throughput_req_s"] == table["throughput_req_s"].max()
    assert speedup == f"{best['throughput_vs_nocache']:.2f}"
    assert hit == f"{best['hit_rate']:.3f}" and ideal == f"{best['ideal_hit_rate']:.3f}"
    assert share == f"{100 * best['hit_rate'] / best['ideal_hit_rate']:.1f}"
    assert f"| `{variant}` | {speedup} |" in text  # the same figure in the speedup table


def test_a_failed_run_is_recorded_and_the_sweep_goes_on(tmp_path):
    proc = sweep(tmp_path, "cache.capacity_tokens=-1,null", *SMALL)
    assert proc.returncode == 0, proc.stderr
    assert "error: cache.capacity_tokens must be >= 0 or null, got -1" in proc.stderr
    failed = json.loads((tmp_path / "0" / "failed.json").read_text())
    assert failed["error_type"] == "BadInput" and "Traceback" in failed["traceback"]
    assert failed["kind"] == "bad_input"
    assert failed["message"] == "cache.capacity_tokens must be >= 0 or null, got -1"
    assert "cache.capacity_tokens=-1" in failed["overrides"]
    assert failed["config"]["cache"]["capacity_tokens"] == -1
    assert (tmp_path / "1" / "summary.json").is_file()  # the next job still ran

    assert report(tmp_path).returncode == 0
    table = pd.read_csv(tmp_path / "results.csv").set_index("run")
    assert table.loc[0, "status"] == "failed" and table.loc[1, "status"] == "ok"
    assert table.loc[0, "error"] == "BadInput: cache.capacity_tokens must be >= 0 or null, got -1"
    assert table.loc[0, "failure"] == "bad_input" and pd.isna(table.loc[1, "failure"])
    assert table.loc[0, "capacity_tokens"] == -1 and table.loc[0, "workload"] == "tree_of_thought"
    assert np.isnan(table.loc[0, "hit_rate"]) and table.loc[1, "hit_rate"] > 0
    text = (tmp_path / "report.md").read_text()
    assert "| failed |" in text and "1 of 2 runs failed (1 refused inputs;" in text
    assert "## Failed runs" in text
    assert (tmp_path / "figures" / "hit_rate.png").is_file()  # drawn from the ok run


def test_rerunning_a_sweep_skips_finished_runs_and_retries_failed_ones(tmp_path):
    args = ["cache.capacity_tokens=-1,null", *SMALL]
    assert sweep(tmp_path, *args).returncode == 0
    done = tmp_path / "1" / "summary.json"
    stamp = done.stat().st_mtime_ns
    proc = sweep(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr
    assert f"skip: {tmp_path / '1'} already has summary.json" in proc.stdout
    assert "skip: " not in proc.stdout.split("#1")[0]  # the failed run ran again
    assert "must be >= 0 or null" in proc.stderr
    assert done.stat().st_mtime_ns == stamp

    proc = sweep(tmp_path, "cache.capacity_tokens=null,-1", *SMALL)  # other configs, same dirs
    assert proc.returncode == 0, proc.stderr
    assert "skip: " not in proc.stdout and "rerun: " in proc.stdout
    assert (tmp_path / "0" / "summary.json").is_file()
    assert not (tmp_path / "0" / "failed.json").exists()
    assert (tmp_path / "1" / "failed.json").is_file() and not done.exists()


BOOM = """
import runpy, sys
import testbed.results.rundir
def boom(*args, **kwargs):
    raise RuntimeError("boom")
testbed.results.rundir.write_run = boom  # the run fails where it would write its results
sys.argv = ["testbed.run", *sys.argv[1:]]
runpy.run_module("testbed.run", run_name="__main__")
"""


def test_an_unexpected_error_is_recorded_in_a_single_run_and_in_a_sweep(tmp_path):
    single = tmp_path / "single"
    proc = subprocess.run([sys.executable, "-c", BOOM, f"hydra.run.dir={single}"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == \
        f"error: internal error: RuntimeError: boom; traceback in {single / 'failed.json'}"
    failed = json.loads((single / "failed.json").read_text())
    assert failed["error_type"] == "RuntimeError" and failed["kind"] == "internal"
    multi = tmp_path / "multi"
    proc = subprocess.run([sys.executable, "-c", BOOM, "-m", "hydra/launcher=basic", "seed=0,1",
                           f"hydra.sweep.dir={multi}"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (multi / "0" / "failed.json").is_file() and (multi / "1" / "failed.json").is_file()
    assert json.loads((multi / "0" / "failed.json").read_text())["kind"] == "internal"


def test_the_report_lists_internal_errors_before_refused_inputs(tmp_path):
    from testbed.report.markdown import failures_table

    df = pd.DataFrame({"run": ["a", "b", "c", "d"], "status": ["failed", "ok", "failed", "failed"],
                       "failure": ["bad_input", None, "internal", "unknown"],
                       "error": ["BadInput: x", None, "KeyError: y", "ValueError: z"]})
    lines = failures_table(df).splitlines()
    assert lines[0] == "| failure | run | error |"
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["internal", "unknown",
                                                                   "bad_input"]


def test_capacity_and_load_figures_appear_when_the_sweep_varies_them(tmp_path):
    caps = tmp_path / "caps"
    proc = sweep(caps, "backend=replay", "cache.capacity_tokens=300,1000,4000", *SMALL)
    assert proc.returncode == 0, proc.stderr
    assert report(caps).returncode == 0
    assert matplotlib.image.imread(caps / "figures" / "hit_rate_vs_capacity.png").ndim == 3
    assert not (caps / "figures" / "throughput_vs_nocache.png").exists()  # replay has no time
    assert not (caps / "figures" / "ttft_cold_vs_warm.png").exists()
    assert "best hit rate is" in (caps / "report.md").read_text()

    load = tmp_path / "load"
    proc = sweep(load, "workload=chat", "workload.num_sessions=4", "arrival.kind=poisson",
                 "arrival.rate=0.5,4", "scheduler=fcfs,lpm", "progress=false")
    assert proc.returncode == 0, proc.stderr
    assert report(load).returncode == 0
    assert matplotlib.image.imread(load / "figures" / "latency_vs_load.png").ndim == 3
    assert "lowest median latency is" in (load / "report.md").read_text()


def test_a_folder_without_runs_is_one_clear_line(tmp_path):
    proc = report(tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == \
        f"error: no runs under {tmp_path} (no summary.json or failed.json found)"


@pytest.mark.parametrize("preset", ["ablation", "scheduling", "beyond_prefix", "eviction",
                                    "routing"])
def test_presets_compose_to_the_documented_sweeps(preset):
    proc = subprocess.run([sys.executable, "-m", "testbed.run", f"+experiment={preset}",
                           "--cfg", "hydra"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "mode: MULTIRUN" in proc.stdout and f"dir: multirun/{preset}" in proc.stdout
    assert "JoblibLauncher" in proc.stdout and "n_jobs: -1" in proc.stdout


def test_repeated_runs_of_one_config_are_replicates_whose_bars_show_the_mean(tmp_path):
    """Two runs of the same config (an engine run repeated for its noise, a re-run) report
    without error; a bar is the replicates' mean with a whisker over their range."""
    from testbed.report.figures import _grouped_bars, new_figure, replicates

    for name in ("r1", "r2"):
        proc = subprocess.run([sys.executable, "-m", "testbed.run", "backend=replay", *SMALL,
                               f"hydra.run.dir={tmp_path / name}"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    proc = report(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert matplotlib.image.imread(tmp_path / "figures" / "hit_rate.png").ndim == 3
    table = pd.read_csv(tmp_path / "results.csv")
    assert len(table) == 2 and table["hit_rate"].nunique() == 1

    runs = pd.DataFrame({"variant": ["radix/lpm"] * 3 + ["none/fcfs"],
                         "setting": ["a", "a", "b", "a"], "hit_rate": [0.2, 0.5, 0.7, 0.1]})
    got = replicates(runs[runs["variant"] == "radix/lpm"], "hit_rate")
    assert got.loc["a"].tolist() == [0.35, 0.2, 0.5, 2] and got.loc["b"].tolist() == [0.7] * 3 + [1]
    fig, axes = new_figure(1, 1, (4, 3))
    _grouped_bars(runs, "hit_rate", axes[0][0], marker=lambda groups: None)
    heights = sorted(round(p.get_height(), 9) for p in axes[0][0].patches)
    assert heights == [0.1, 0.35, 0.7]
    whiskers = [c for c in axes[0][0].containers if getattr(c, "has_yerr", False)]
    assert len(whiskers) == 1  # only radix/lpm has replicates
    fig, axes = new_figure(1, 1, (4, 3))
    _grouped_bars(runs, "hit_rate", axes[0][0])  # no marker: the best mean is labelled
    assert sorted(t.get_text() for t in axes[0][0].texts) == ["0.35×", "0.70×"]
