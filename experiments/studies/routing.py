"""The routing study: every router policy on N data-parallel replicas, two workloads.

(a) ``chat``: ``workload=chat_tenants`` (conf/workload/chat_tenants.yaml): 16 tenants with their
    own 2,048-token system prompts (tenant popularity Zipf-skewed, so cache affinity alone would
    pile the hot tenant onto one replica), here 1,024 sessions of 6 turns whose prompts carry the
    whole history (questions of 128-512 tokens, answers of 64-256), sessions arriving as a
    Poisson process (16/s), 5 s of think time between turns;
(b) ``mooncake``: the Mooncake conversation trace beside the repository at its own timestamps
    (12,031 requests over an hour), optionally truncated (``--trace-limit``) or time-scaled
    (``--time-scale``).

Each run is `testbed.serving.cluster.simulate_cluster`: Llama-3-8B on H100s by default (roofline
cost model, a radix cache of the KV capacity one H100 holds per replica, LPM scheduler). The
policies are the five routers at their config defaults (imbalance in SGLang's units, 32 requests)
plus cache_aware's imbalance rule on outstanding tokens at two thresholds. Prints a table per
workload (hit rate, throughput, TTFT, imbalance, router decisions, wall time), checks the
acceptance conditions (cache_aware >= 1.2x round_robin's hit rate; its imbalance at most N/2 or
round_robin's; oracle at or above cache_aware), writes ``routing.csv`` into ``--out`` and the
plot (hit rate and imbalance per policy) to ``--plot`` (docs/results/routing/routing.png). About
1 minute for chat and 7 for the whole Mooncake trace on a 2-core machine.

    python -m experiments.studies.routing      # both workloads, 8 replicas
    python -m experiments.studies.routing --workloads chat --replicas 4 --policies round_robin \
        cache_aware cache_aware:cache_threshold=0.3
The Hydra preset ``+experiment=routing`` sweeps router x replicas on the same chat as separate
runs (its ``router=NAME replicas=8`` runs are this study's chat rows for the five routers).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from experiments import MOONCAKE_TRACE, REPO, entry  # noqa: E402
from testbed.config.assembly import assemble, compose_config  # noqa: E402
from testbed.results.metrics import ideal_hit_rate, summarize  # noqa: E402
from testbed.router import ROUTERS  # noqa: E402
from testbed.serving.cluster import cluster_records, simulate_cluster  # noqa: E402
from testbed.workloads.request import Request  # noqa: E402

DEFAULT_TRACE = MOONCAKE_TRACE
# The five policies at their config defaults (the imbalance rule in SGLang's units: 32 requests),
# then cache_aware's rule on outstanding tokens at two thresholds, with the oracle under the same.
POLICIES = [*ROUTERS, "cache_aware:load=tokens,balance_abs_threshold=32768",
            "cache_aware:load=tokens,balance_abs_threshold=8192",
            "oracle:load=tokens,balance_abs_threshold=32768"]


def base_overrides(args) -> list[str]:
    """The run config every policy shares: model, hardware, replicas, seed (the rest: defaults,
    i.e. the roofline cost model, a radix cache with LRU eviction, the LPM scheduler)."""
    return [f"model={args.model}", f"hardware={args.hardware}", f"replicas={args.replicas}",
            f"seed={args.seed}", "backend=sim"]


def router_overrides(spec: str) -> list[str]:
    """``name`` or ``name:key=value,key=value`` -> the ``router`` group's overrides."""
    name, _, rest = spec.partition(":")
    overrides = [f"router={name}"]
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: policy {spec!r}: {item!r} is not key=value")
        overrides.append(f"++router.{key}={value}")
    return overrides


def setup(args):
    """The assembled run without a router choice: its sim executor, a replica's KV capacity
    (what the model leaves of the hardware's memory) and the scheduler config."""
    run = assemble(compose_config(base_overrides(args)))
    capacity = run.kv_capacity()
    return run.build_executor(capacity), capacity, run.scheduler


def run_policy(requests, policy, args, executor, capacity, scheduler_cfg):
    run = assemble(compose_config(base_overrides(args) + router_overrides(policy)))
    router = run.build_router(capacity)
    started = time.perf_counter()
    result = simulate_cluster(requests, lambda events=None: run.build_cache(
                                  capacity, requests, events=events),
                              scheduler_cfg, executor, router, replicas=run.replicas,
                              seed=run.seed, progress=False)
    wall = time.perf_counter() - started
    s = summarize(cluster_records(result), ideal=float("nan"), wall_s=wall,
                  preemptions=result.preemptions)
    per_hit = []
    for rep in result.replicas:
        p = sum(len(r.prompt) for r in rep.reqs)
        per_hit.append(sum(r.cached_tokens or 0 for r in rep.reqs) / p if p else 0.0)
    d = result.decisions
    return {"policy": policy, "replicas": run.replicas, "hit_rate": s["hit_rate"],
            "throughput_req_s": s["throughput_req_s"], "throughput_tok_s": s["throughput_tok_s"],
            "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
            "e2e_p50_s": s["e2e_p50_s"], "makespan_s": s["makespan_s"],
            "imbalance": result.imbalance, "imbalance_unweighted": result.imbalance_unweighted,
            "requests_max_share": max(len(r.reqs) for r in result.replicas) / len(result.reqs),
            "replica_hit_min": min(per_hit), "replica_hit_max": max(per_hit),
            "preemptions": result.preemptions,
            "decisions": " ".join(f"{k}={v}" for k, v in d.items()), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", type=lambda s: s.split(","), default=["chat", "mooncake"])
    ap.add_argument("--policies", nargs="+", default=POLICIES,
                    help="router names, or name:key=value,... for a variant")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--model", default="llama3_8b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--chat-sessions", type=int, default=1024)
    ap.add_argument("--chat-rate", type=float, default=16.0, help="sessions per second (Poisson)")
    ap.add_argument("--chat-zipf", type=float, default=1.0, help="tenant popularity skew")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--trace-limit", type=int, default=None, help="first N requests of the trace")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiplies trace timestamps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "routing")
    ap.add_argument("--plot", type=Path,
                    default=REPO / "docs" / "results" / "routing" / "routing.png")
    ap.add_argument("--from-csv", type=Path, help="report and plot a saved routing.csv, no runs")
    args = ap.parse_args()
    if args.from_csv:
        df = pd.read_csv(args.from_csv)
        report(df, int(df["replicas"].iloc[0]))
        plot(df, args.plot, int(df["replicas"].iloc[0]))
        return

    executor, capacity, scheduler_cfg = setup(args)
    print(f"{args.replicas} replicas of {args.model} on {args.hardware}: KV capacity "
          f"{capacity:,} tokens each; scheduler {scheduler_cfg.name}")
    rows = []
    for workload in args.workloads:
        requests, label = load(workload, args)
        ideal = ideal_hit_rate(requests)
        print(f"\n{label}: {len(requests):,} requests, {sum(len(r.prompt) for r in requests):,} "
              f"prompt tokens, ideal hit rate {ideal:.3f}")
        for policy in args.policies:
            row = run_policy(requests, policy, args, executor, capacity, scheduler_cfg)
            rows.append({"workload": workload, "label": label, "ideal_hit_rate": ideal, **row})
            print(f"  {policy:<50} hit {row['hit_rate']:.3f}  {row['throughput_req_s']:.2f} req/s  "
                  f"ttft p50 {row['ttft_p50_s']:.3f}s  imbalance {row['imbalance']:.2f}  "
                  f"({row['wall_s']:.1f} s)", flush=True)
    df = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "routing.csv", index=False)
    report(df, args.replicas)
    plot(df, args.plot, args.replicas)
    print(f"\nwrote {args.out / 'routing.csv'} and {args.plot}")


def workload_overrides(workload: str, args) -> list[str]:
    """The study's workload as run-config overrides: ``chat`` is ``workload=chat_tenants``
    (conf/workload/chat_tenants.yaml, the +experiment=routing preset's workload) with
    ``--chat-sessions`` sessions arriving at ``--chat-rate`` per second; ``mooncake`` the trace
    at its own timestamps."""
    if workload == "chat":
        return ["workload=chat_tenants", f"workload.num_sessions={args.chat_sessions}",
                f"workload.zipf={args.chat_zipf}", "arrival.kind=poisson",
                f"arrival.rate={args.chat_rate}"]
    if workload == "mooncake":
        return ["workload=trace", f"workload.path={args.trace}", "workload.format=mooncake",
                "arrival.kind=trace", f"arrival.time_scale={args.time_scale}"]
    raise SystemExit(f"error: --workloads takes chat and mooncake; got {workload!r}")


def load(workload: str, args) -> tuple[list[Request], str]:
    """The requests of one workload, as a run config builds them, and their label."""
    requests = assemble(compose_config(base_overrides(args) +
                                       workload_overrides(workload, args))).requests()
    if workload == "chat":
        return requests, (f"multi-tenant chat (16 tenants, Zipf {args.chat_zipf:g}; "
                          f"{args.chat_sessions} sessions x 6 turns, "
                          f"{args.chat_rate:g} sessions/s)")
    if args.trace_limit:
        requests = requests[: args.trace_limit]
    scale = f", time x{args.time_scale:g}" if args.time_scale != 1 else ""
    return requests, f"Mooncake conversation trace ({len(requests):,} requests{scale})"


def report(df: pd.DataFrame, replicas: int) -> None:
    cols = ["policy", "hit_rate", "throughput_req_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s",
            "imbalance", "requests_max_share", "decisions", "wall_s"]
    for label, g in df.groupby("label", sort=False):
        print(f"\n{label} (ideal hit rate {g['ideal_hit_rate'].iloc[0]:.3f})")
        print(g[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        by = g.set_index("policy")
        if not {"round_robin", "cache_aware", "oracle"} <= set(by.index):
            continue
        rr, ca, orc = by.loc["round_robin"], by.loc["cache_aware"], by.loc["oracle"]
        higher = ca.hit_rate >= 1.2 * rr.hit_rate
        bounded = ca.imbalance <= max(replicas / 2, rr.imbalance)
        print(f"  check: cache_aware hit {ca.hit_rate:.3f} = {ca.hit_rate / rr.hit_rate:.2f}x "
              f"round_robin's {rr.hit_rate:.3f} -> {'ok' if higher else 'NOT clearly higher'}")
        print(f"  check: cache_aware imbalance {ca.imbalance:.2f} <= max(N/2 = {replicas / 2:g}, "
              f"round_robin's {rr.imbalance:.2f}) -> {'ok' if bounded else 'NOT bounded'}")
        print(f"  check: oracle hit {orc.hit_rate:.3f} >= cache_aware {ca.hit_rate:.3f} -> "
              f"{'ok' if orc.hit_rate >= ca.hit_rate else 'NO'}")


def short(policy: str) -> str:
    """A plot label: variants on two lines, long keys abbreviated."""
    name, _, rest = policy.partition(":")
    rest = rest.replace("balance_abs_threshold", "abs").replace("load=", "")
    return f"{name}\n{rest}" if rest else name


def plot(df: pd.DataFrame, path: Path, replicas: int) -> None:
    labels = list(dict.fromkeys(df["label"]))
    fig, axes = plt.subplots(2, len(labels), figsize=(6 * len(labels), 7), squeeze=False)
    for j, label in enumerate(labels):
        g = df[df["label"] == label]
        x = np.arange(len(g))
        colors = ["tab:gray" if p.startswith("oracle") else "tab:green" if p.startswith("cache_aware")
                  else "tab:blue" for p in g["policy"]]
        ax = axes[0][j]
        ax.bar(x, g["hit_rate"], color=colors)
        ax.axhline(g["ideal_hit_rate"].iloc[0], color="black", linestyle=":",
                   label=f"one unlimited cache ({g['ideal_hit_rate'].iloc[0]:.2f})")
        for xi, v in zip(x, g["hit_rate"]):
            ax.text(xi, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [short(p) for p in g["policy"]], fontsize=7, rotation=30)
        ax.set_ylim(0, 1.2 * max(g["hit_rate"].max(), g["ideal_hit_rate"].iloc[0]))
        ax.set_ylabel("hit rate (cached / prompt tokens)")
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
        ax = axes[1][j]
        ax.bar(x, g["imbalance"], color=colors)
        for xi, v in zip(x, g["imbalance"]):
            ax.text(xi, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, [short(p) for p in g["policy"]], fontsize=7, rotation=30)
        ax.set_ylim(0, 1.15 * g["imbalance"].max())
        ax.set_ylabel(f"load imbalance (max/mean outstanding tokens; {replicas} = all on one)")
        ax.yaxis.label.set_size(8)
    fig.suptitle(f"Routing across {replicas} data-parallel replicas (simulated)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    entry(main)
