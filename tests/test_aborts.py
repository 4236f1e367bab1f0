"""A run in which requests could never fit the KV pool says so on its last printed lines: how
many, the largest, the pool and the key to change. The sim and the engine abort such a request
(`Scheduler.submit`: prompt + output − 1 tokens of KV needed); replay serves it uncached
(prompt + output inserted, so one token more is needed)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# (prompt, output) lengths. With a 40-token pool: 15 fits; 50 (KV 49) and 42 (KV 41) are aborted;
# 41 (KV 40) fits the sim and the engine but not replay; 10 fits.
SHAPES = [(10, 5), (30, 20), (41, 1), (35, 6), (5, 5)]


def write_trace(path: Path) -> Path:
    lines = []
    for i, (p, o) in enumerate(SHAPES):  # ids below the tiny model's 256-token vocabulary
        lines.append(json.dumps({"prompt": [(7 * i + k) % 200 + 1 for k in range(p)],
                                 "output": [(3 * i + k) % 200 + 1 for k in range(o)]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def run(*overrides: str, sweep: bool = False) -> subprocess.CompletedProcess:
    flags = ["-m", "hydra/launcher=basic"] if sweep else []  # basic: runs in order, one process
    return subprocess.run([sys.executable, "-m", "testbed.run", *flags, "progress=false",
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("backend, extra, line, aborted, uncached", [
    ("sim", [], "2 of 5 requests aborted (not served): their prompt + output (up to 50 tokens) "
     "exceeds the KV pool of 40 tokens (cache.capacity_tokens); raise it or shorten the workload",
     2, 2),
    ("engine", ["model=tiny", "device=cpu"], "2 of 5 requests aborted (not served): their prompt "
     "+ output (up to 50 tokens) exceeds the KV pool of 40 tokens (cache.capacity_tokens); raise "
     "it or shorten the workload", 2, 2),
    ("sim", ["replicas=2"], "2 of 5 requests aborted (not served): their prompt + output (up "
     "to 50 tokens) exceeds each replica's KV pool of 40 tokens (cache.capacity_tokens); raise it "
     "or shorten the workload", 2, 2),
    ("replay", [], "3 of 5 requests served uncached (no hit, nothing inserted): their prompt + "
     "output (up to 50 tokens) exceeds the KV pool of 40 tokens (cache.capacity_tokens); raise it "
     "or shorten the workload", 0, 3),
])
def test_requests_that_never_fit_are_reported_last(tmp_path, backend, extra, line, aborted,
                                                   uncached):
    trace = write_trace(tmp_path / "t.jsonl")
    proc = run(f"backend={backend}", *extra, "workload=trace", f"workload.path={trace}",
               "cache.capacity_tokens=40", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == line
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["num_requests"], summary["aborted_requests"], summary["uncached_requests"]) \
        == (5, aborted, uncached)
    printed = dict(row.split(None, 1) for row in proc.stdout.splitlines() if row.startswith("  "))
    assert printed["aborted_requests"] == str(aborted)


def test_a_run_where_everything_fits_prints_no_such_line(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl")
    proc = run("workload=trace", f"workload.path={trace}", "cache.capacity_tokens=50",
               f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"results in {tmp_path}"


def test_the_line_names_whole_pages_and_a_derived_pool(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl")
    paged = run("workload=trace", f"workload.path={trace}", "cache.capacity_tokens=40",
                "cache.page_size=16", f"hydra.run.dir={tmp_path / 'paged'}")
    assert paged.stdout.splitlines()[-1] == (
        "3 of 5 requests aborted (not served): their prompt + output (up to 50 tokens) exceeds "
        "the KV pool of 32 tokens (cache.capacity_tokens=40 in whole pages); raise it or shorten "
        "the workload")
    # Llama-2-7B's weights leave 316 tokens of KV at 56.5% of an A10G's memory
    derived = run("workload=chat", "hardware.mem_fraction=0.565",
                  f"hydra.run.dir={tmp_path / 'derived'}")
    assert derived.stdout.splitlines()[-1] == (
        "80 of 80 requests aborted (not served): their prompt + output (up to 1,937 tokens) "
        "exceeds the KV pool of 316 tokens (what model=llama2_7b leaves on hardware=a10g); set "
        "cache.capacity_tokens higher, take larger hardware or shorten the workload")


def test_a_sweep_prints_the_line_under_its_run(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl")
    proc = run("backend=sim,replay", "workload=trace", f"workload.path={trace}",
               "cache.capacity_tokens=40", f"hydra.sweep.dir={tmp_path / 'sweep'}", sweep=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    done = [i for i, row in enumerate(lines) if row.startswith("done: ")]
    assert len(done) == 2
    assert lines[done[0] + 1].startswith("  2 of 5 requests aborted (not served)")
    assert lines[done[1] + 1].startswith("  3 of 5 requests served uncached")
