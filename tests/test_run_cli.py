"""The command line contract: `python -m testbed.run [overrides]` writes summary.json and
requests.jsonl into the Hydra run dir; bad values fail with one line."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]


def run(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed.run", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_replay_of_a_token_trace_writes_summary_and_requests(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"prompt": [1, 2, 3], "output": [4]}\n'
        '{"prompt": [1, 2, 3, 4, 5], "output": [6, 7]}\n'
        '{"prompt": [9, 9], "output": [1]}\n')
    out = tmp_path / "run"
    proc = run("backend=replay", "workload=trace", f"workload.path={trace}", "workload.format=tokens",
               "cache=radix", "cache.capacity_tokens=9", "save_token_ids=true",
               f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["num_requests"], summary["prompt_tokens"], summary["cached_tokens"]) == (3, 10, 4)
    assert summary["evicted_tokens"] == 2 and summary["ideal_hit_rate"] == 0.4
    assert summary["makespan_s"] is None
    timing = summary["timing"]
    assert list(timing) == ["load_s", "run_s", "ideal_s", "write_s"]
    assert all(v >= 0 for v in timing.values())
    assert sum(v for k, v in timing.items() if k != "write_s") <= summary["wall_s"]
    rows = pd.read_json(out / "requests.jsonl", lines=True)
    assert rows["cached_tokens"].tolist() == [0, 4, 0]
    # the leaf [6, 7], whole: SGLang 0.5.23's checkpoint split the second request's prompt
    # [1, 2, 3, 4, 5] off its output (0.4.10: the leaf [5, 6, 7], 3 tokens)
    assert rows["evicted_tokens"].tolist() == [0, 0, 2]
    assert rows["inserted"].tolist() == [True, True, True]
    assert rows["prompt_ids"][1] == [1, 2, 3, 4, 5] and rows["output_ids"][1] == [6, 7]
    assert "hit_rate" in proc.stdout


def test_default_run_prints_the_summary(tmp_path):
    proc = run("workload.num_problems=2", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert "backend=sim" in proc.stdout and "makespan_s" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_requests"] == 2 * (15 + 7) and summary["makespan_s"] > 0


def test_bad_values_fail_with_one_line_naming_the_key(tmp_path):
    proc = run("cache.capacity_tokens=-5", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: cache.capacity_tokens must be >= 0 or null, got -5"
    proc = run("workload=trace", f"workload.path={tmp_path}/missing.jsonl", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2 and "workload.path: no such file" in proc.stderr
    proc = run("cache=lru", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: cache must be one of block_hash, custom, none, radix; got 'lru'"
    proc = run("scheduler=sjf", f"hydra.run.dir={tmp_path}")
    assert proc.stderr.strip() == \
        "error: scheduler must be one of custom, dfs_weight, fcfs, hrrn, lof, lpm, random, vllm; got 'sjf'"
