"""LPM starves cache-cold requests; ``scheduler.lpm_aging`` bounds their wait.

A saturated server (closed loop: ``--in-flight`` requests always queued or running, below LPM's
FCFS fallback at 128 waiting, at most ``--max-running`` of them running) serves a mix of hot requests (a shared 2,048-token system prompt,
a 64-token question) and cold ones (1,024 tokens of their own); 64-token outputs; Llama-3-8B on an
H100 in the simulator (roofline costs). LPM always prefers a hot request (2,048 tokens cached) to
a cold one (0), so a cold request waits until no hot one is queued. Aging adds ``lpm_aging``
tokens to a waiting request's LPM key per second of waiting. Printed per setting: hit rate, TTFT
p50/p99 of cold and warm requests (`testbed.metrics`), makespan.

    python experiments/fairness_study.py [--requests 2000] [--cold 0.2] [--in-flight 120]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from testbed.assembly import Assembly, assemble, compose_config
from testbed.metrics import summarize
from testbed.sim.simulate import records_of, serve
from testbed.workloads.request import Request


def workload(n: int, cold_share: float, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    system = rng.integers(1000, 32000, 2048).astype(np.int32)
    out = []
    for i in range(n):
        output = rng.integers(1000, 32000, 64).astype(np.int32)
        if rng.random() < cold_share:
            prompt = rng.integers(1000, 32000, 1024).astype(np.int32)
            out.append(Request(f"cold{i}", prompt, output))
        else:
            question = rng.integers(1000, 32000, 64).astype(np.int32)
            out.append(Request(f"hot{i}", np.concatenate([system, question]), output))
    return out


def assembled(aging: float | None, capacity: int, max_running: int) -> Assembly:
    """Llama-3-8B on an H100 in the simulator (roofline costs), a radix cache of ``capacity``
    tokens; ``aging`` None: FCFS for reference."""
    return assemble(compose_config([
        "backend=sim", "model=llama3_8b", "hardware=h100", "cost_model=roofline", "cache=radix",
        f"cache.capacity_tokens={capacity}", f"scheduler={'fcfs' if aging is None else 'lpm'}",
        f"scheduler.lpm_aging={aging or 0.0}", f"scheduler.max_running_requests={max_running}"]))


def run(requests: list[Request], aging: float | None, in_flight: int, capacity: int,
        max_running: int) -> dict:
    """One run; ``aging`` None: FCFS for reference."""
    a = assembled(aging, capacity, max_running)
    _, result = serve(requests, a.build_cache(capacity, requests), a.scheduler,
                      a.build_executor(capacity), max_in_flight=in_flight)
    return summarize(records_of(result.reqs), ideal=0.0, wall_s=0.0) | {"aging": aging}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--cold", type=float, default=0.2, help="share of cold requests")
    ap.add_argument("--in-flight", type=int, default=120, help="requests queued or running")
    ap.add_argument("--max-running", type=int, default=16, help="scheduler.max_running_requests")
    ap.add_argument("--capacity", type=int, default=200_000, help="KV pool in tokens")
    ap.add_argument("--aging", type=float, nargs="+", default=[0, 256, 1024, 4096])
    args = ap.parse_args()
    requests = workload(args.requests, args.cold)
    print(f"{'lpm_aging':>9} {'hit':>7} {'cold p50':>9} {'cold p99':>9} {'warm p99':>9} "
          f"{'makespan':>9}")
    start = time.time()
    for aging in [*args.aging, None]:
        s = run(requests, aging, args.in_flight, args.capacity, args.max_running)
        name = "fcfs" if aging is None else f"{aging:g}"
        print(f"{name:>9} {s['hit_rate']:7.4f} {s['ttft_p50_cold_s']:8.2f}s "
              f"{s['ttft_p99_cold_s']:8.2f}s {s['ttft_p99_warm_s']:8.2f}s {s['makespan_s']:8.1f}s")
    print(f"({args.requests} requests, {args.cold:.0%} cold, {args.in_flight} in flight, "
          f"{args.max_running} running at most; "
          f"{time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
