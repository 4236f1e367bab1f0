"""The hierarchical-cache study: what a host-DRAM (and SSD) tier under the GPU buys on a real trace.

1. Replay (no time) of the Mooncake conversation trace through the radix cache with a GPU tier of
   ``--gpu-tokens`` (3M) alone, then with host tiers of several sizes under each write policy, and
   with a disk tier below the host: combined hit rate, split by the tier each hit came from.
2. Simulation (Llama-3-8B on one H100, the GPU tier sized from its memory, LPM scheduler,
   roofline cost model): TTFT and makespan GPU-only against GPU+host, with arrivals as recorded and
   stretched by ``--time-scales`` (the recorded rate overloads one GPU, so queueing dominates).

Writes ``replay.csv``, ``sim.csv``, ``tiers.json`` and ``tiers.png`` into ``--out``
(docs/results/tiers/mooncake/), and prints both tables. ``--no-sim`` skips part 2 (a full simulation takes about 30 s per configuration here).

    python -m experiments.studies.tiers [--trace FILE] [--out DIR] [--no-sim] [--limit N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from experiments import MOONCAKE_TRACE, REPO, entry  # noqa: E402
from testbed.config.assembly import Assembly, assemble, compose_config  # noqa: E402
from testbed.results.metrics import add_tier_fields, ideal_hit_rate, summarize  # noqa: E402
from testbed.backends.replay import replay  # noqa: E402
from testbed.serving.serve import records_of, serve  # noqa: E402
from testbed.sim.transfer import make_planner  # noqa: E402

DEFAULT_TRACE = MOONCAKE_TRACE
HIT_KEYS = ["hit_rate", "hit_rate_gpu", "hit_rate_host", "hit_rate_disk"]


SIM = ["backend=sim", "model=llama3_8b", "hardware=h100", "scheduler=lpm"]


def trace_overrides(trace: Path) -> list[str]:
    return ["workload=trace", f"workload.path={trace}", "workload.format=mooncake"]


def tiers(gpu: int | None, host: int = 0, disk: int = 0, policy: str = "write_through"
          ) -> list[str]:
    """The ``cache`` group of one grid point: radix (LRU) with these lower tiers."""
    return ["cache=radix", f"cache.capacity_tokens={'null' if gpu is None else gpu}",
            f"cache.host_tokens={host}", f"cache.disk_tokens={disk}",
            f"cache.write_policy={policy}"]


def build(run: Assembly, requests, gpu: int | None, planned: bool = False):
    """The run's cache of ``gpu`` tokens (tiered when it has lower tiers); ``planned``: with the
    load planner of its model and hardware (the simulator's load-or-recompute choice)."""
    planner = make_planner(run.config["cache"], run.model_shape, run.hardware) \
        if planned and run.has_lower_tiers else None
    return run.build_cache(gpu, requests, planner=planner)


def replay_grid(requests, gpu: int, ideal: float) -> pd.DataFrame:
    grid = [(0, 0, "-")]
    grid += [(host, 0, p) for host in (3_000_000, 10_000_000, 30_000_000)
             for p in ("write_through", "write_through_selective", "write_back")]
    grid += [(10_000_000, 30_000_000, "write_through"), (30_000_000, 100_000_000, "write_through")]
    rows = []
    for host, disk, policy in grid:
        run = assemble(compose_config(["backend=replay",
                                       *tiers(gpu, host, disk, policy if policy != "-"
                                              else "write_through")]))
        cache = build(run, requests, gpu)
        started = time.perf_counter()
        records = replay(requests, cache)
        seconds = time.perf_counter() - started
        s = summarize(records, ideal=ideal, wall_s=seconds)
        rows.append({"gpu_tokens": gpu, "host_tokens": host, "disk_tokens": disk,
                     "write_policy": policy, **{k: s.get(k, s["hit_rate"] if k == "hit_rate_gpu"
                                                   else 0.0) for k in HIT_KEYS},
                     "ideal_hit_rate": ideal, "dropped_tokens": getattr(cache, "dropped", None),
                     "replay_s": seconds})
        print(f"replay gpu={gpu:,} host={host:,} disk={disk:,} {policy}: "
              f"hit {rows[-1]['hit_rate']:.6f} ({seconds:.1f} s)", flush=True)
    return pd.DataFrame(rows)


def sim_grid(requests, time_scales: list[float], host_sizes: list[tuple[int, int]]) -> pd.DataFrame:
    gpu = assemble(compose_config(SIM)).kv_capacity()  # what one H100 leaves for KV
    rows = []
    for scale in time_scales:
        scaled = [dataclasses.replace(r, arrival_s=r.arrival_s * scale) for r in requests]
        for host, disk in host_sizes:
            run = assemble(compose_config(SIM + tiers(gpu, host, disk)))
            cache = build(run, scaled, gpu, planned=True)
            started = time.perf_counter()
            sched, result = serve(scaled, cache, run.scheduler, run.build_executor(gpu))
            records = records_of(result.reqs)
            if cache.lower_tiers:
                add_tier_fields(records, sched.tier_hits)
            s = summarize(records, ideal=0.0, wall_s=time.perf_counter() - started)
            rows.append({"time_scale": scale, "gpu_tokens": gpu, "host_tokens": host,
                         "disk_tokens": disk, "hit_rate": s["hit_rate"],
                         "hit_rate_gpu": s.get("hit_rate_gpu", s["hit_rate"]),
                         "hit_rate_host": s.get("hit_rate_host", 0.0),
                         "hit_rate_disk": s.get("hit_rate_disk", 0.0),
                         "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
                         "e2e_p50_s": s["e2e_p50_s"], "makespan_s": s["makespan_s"],
                         "preemptions": sched.preemptions, "loads": s.get("loads", 0),
                         "load_s_p50": s.get("load_s_p50"), "load_s_p99": s.get("load_s_p99"),
                         "wall_s": s["wall_s"]})
            print(f"sim x{scale} host={host:,} disk={disk:,}: hit {s['hit_rate']:.4f} "
                  f"ttft p50 {s['ttft_p50_s']:.3f} s p99 {s['ttft_p99_s']:.3f} s "
                  f"makespan {s['makespan_s']:.0f} s ({s['wall_s']:.0f} s)", flush=True)
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame, path: Path) -> None:
    df = df[df.write_policy.isin(["-", "write_through", "write_back"])]
    labels = [("GPU only" if r.host_tokens == 0 else
               f"+host {r.host_tokens / 1e6:g}M" + (f"\n+disk {r.disk_tokens / 1e6:g}M"
                                                    if r.disk_tokens else "")
               + f"\n{r.write_policy}") for r in df.itertuples()]
    fig, ax = plt.subplots(figsize=(11, 4))
    bottom = [0.0] * len(df)
    for tier, color in (("gpu", "tab:green"), ("host", "tab:blue"), ("disk", "tab:gray")):
        values = df[f"hit_rate_{tier}"].tolist()
        ax.bar(range(len(df)), values, bottom=bottom, color=color, label=tier)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(df.ideal_hit_rate.iloc[0], color="k", ls="--", lw=1, label="unlimited cache")
    ax.set_xticks(range(len(df)), labels, fontsize=7)
    ax.set_ylabel("hit rate (by tier the hit came from)")
    ax.set_title(f"Mooncake conversation trace, GPU tier {df.gpu_tokens.iloc[0] / 1e6:g}M tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "tiers" / "mooncake")
    ap.add_argument("--gpu-tokens", type=int, default=3_000_000)
    ap.add_argument("--limit", type=int, help="first N requests only")
    ap.add_argument("--no-sim", action="store_true")
    ap.add_argument("--time-scales", type=float, nargs="+", default=[1.0, 5.0])
    args = ap.parse_args()
    requests = assemble(compose_config(["backend=replay", *trace_overrides(args.trace)])
                        ).requests()[: args.limit]  # a file or data:NAME
    args.out.mkdir(parents=True, exist_ok=True)
    ideal = ideal_hit_rate(requests)
    replay_df = replay_grid(requests, args.gpu_tokens, ideal)
    replay_df.to_csv(args.out / "replay.csv", index=False)
    plot(replay_df, args.out / "tiers.png")
    result = {"trace": str(args.trace), "requests": len(requests), "ideal_hit_rate": ideal,
              "replay": replay_df.to_dict("records")}
    print(replay_df[["host_tokens", "disk_tokens", "write_policy", *HIT_KEYS]].to_string(index=False))
    if not args.no_sim:
        # host 4M tokens of Llama-3-8B KV = 512 GiB of DRAM; 30M = 3.75 TiB (the replay's size)
        sim_df = sim_grid(requests, args.time_scales,
                          [(0, 0), (4_000_000, 0), (30_000_000, 0), (4_000_000, 30_000_000)])
        sim_df.to_csv(args.out / "sim.csv", index=False)
        result["sim"] = sim_df.to_dict("records")
        print(sim_df[["time_scale", "host_tokens", "disk_tokens", "hit_rate", "ttft_p50_s",
                      "ttft_p99_s", "makespan_s", "loads", "load_s_p50"]].to_string(index=False))
    (args.out / "tiers.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    entry(main)
