"""LPM's starvation of cache-cold requests, ``scheduler.lpm_aging`` and HRRN: the setup of the study.

A saturated server (a closed loop of ``in_flight`` requests) serves a mix of hot requests (a
shared 2,048-token system prompt, a 64-token question) and cold ones (1,024 tokens of their own),
64-token outputs, Llama-3-8B on an H100 in the simulator (roofline costs). LPM always prefers a
hot request (2,048 tokens cached) to a cold one (0), so a cold request waits until no hot one is
queued; aging adds ``lpm_aging`` tokens to a waiting request's LPM key per second of waiting.
``python -m experiments.studies.fairness`` prints the table; tests/test_scheduler_fidelity.py
checks that aging bounds the cold requests' wait.

`open_loop_requests` and `run_policy` are the setting of SGLang issue 31954 and PR 32911 (the
``--policies`` table): requests arrive as a Poisson process (open loop) at a share of the rate the
server sustains, 5% of them cold, the hot ones sharing a system prompt long enough for a hit rate
of about 96%; FCFS, LPM, LPM with aging and HRRN compared on mean and p99 TTFT.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from testbed.config.assembly import Assembly, assemble, compose_config
from testbed.results.metrics import summarize
from testbed.serving.serve import records_of, serve
from testbed.workloads.request import Request


def hot_cold_requests(n: int, cold_share: float, seed: int = 0, system_len: int = 2048,
                      cold_len: int = 1024) -> list[Request]:
    """``n`` requests, each cold with probability ``cold_share`` (ids ``hot<i>`` / ``cold<i>``)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1000, 32000, system_len).astype(np.int32)
    out = []
    for i in range(n):
        output = rng.integers(1000, 32000, 64).astype(np.int32)
        if rng.random() < cold_share:
            prompt = rng.integers(1000, 32000, cold_len).astype(np.int32)
            out.append(Request(f"cold{i}", prompt, output))
        else:
            question = rng.integers(1000, 32000, 64).astype(np.int32)
            out.append(Request(f"hot{i}", np.concatenate([system, question]), output))
    return out


def assembled(aging: float | None, capacity: int, max_running: int,
              policy: str | None = None) -> Assembly:
    """Llama-3-8B on an H100 in the simulator (roofline costs), a radix cache of ``capacity``
    tokens; ``aging`` None: FCFS for reference (``policy``: this queue policy instead)."""
    policy = policy or ("fcfs" if aging is None else "lpm")
    return assemble(compose_config([
        "backend=sim", "model=llama3_8b", "hardware=h100", "cost_model=roofline", "cache=radix",
        f"cache.capacity_tokens={capacity}", f"scheduler={policy}",
        *([f"scheduler.lpm_aging={aging or 0.0}"] if policy == "lpm" else []),
        f"scheduler.max_running_requests={max_running}"]))


def run_aging(requests: list[Request], aging: float | None, in_flight: int, capacity: int,
              max_running: int) -> dict:
    """One run's summary (`testbed.results.metrics.summarize`, cold and warm TTFT included) with its
    ``aging``; ``aging`` None: FCFS for reference."""
    a = assembled(aging, capacity, max_running)
    _, result = serve(requests, a.build_cache(capacity, requests), a.scheduler,
                      a.build_executor(capacity), max_in_flight=in_flight)
    return summarize(records_of(result.reqs), ideal=0.0, wall_s=0.0) | {"aging": aging}


def open_loop_requests(requests: list[Request], rate: float, seed: int = 0) -> list[Request]:
    """``requests`` arriving as a Poisson process of ``rate`` per second, in their order."""
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, len(requests))
    return [replace(r, arrival_s=float(t)) for r, t in zip(requests, np.cumsum(gaps))]


def run_policy(requests: list[Request], policy: str, aging: float, capacity: int,
               max_running: int) -> dict:
    """One open-loop run (every request submitted at its ``arrival_s``): its summary plus the
    mean TTFT (PR 32911 reports it) under queue policy ``policy`` (``aging``: lpm's)."""
    a = assembled(aging, capacity, max_running, policy)
    _, result = serve(requests, a.build_cache(capacity, requests), a.scheduler,
                      a.build_executor(capacity))
    records = records_of(result.reqs)
    ttft = [r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None]
    return summarize(records, ideal=0.0, wall_s=0.0) | {"ttft_mean_s": float(np.mean(ttft))}
