"""``timeline.json``: a simulated (or engine) run in the Chrome trace-event format.

Open it in https://ui.perfetto.dev ("Open trace file") or chrome://tracing. Times are virtual:
``ts`` and ``dur`` are microseconds of simulated time since the run began, whole nanoseconds
(each time is rounded to the nanosecond once, so a phase's end is exactly the next one's start).

Layout (docs/design.md §3): one process per replica (``pid`` = replica + 1, named ``replica R``)
holding (thread ids are unique across processes, as viewers expect of tids)
- thread ``pid``, ``steps``: each step as a complete event (``"ph": "X"``) named ``prefill`` or
  ``decode``, its ``args`` the step's line of ``steps.jsonl`` less the times;
- counters (``"ph": "C"``) at each step's end: ``KV pool (tokens)`` (``in_use``, ``evictable``,
  ``free``: they add up to the pool), ``tree (tokens)`` (``cached``) and ``requests``
  (``waiting``, ``running``, ``loading``);
- one thread per request served there (``tid`` = replicas + 1 + its arrival index, named
  ``req ID``): a
  complete event named by the request id spanning arrival to finish (``cat`` ``request``, ``args``
  its record's counts), and inside it its phases (``cat`` ``phase``: ``network``, ``queued``,
  ``load``, ``prefill``, ``decode``; `testbed.serving.observer`), which tile it exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testbed.serving.observer import Life, RunObserver, StepRow


def _ns(t: float) -> int:
    return round(t * 1e9)


def _complete(name: str, cat: str, pid: int, tid: int, start_ns: int, end_ns: int,
              args: dict[str, Any] | None = None) -> dict[str, Any]:
    event = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
             "ts": start_ns / 1000, "dur": (end_ns - start_ns) / 1000}
    if args:
        event["args"] = args
    return event


def _meta(kind: str, pid: int, value: Any, tid: int | None = None) -> dict[str, Any]:
    event = {"name": kind, "ph": "M", "pid": pid, "args": {"name" if kind.endswith("name")
                                                           else "sort_index": value}}
    if tid is not None:
        event["tid"] = tid
    return event


def step_events(row: StepRow) -> list[dict[str, Any]]:
    """A step's complete event and the counters after it."""
    pid, end = row.replica + 1, _ns(row.start_s + row.duration_s)
    args = {k: v for k, v in row.to_json().items()
            if k not in ("replica", "start_s", "duration_s", "kind")}
    events = [_complete(row.kind, "step", pid, pid, _ns(row.start_s), end, args)]
    counter = {"ph": "C", "pid": pid, "ts": end / 1000}
    pool = {"in_use": row.kv_used_tokens, "evictable": row.evictable_tokens,
            "free": row.free_tokens}
    events += [counter | {"name": "KV pool (tokens)",
                          "args": {k: v for k, v in pool.items() if v is not None}},
               counter | {"name": "tree (tokens)", "args": {"cached": row.tree_tokens}},
               counter | {"name": "requests", "args": {"waiting": row.waiting,
                                                       "running": row.running,
                                                       "loading": row.loading}}]
    return events


def request_events(life: Life, tid: int) -> list[dict[str, Any]]:
    """A request's thread: its name, its life and the phases that tile it."""
    req, pid = life.req, life.replica + 1
    end = life.finish_s if life.finish_s is not None else life.since
    args = {"prompt_tokens": len(req.prompt), "cached_tokens": req.cached_tokens or 0,
            "output_tokens": len(req.output), "preemptions": req.preemptions,
            "aborted": req.aborted}
    events = [_meta("thread_name", pid, f"req {req.id}", tid),
              _meta("thread_sort_index", pid, tid, tid),
              _complete(req.id, "request", pid, tid, _ns(life.arrival_s), _ns(end), args)]
    events += [_complete(s.phase, "phase", pid, tid, _ns(s.start_s), _ns(s.end_s))
               for s in life.spans]
    return events


def trace_events(observer: RunObserver, other: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole run as a trace-event JSON object (``traceEvents``, ``displayTimeUnit``,
    ``otherData``: what ran, from ``other``)."""
    events, replicas = [], len(observer.replicas)
    for r in range(replicas):
        pid = r + 1
        events += [_meta("process_name", pid, f"replica {r}"), _meta("process_sort_index", pid, r),
                   _meta("thread_name", pid, "steps", pid), _meta("thread_sort_index", pid, 0, pid)]
    for row in observer.rows:
        events += step_events(row)
    for i, life in enumerate(observer.lives.values()):
        events += request_events(life, replicas + 1 + i)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"time": "simulated; ts and dur in microseconds", **(other or {})}}


def write_timeline(path: str | Path, observer: RunObserver,
                   other: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    with path.open("w") as f:
        json.dump(trace_events(observer, other), f, separators=(",", ":"))
    return path
