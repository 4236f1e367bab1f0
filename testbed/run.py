"""The entry point: ``python -m testbed.run [overrides]`` (Hydra; ``-m`` sweeps).

Composes the config (``conf/``), builds the workload and the cache, runs the chosen backend, writes
``summary.json``, ``requests.jsonl`` and (sim, engine) ``steps.jsonl`` into the Hydra run directory,
with ``timeline=true`` also ``timeline.json`` (Perfetto), and prints the summary. A bad
config value stops the run with one line naming the key and the allowed values.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from testbed.assembly import assemble, plain
from testbed.backends import run_backend
from testbed.cli import check_group_choices
from testbed.errors import BadInput, failure_kind
from testbed.metrics import ideal_hit_rate, summarize
from testbed.rundir import RUN_FILES, format_summary, write_run
from testbed.timeline import write_timeline

def failure_line(error: BaseException, failed: Path) -> str:
    """The one line a failed run prints: the message of refused input, or for a defect its type,
    message and where the traceback is."""
    if failure_kind(error) == "bad_input":
        return f"error: {error}"
    what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return f"error: internal error: {what}; traceback in {failed}"


def execute(cfg: DictConfig, run_dir: str | Path,
            notes: list[str] | None = None) -> dict[str, Any]:
    """Run one configuration and write its results; returns the summary. ``notes`` receives the
    lines to print after it (requests that could never fit the KV pool, and why)."""
    started = time.perf_counter()
    run = assemble(cfg)  # every group read and checked once (testbed/assembly.py)
    timeline = run.config.get("timeline", False)
    if timeline not in (True, False):
        raise BadInput(f"timeline must be true or false, got {timeline!r}")
    if timeline and run.backend == "replay":
        raise BadInput("timeline=true needs backend=sim or backend=engine (replay has no time)")
    for note in run.notes:
        print(note, file=sys.stderr)
    loading = time.perf_counter()
    requests = run.requests()
    running = time.perf_counter()
    result = run_backend(run, requests)
    counting = time.perf_counter()
    ideal = result.ideal_hit_rate if result.ideal_hit_rate is not None \
        else ideal_hit_rate(requests)
    done = time.perf_counter()
    summary = summarize(result.records, ideal=ideal, wall_s=done - started,
                        preemptions=result.preemptions)
    summary["timing"] = {"load_s": running - loading, "run_s": counting - running,
                         "ideal_s": done - counting, "write_s": None}  # write_run sets write_s
    summary |= run.labels() | {"capacity_tokens": run.capacity_tokens}
    summary |= result.extra
    observer = result.observer
    write_run(run_dir, summary, result.records, config=run.config,
              steps=observer.rows if observer is not None else None)
    if timeline:
        write_timeline(Path(run_dir) / "timeline.json", observer,
                       {k: summary.get(k) for k in ("backend", "workload", "cache", "scheduler",
                                                    "model", "hardware")})
    if notes is not None:
        notes += result.notes
    return summary


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """One run. In a sweep (``-m``) a run whose directory already has the ``summary.json`` of
    the same config is skipped, and a failing run is recorded in ``failed.json`` (error, traceback,
    overrides, config) while the sweep goes on; a single run records a failure too and exits
    non-zero: 2 with one ``error:`` line for refused input (`testbed.errors.BadInput`), 1 with
    ``error: internal error: ...`` for anything else (a defect of the testbed)."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    overrides = list(hydra_cfg.overrides.task)
    done = run_dir / "summary.json"
    if sweeping and done.is_file():  # skip it if it ran this very config (progress aside)
        try:
            same = {**json.loads(done.read_text()).get("config", {}), "progress": None} == \
                {**plain(cfg), "progress": None}
        except Exception:  # unreadable summary, unresolvable config: run it again
            same = False
        if same:
            print(f"skip: {run_dir} already has summary.json")
            return
        print(f"rerun: {run_dir} has a summary.json of another config; replacing it")
        for stale in (run_dir / name for name in RUN_FILES):
            stale.unlink(missing_ok=True)
    failed = run_dir / "failed.json"
    notes: list[str] = []
    try:
        summary = execute(cfg, run_dir, notes)
    except Exception as e:  # recorded for the report; a sweep goes on with its other runs
        try:
            config = plain(cfg)
        except Exception:  # an unresolvable interpolation: the overrides still say what ran
            config = None
        run_dir.mkdir(parents=True, exist_ok=True)
        kind = failure_kind(e)
        failed.write_text(json.dumps({
            "kind": kind, "error_type": type(e).__name__, "message": str(e),
            "traceback": traceback.format_exc(), "overrides": overrides, "config": config},
            indent=2) + "\n")
        line = failure_line(e, failed)
        if sweeping:
            print(f"{line} [{' '.join(overrides)}]; recorded in {failed}", file=sys.stderr)
            return
        print(line, file=sys.stderr)
        sys.exit(2 if kind == "bad_input" else 1)
    failed.unlink(missing_ok=True)  # an earlier failure of this run, now superseded
    if sweeping:
        span = summary["makespan_s"]
        print(f"done: {' '.join(overrides)} · hit_rate {summary['hit_rate']:.4g}"
              + (f" · makespan_s {span:.4g}" if span is not None else "") + f" · {run_dir}")
        for line in notes:
            print(f"  {line}")
        return
    head = [f"backend={summary['backend']}", f"workload={summary['workload']}",
            f"cache={summary['cache']}", f"eviction={summary['eviction']}"]
    if summary["backend"] != "replay":
        head += [f"scheduler={summary['scheduler']}", f"model={summary['model']}",
                 f"hardware={summary['hardware']}",
                 f"kv_capacity_tokens={summary['kv_capacity_tokens']}"]
    else:
        head.append(f"capacity_tokens={summary['capacity_tokens']}")
    print(" · ".join(head))
    print(format_summary(summary))
    print(f"results in {run_dir}")
    for line in notes:
        print(line)


if __name__ == "__main__":
    check_group_choices(sys.argv[1:])
    # conf/hydra/launcher/ray.yaml has the name of the Ray plugin's own config, which Hydra then
    # merges in as a schema with a deprecation warning per job; the file does not rely on it.
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/ray' is validated against")
    main()
