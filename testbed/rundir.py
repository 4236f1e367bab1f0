"""Writing a run's results: ``summary.json``, ``requests.jsonl`` and (sim, engine) ``steps.jsonl``
(docs/design.md §3)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable

from testbed.metrics import RequestRecord
from testbed.serving.observer import StepRow

RUN_FILES = ("summary.json", "requests.jsonl", "steps.jsonl", "timeline.json")


def write_run(run_dir: str | Path, summary: dict[str, Any], records: list[RequestRecord],
              config: dict[str, Any] | None = None,
              steps: Iterable[StepRow] | None = None) -> Path:
    """Write the run's files into ``run_dir`` (created if needed); returns the directory.
    ``steps`` (sim and engine runs) become ``steps.jsonl``, one line per step. summary.json comes
    last, so a run dir with one is complete; a ``timing`` dict in ``summary`` gets ``write_s``,
    the seconds spent writing the other files."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with (run_dir / "requests.jsonl").open("w") as f:
        f.writelines(json.dumps(rec.to_json()) + "\n" for rec in records)
    if steps is not None:
        with (run_dir / "steps.jsonl").open("w") as f:
            f.writelines(json.dumps(row.to_json()) + "\n" for row in steps)
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
            *[k for k in ("token_agreement_mean", "kl_mean") if k in summary],
            "hit_rate", "ideal_hit_rate",
            *[k for k in ("hit_rate_gpu", "hit_rate_host", "hit_rate_disk") if k in summary],
            "output_tokens", "evicted_tokens", "uncached_requests", "aborted_requests", "preemptions", "makespan_s",
            "throughput_req_s", "throughput_tok_s", "ttft_p50_s", "e2e_p50_s", "wall_s"]
    width = max(map(len, keys + ["timing"]))
    lines = [f"  {k:<{width}}  {fmt(summary.get(k))}" for k in keys]
    timing = summary.get("timing")
    if isinstance(timing, dict):
        lines.append(f"  {'timing':<{width}}  " + "  ".join(
            f"{k} {fmt(v)}" for k, v in timing.items()))
    return "\n".join(lines)
