"""LPM starves cache-cold requests; ``scheduler.lpm_aging`` bounds their wait.

A saturated server (closed loop: ``--in-flight`` requests always queued or running, below LPM's FCFS
fallback at 128 waiting, at most ``--max-running`` of them running) serves a mix of hot requests (a
shared 2,048-token system prompt, a 64-token question) and cold ones (1,024 tokens of their own);
64-token outputs; Llama-3-8B on an H100 in the simulator (roofline costs). LPM always prefers a hot
request (2,048 tokens cached) to a cold one (0), so a cold request waits until no hot one is queued.
Aging adds ``lpm_aging`` tokens to a waiting request's LPM key per second of waiting. Printed per
setting: hit rate, TTFT p50/p99 of cold and warm requests (`testbed.results.metrics`), makespan. The
requests and the run are `experiments.studies.fairness_setup` (tests/test_scheduler_fidelity.py
checks the bound).

    python -m experiments.studies.fairness [--requests 2000] [--cold 0.2] [--in-flight 120]
"""

from __future__ import annotations

import argparse
import time

from experiments.studies.fairness_setup import hot_cold_requests, run_aging


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--cold", type=float, default=0.2, help="share of cold requests")
    ap.add_argument("--in-flight", type=int, default=120, help="requests queued or running")
    ap.add_argument("--max-running", type=int, default=16, help="scheduler.max_running_requests")
    ap.add_argument("--capacity", type=int, default=200_000, help="KV pool in tokens")
    ap.add_argument("--aging", type=float, nargs="+", default=[0, 256, 1024, 4096])
    args = ap.parse_args()
    requests = hot_cold_requests(args.requests, args.cold)
    print(f"{'lpm_aging':>9} {'hit':>7} {'cold p50':>9} {'cold p99':>9} {'warm p99':>9} "
          f"{'makespan':>9}")
    start = time.time()
    for aging in [*args.aging, None]:
        s = run_aging(requests, aging, args.in_flight, args.capacity, args.max_running)
        name = "fcfs" if aging is None else f"{aging:g}"
        print(f"{name:>9} {s['hit_rate']:7.4f} {s['ttft_p50_cold_s']:8.2f}s "
              f"{s['ttft_p99_cold_s']:8.2f}s {s['ttft_p99_warm_s']:8.2f}s {s['makespan_s']:8.1f}s")
    print(f"({args.requests} requests, {args.cold:.0%} cold, {args.in_flight} in flight, "
          f"{args.max_running} running at most; "
          f"{time.time() - start:.0f} s)")


if __name__ == "__main__":
    from experiments import entry
    entry(main)
