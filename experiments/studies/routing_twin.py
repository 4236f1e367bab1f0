"""The routing study's simulator twin (`experiments.studies.routing_live`): the calls as they ran
live, simulated behind the same policy; its decisions compared with the live router's call by
call; and the same simulation with the first wave's arrivals jittered by a few milliseconds.

Why the jitter: a policy that routes on each replica's outstanding work at the moment
(``least_load``), or on the order calls arrive in (``round_robin``, ``random``), turns on timing
finer than the simulator can be told: the first wave reaches the router 1–4 ms apart, and the
closed loop's later calls follow the finishing order, which the simulated step times decide. On
the chat workload, two arrival timings 3 ms apart moved the simulated ``least_load`` hit rate by
0.03 (seen as prefill progress, before the twin took the router's view), and four live runs of
it moved by 0.066. The jittered runs (each first-wave arrival moved by
a uniform draw in ``± jitter_ms``, a seed per run) give the twin's spread beside its one exact run,
so a difference from the live run can be read against how far milliseconds move it.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.validation.vllm import caching
from experiments.validation.vllm import live as vllm_live

ROUTING = "routing.json"  # a testbed.route front's decisions (/debug/state `routing`)


def received(routing: list[list]) -> dict[str, float]:
    """Each call's id -> when the router first routed it (seconds on its clock), from
    ``/debug/state``'s ``routing`` (a retry routes a call again: its first decision counts)."""
    out: dict[str, float] = {}
    for request_id, _, t in routing:
        if request_id is not None:
            out.setdefault(request_id, t)
    return out


def served_by(routing: list[list]) -> dict[str, int]:
    """Each call's id -> the replica that served it: the router's last decision for it (a retry's
    replaced the first), from ``/debug/state``'s ``routing``; calls without an id left out."""
    return {request_id: w for request_id, w, _ in routing if request_id is not None}


def same_replica(routing: list[list] | None, simulated: dict[str, int]) -> float | None:
    """The share of calls the simulator sent to the replica that served them live (the last
    decision for each: a retry's replaced the first), under the naming of the replicas that
    agrees most (identical replicas started empty: which one is called 0 decides nothing);
    None behind smg (its decisions are not logged)."""
    if routing is None:
        return None
    live = served_by(routing)
    names = sorted(set(live.values()) | {w for w in simulated.values() if w is not None})
    best = max(sum(simulated.get(i) is not None and rename[names.index(simulated[i])] == w
                   for i, w in live.items())
               for rename in itertools.permutations(names))
    return best / max(1, len(live))


def jittered(lines: list[dict], wave: list[str], jitter_ms: float, seed: int) -> list[dict]:
    """``lines`` (an as-ran trace) with each first-wave call's arrival moved by a uniform draw in
    ``± jitter_ms`` (never before 0); the other calls as they are."""
    rng = np.random.default_rng(seed)
    moved = set(wave)
    return [{**x, "arrival_s": max(0.0, x["arrival_s"] + rng.uniform(-jitter_ms, jitter_ms) / 1e3)}
            if x["id"] in moved else x for x in lines]


def twin(overrides: list[str], requests: list, out: Path, replicas: int, runs: int = 1,
         jitter_ms: float = 0.0) -> dict:
    """The simulator's run (config ``overrides``: backend, model, cost model, router, replicas,
    pool, arrival) of the calls as they ran in ``out/client``, the first wave as the router
    received it where ``out/routing.json`` says (behind smg: as the client sent it); with
    ``runs`` > 1, ``runs - 1`` more with the first wave jittered (module docstring). Its
    figures, and each figure's range over the runs."""
    from testbed.config.assembly import compose_config
    from testbed.execute import execute

    rows = vllm_live.records(out / "client")
    got = out / ROUTING
    routing = json.loads(got.read_text()) if got.is_file() else None
    lines = caching.as_ran_trace(requests, rows, received(routing) if routing else None)
    wave = caching.first_wave(rows)
    figures = []
    for k in range(runs):
        folder = out / ("sim" if k == 0 else f"sim_jitter{k}")
        trace = out / ("as_ran.jsonl" if k == 0 else f"as_ran_jitter{k}.jsonl")
        trace.write_text("".join(json.dumps(x) + "\n" for x in (
            lines if k == 0 else jittered(lines, wave, jitter_ms, seed=k))))
        execute(compose_config([*overrides, "workload=trace", f"workload.path={trace}",
                                "workload.format=tokens", "progress=false"]), folder)
        figures.append(summary_of(folder, routing, replicas))
    out_row = {f"sim_{k}": v for k, v in figures[0].items()}
    if runs > 1:
        table = pd.DataFrame(figures)
        for key in ("hit_rate", "requests_per_s"):
            out_row[f"sim_{key}_min"] = table[key].min()
            out_row[f"sim_{key}_max"] = table[key].max()
    return out_row


def summary_of(folder: Path, routing: list[list] | None, replicas: int) -> dict:
    """One simulated run's figures."""
    s = json.loads((folder / "summary.json").read_text())
    sim = vllm_live.records(folder)
    served = sim["replica"].value_counts().reindex(range(replicas), fill_value=0)
    return {"hit_rate": s["hit_rate"], "requests_per_s": s["throughput_req_s"],
            "ttft_p50_s": s["ttft_p50_s"], "imbalance": served.max() / served.mean(),
            "busy_s": s["busy_s"],
            "same_replica": same_replica(routing, dict(zip(sim["id"], sim["replica"])))}
