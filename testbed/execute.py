"""One run from a composed config to its files: `execute` assembles the run (every value checked,
`testbed.config.assembly`), generates its workload, serves it on the chosen backend
(`testbed.backends.dispatch`), summarizes the records (`testbed.results.metrics`) and writes the run
directory (`testbed.results.rundir`, `testbed.results.timeline`). `python -m testbed.run`, the
fuzzer, experiments and tests all run through it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig

from testbed.config.assembly import assemble
from testbed.backends.dispatch import run_backend
from testbed.results.metrics import ideal_hit_rate, summarize
from testbed.results.rundir import write_run
from testbed.results.timeline import write_timeline


def execute(cfg: DictConfig, run_dir: str | Path, notes: list[str] | None = None,
            loaded: Callable[[list], None] | None = None) -> dict[str, Any]:
    """Run one configuration and write its results; returns the summary. ``notes`` receives the
    lines to print after it (requests that could never fit the KV pool, and why); ``loaded`` is
    called with the requests once the workload is made, before they are served (a benchmark
    separating the trace's memory from the run's)."""
    started = time.perf_counter()
    run = assemble(cfg)  # every value read and checked before anything is generated
    for note in run.notes:
        print(note, file=sys.stderr)
    loading = time.perf_counter()
    requests = run.requests()
    if loaded is not None:
        loaded(requests)
    made = time.perf_counter()
    # The simulator's outputs are the workload's, so its ideal hit rate is known before it runs;
    # counted first, the ideal's trie is gone before the simulation's state grows, instead of
    # adding to it at the peak.
    ideal = ideal_hit_rate(requests) if run.backend == "sim" else None
    running = time.perf_counter()
    result = run_backend(run, requests)
    add_answers(result.records, requests)
    counting = time.perf_counter()
    if result.ideal_hit_rate is not None:
        ideal = result.ideal_hit_rate
    elif ideal is None:
        ideal = ideal_hit_rate(requests)
    done = time.perf_counter()
    summary = summarize(result.records, ideal=ideal, wall_s=done - started,
                        preemptions=result.preemptions)
    summary["timing"] = {"load_s": made - loading, "run_s": counting - running,
                         "ideal_s": (running - made) + (done - counting),
                         "write_s": None}  # write_run sets write_s
    summary |= run.labels() | {"capacity_tokens": run.capacity_tokens}
    summary |= result.extra
    observer = result.observer
    write_run(run_dir, summary, result.records, config=run.config,
              steps=observer.rows if observer is not None else None, beams=result.beams)
    if run.timeline:
        write_timeline(Path(run_dir) / "timeline.json", observer,
                       {k: summary.get(k) for k in ("backend", "workload", "cache", "scheduler",
                                                    "model", "hardware")})
    if notes is not None:
        notes += result.notes
    return summary


def add_answers(records: list, requests: list) -> None:
    """Copy each request's expected ``answer`` (tasks with ground truth) into its record."""
    answers = {r.id: r.answer for r in requests if r.answer is not None}
    if answers:
        for rec in records:
            rec.answer = answers.get(rec.id)
