"""One run, one look: `python -m testbed.report RUN_DIR` on a single sim run draws time series from
its steps.jsonl (windowed hit rate, KV pool, batch size and queue) and links them in report.md."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pandas as pd
import pytest

from testbed.report import build
from testbed.report.timeseries import binned, windowed_hit_rate
from tests.test_timeline import SIM_PRESSURE, run

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SERIES = ["hit_rate_over_time.png", "kv_over_time.png", "batch_queue_over_time.png"]


def steps(**columns) -> pd.DataFrame:
    table = pd.DataFrame(columns)
    return table.assign(end_s=table["start_s"] + table["duration_s"])


def test_the_windowed_hit_rate_counts_requests_where_they_were_first_admitted():
    s = steps(start_s=[0.0, 1.0, 2.5, 3.0], duration_s=[1.0, 1.0, 0.5, 1.0],
              admitted_hit_tokens=[0, 30, 0, 10], admitted_prompt_tokens=[100, 40, 0, 60])
    w = windowed_hit_rate(s, windows=2)  # [0, 2) and [2, 4)
    assert w["start_s"].tolist() == [0.0, 2.0] and w["end_s"].tolist() == [2.0, 4.0]
    assert w["hit_tokens"].tolist() == [30, 10] and w["prompt_tokens"].tolist() == [140, 60]
    assert w["hit_rate"].tolist() == [30 / 140, 10 / 60]
    assert w["cumulative_hit_rate"].tolist() == [30 / 140, 40 / 200]
    w = windowed_hit_rate(s, windows=4)  # nobody admitted in [2, 3): a gap, not a zero
    assert math.isnan(w["hit_rate"][2]) and w["cumulative_hit_rate"][2] == 30 / 140


def test_gauges_are_window_means_that_hold_and_batch_sizes_leave_gaps():
    s = steps(start_s=[0.0, 0.5, 3.0], duration_s=[0.5, 0.5, 1.0], waiting=[4, 2, 7])
    held = binned(s, ["waiting"], windows=4, span=(0.0, 4.0))  # steps end at 0.5, 1.0, 4.0
    assert held.index.tolist() == [0.5, 1.5, 2.5, 3.5]
    assert held["waiting"].tolist() == [4.0, 2.0, 2.0, 7.0]
    gaps = binned(s, ["waiting"], windows=4, span=(0.0, 4.0), hold=False)["waiting"].tolist()
    assert gaps[0] == 4.0 and gaps[1] == 2.0 and math.isnan(gaps[2]) and gaps[3] == 7.0


@pytest.fixture(scope="module")
def one_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one_run")
    run(out, *SIM_PRESSURE)
    return out


def test_a_single_run_report_draws_the_time_series_from_its_steps(one_run):
    proc = subprocess.run([sys.executable, "-m", "testbed.report", str(one_run)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = (one_run / "report.md").read_text()
    for name in SERIES:
        png = one_run / "figures" / name
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 20_000
        image = matplotlib.image.imread(png)
        assert image.shape[0] > 400 and image.shape[1] > 900
        assert np.std(image[..., :3]) > 0.05  # drawn on, not a blank canvas
        assert f"](figures/{name})" in report


def test_without_steps_or_with_several_runs_there_are_no_time_series(one_run, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(one_run, bare, ignore=shutil.ignore_patterns("figures", "report.md"))
    (bare / "steps.jsonl").unlink()
    made = {p.name for p in build(bare)["figures"]}
    assert made and not made & set(SERIES)
    sweep = tmp_path / "sweep"
    shutil.copytree(one_run, sweep / "0", ignore=shutil.ignore_patterns("figures", "report.md"))
    run(sweep / "1", *SIM_PRESSURE, "cache=none")
    made = {p.name for p in build(sweep)["figures"]}
    assert "hit_rate.png" in made and not made & set(SERIES)
