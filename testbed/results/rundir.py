"""A run directory's files: writing a run's results (``summary.json``, ``requests.jsonl`` and, sim
and engine, ``steps.jsonl``; with beam calls ``beams.jsonl`` and ``beam_trace.jsonl``;
docs/design.md §3), a failure's ``failed.json``, and whether a sweep's run already has the
results of its config."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any, Iterable

from testbed.errors import failure_kind
from testbed.results.metrics import RequestRecord
from testbed.serving.observer import StepRow

RUN_FILES = ("summary.json", "requests.jsonl", "steps.jsonl", "timeline.json", "beams.jsonl",
             "beam_trace.jsonl")


def write_run(run_dir: str | Path, summary: dict[str, Any], records: list[RequestRecord],
              config: dict[str, Any] | None = None,
              steps: Iterable[StepRow] | None = None, beams: Any = None) -> Path:
    """Write the run's files into ``run_dir`` (created if needed); returns the directory.
    ``steps`` (sim and engine runs) become ``steps.jsonl``, one line per step; ``beams`` (the
    engine's `testbed.scheduler.beam.BeamCalls`, when the workload had beam calls) become
    ``beams.jsonl``, one line per call, and ``beam_trace.jsonl``, its requests as a token trace.
    summary.json comes last, so a run dir with one is complete; a ``timing`` dict in ``summary``
    gets ``write_s``, the seconds spent writing the other files."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with (run_dir / "requests.jsonl").open("w") as f:
        f.writelines(json.dumps(rec.to_json()) + "\n" for rec in records)
    if steps is not None:
        with (run_dir / "steps.jsonl").open("w") as f:
            f.writelines(json.dumps(row.to_json()) + "\n" for row in steps)
    if beams is not None:
        from testbed.workloads.traces import save_tokens

        with (run_dir / "beams.jsonl").open("w") as f:
            f.writelines(json.dumps(line) + "\n" for line in beams.results())
        save_tokens(beams.trace(), run_dir / "beam_trace.jsonl")
    if isinstance(summary.get("timing"), dict):
        summary["timing"]["write_s"] = time.perf_counter() - started
    doc = dict(summary)
    if config is not None:
        doc["config"] = config
    (run_dir / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    return run_dir


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines for the terminal: the figures a reader looks at first."""
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.6g}"
        return str(v)

    keys = ["num_requests", "prompt_tokens", "cached_tokens",
            *[k for k in ("approx_hit_tokens", "recomputed_tokens") if summary.get(k)],
            *[k for k in ("token_agreement_mean", "kl_mean", "first_divergence_mean",
                          "rouge_l_mean") if k in summary],
            "hit_rate", "ideal_hit_rate",
            *[k for k in ("hit_rate_gpu", "hit_rate_host", "hit_rate_disk") if k in summary],
            "output_tokens", "evicted_tokens", "uncached_requests", "aborted_requests", "preemptions", "makespan_s",
            "throughput_req_s", "throughput_tok_s", "ttft_p50_s", "e2e_p50_s",
            *[k for k in ("failed_requests", "itl_p50_s") if k in summary], "wall_s"]
    width = max(map(len, keys + ["timing"]))
    lines = [f"  {k:<{width}}  {fmt(summary.get(k))}" for k in keys]
    timing = summary.get("timing")
    if isinstance(timing, dict):
        lines.append(f"  {'timing':<{width}}  " + "  ".join(
            f"{k} {fmt(v)}" for k, v in timing.items()))
    return "\n".join(lines)


def done_before(run_dir: Path, config: dict[str, Any] | None) -> bool | None:
    """Whether ``run_dir`` holds the ``summary.json`` of this very config (``progress`` aside):
    True, False (another config's: its files are removed), None (no summary there). An
    unreadable summary or unresolvable config counts as another config."""
    done = run_dir / "summary.json"
    if not done.is_file():
        return None
    try:
        same = config is not None and \
            {**json.loads(done.read_text()).get("config", {}), "progress": None} == \
            {**config, "progress": None}
    except (OSError, ValueError):
        same = False
    if not same:
        for stale in (run_dir / name for name in RUN_FILES):
            stale.unlink(missing_ok=True)
    return same


def write_failure(run_dir: Path, error: BaseException, overrides: list[str],
                  config: dict[str, Any] | None) -> Path:
    """Record a failed run in ``run_dir/failed.json`` (its kind, error, traceback, overrides and
    config, for the report); returns the file. Call it inside the ``except`` block."""
    run_dir.mkdir(parents=True, exist_ok=True)
    failed = run_dir / "failed.json"
    failed.write_text(json.dumps({
        "kind": failure_kind(error), "error_type": type(error).__name__, "message": str(error),
        "traceback": traceback.format_exc(), "overrides": overrides, "config": config},
        indent=2) + "\n")
    return failed
