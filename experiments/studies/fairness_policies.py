"""FCFS, LPM, LPM with aging and HRRN in the setting of SGLang issue 31954 and PR 32911.

PR 32911 (SGLang's HRRN) reports, on a PD-disaggregated deployment, mean TTFT FCFS 24.2 s, LPM
16.4 s, HRRN 7.48 s and p99 60.5 / 213 / 55.5 s. Here: an open loop (Poisson arrivals at
``--load`` times the rate FCFS sustains in a closed loop of 120 requests), 5% cold requests (1,024
tokens of their own), the rest sharing a 3,072-token system prompt with a 64-token question (a hit
rate of about 96%, as in issue 31954); 64-token outputs; Llama-3-8B on an H100 in the simulator
(roofline costs), 16 running at most, a 200,000-token radix cache. Printed per load and policy:
hit rate, mean and p99 TTFT, the cold requests' p99 TTFT, makespan; ``--figure`` plots mean and
p99 TTFT per policy and load. The requests and runs are `experiments.studies.fairness_setup`.

    python -m experiments.studies.fairness_policies [--figure docs/results/fairness/policies.png]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from experiments import entry, save_figure
from experiments.studies.fairness_setup import hot_cold_requests, open_loop_requests, run_aging, run_policy

POLICIES = [("fcfs", 0.0), ("lpm", 0.0), ("lpm", 1024.0), ("hrrn", 0.0)]


def label(policy: str, aging: float) -> str:
    return f"lpm, lpm_aging={aging:g}" if aging else policy


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r["load"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(POLICIES)
    for k, (policy, aging) in enumerate(POLICIES):
        mine = [next(r for r in rows if r["load"] == x and r["label"] == label(policy, aging))
                for x in loads]
        for ax, key in zip(axes, ("ttft_mean_s", "ttft_p99_s")):
            ax.bar([i + (k - 1.5) * width for i in range(len(loads))], [r[key] for r in mine],
                   width, label=label(policy, aging))
    for ax, title in zip(axes, ("mean TTFT (s)", "p99 TTFT (s)")):
        ax.set_xticks(range(len(loads)), [f"load {x:g}" for x in loads])
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--cold", type=float, default=0.05, help="share of cold requests")
    ap.add_argument("--system", type=int, default=3072, help="tokens of the shared system prompt")
    ap.add_argument("--load", type=float, nargs="+", default=[0.9, 1.0, 1.1],
                    help="arrival rate over the rate FCFS sustains in a closed loop")
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=200_000)
    ap.add_argument("--figure", type=Path)
    args = ap.parse_args()
    start = time.time()
    requests = hot_cold_requests(args.requests, args.cold, system_len=args.system)
    sustained = run_aging(requests, None, 120, args.capacity, args.max_running)["throughput_req_s"]
    print(f"FCFS sustains {sustained:.2f} requests/s (closed loop, 120 in flight)")
    print(f"{'load':>5} {'scheduler':<22} {'hit':>7} {'mean TTFT':>10} {'p99 TTFT':>9} "
          f"{'cold p99':>9} {'makespan':>9}")
    rows = []
    for load in args.load:
        timed = open_loop_requests(requests, load * sustained)
        for policy, aging in POLICIES:
            s = run_policy(timed, policy, aging, args.capacity, args.max_running)
            rows.append(s | {"load": load, "label": label(policy, aging)})
            print(f"{load:5g} {label(policy, aging):<22} {s['hit_rate']:7.4f} "
                  f"{s['ttft_mean_s']:9.2f}s {s['ttft_p99_s']:8.2f}s "
                  f"{s['ttft_p99_cold_s']:8.2f}s {s['makespan_s']:8.1f}s")
    if args.figure:
        plot(rows, args.figure)
    print(f"({args.requests} requests, {args.cold:.0%} cold, {args.system}-token system prompt; "
          f"{time.time() - start:.0f} s)")


if __name__ == "__main__":
    entry(main)
