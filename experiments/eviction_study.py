"""The eviction study in one process: hit rate against cache capacity, one line per policy.

Replays a workload (default: the Mooncake conversation trace beside the repository) through the
radix cache for every eviction policy at every capacity, with the oracle (Belady's bound) and the
unlimited-cache ideal as reference lines. Writes ``eviction.csv`` and ``eviction.png`` into
``--out`` and prints the table at ``--report-capacity`` with each policy's fraction of the oracle
and replay time relative to LRU. The Hydra preset ``+experiment=eviction`` runs the same grid as
separate jobs.

    python experiments/eviction_study.py [--trace FILE --format mooncake] [--out DIR]
    python experiments/eviction_study.py --workload chat     # a generated workload instead
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from tqdm import tqdm  # noqa: E402

from testbed.assembly import assemble, compose_config  # noqa: E402
from testbed.cache import EVICTION  # noqa: E402
from testbed.metrics import ideal_hit_rate  # noqa: E402
from testbed.replay import replay  # noqa: E402

DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
CAPACITIES = [250_000, 500_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000, 10_000_000,
              20_000_000, 50_000_000]


def workload_overrides(args) -> list[str]:
    """The workload of the study as config overrides: a generated one, or the trace file."""
    if args.workload:
        return [f"workload={args.workload}"]
    return ["workload=trace", f"workload.path={args.trace}", f"workload.format={args.format}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--format", default="mooncake")
    ap.add_argument("--workload", help="a generated workload name instead of a trace")
    ap.add_argument("--capacities", type=lambda s: [int(float(x)) for x in s.split(",")],
                    default=CAPACITIES)
    ap.add_argument("--policies", type=lambda s: s.split(","), default=list(EVICTION))
    ap.add_argument("--report-capacity", type=int, default=3_000_000)
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "eviction")
    ap.add_argument("--replot", action="store_true", help="redraw from --out/eviction.csv only")
    args = ap.parse_args()
    if args.replot:
        df = pd.read_csv(args.out / "eviction.csv")
        plot(df, df["ideal_hit_rate"].iloc[0], df["workload"].iloc[0], args.out / "eviction.png")
        report(df, args.report_capacity)
        return

    # one run config per policy (eviction=NAME; the default cache, radix, and for GDSF's recompute
    # cost the default model and hardware), each built by the assembly step
    runs = {policy: assemble(compose_config([*workload_overrides(args), f"eviction={policy}",
                                             "backend=replay"]))
            for policy in args.policies}
    requests = next(iter(runs.values())).requests()
    name = args.workload or args.trace.stem
    prompt = sum(len(r.prompt) for r in requests)
    ideal = ideal_hit_rate(requests)
    rows = []
    grid = [(p, c) for c in args.capacities for p in args.policies]
    for policy, capacity in tqdm(grid, desc="eviction study", unit="replay"):
        cache = runs[policy].build_cache(capacity, requests)
        started = time.perf_counter()
        records = replay(requests, cache)
        rows.append({"workload": name, "eviction": policy, "capacity_tokens": capacity,
                     "hit_rate": sum(r.cached_tokens for r in records) / prompt,
                     "evicted_tokens": sum(r.evicted_tokens for r in records),
                     "replay_s": time.perf_counter() - started, "ideal_hit_rate": ideal})
    df = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "eviction.csv", index=False)
    plot(df, ideal, name, args.out / "eviction.png")
    report(df, args.report_capacity)
    print(f"wrote {args.out / 'eviction.csv'} and {args.out / 'eviction.png'}")


def plot(df: pd.DataFrame, ideal: float, name: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, g in df.groupby("eviction", sort=False):
        style = dict(color="black", linestyle="--", linewidth=2) if policy == "oracle" else {}
        ax.plot(g["capacity_tokens"] / 1e6, g["hit_rate"], marker="o", markersize=3,
                label=f"{policy} (bound)" if policy == "oracle" else policy, **style)
    ax.axhline(ideal, color="grey", linestyle=":", label=f"unlimited cache ({ideal:.3f})")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (million tokens, log scale)")
    ax.set_ylabel("hit rate (cached / prompt tokens)")
    ax.set_title(f"Hit rate vs capacity per eviction policy\n{name} (radix cache, replay)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(df: pd.DataFrame, capacity: int) -> None:
    at = df[df["capacity_tokens"] == capacity].set_index("eviction")
    if at.empty:
        return
    oracle = at["hit_rate"].get("oracle")
    lru = at.loc["lru"] if "lru" in at.index else None
    print(f"\nat {capacity:,} tokens (ideal {at['ideal_hit_rate'].iloc[0]:.4f}):")
    print(f"{'policy':<16}{'hit rate':>10}{'of oracle':>11}{'vs lru':>9}{'replay s':>10}{'x lru':>7}")
    for policy, row in at.iterrows():
        frac = row["hit_rate"] / oracle if oracle else float("nan")
        rel = row["hit_rate"] / lru["hit_rate"] - 1 if lru is not None else float("nan")
        t = row["replay_s"] / lru["replay_s"] if lru is not None else float("nan")
        print(f"{policy:<16}{row['hit_rate']:>10.4f}{frac:>11.1%}{rel:>+9.1%}{row['replay_s']:>10.2f}{t:>7.2f}")


if __name__ == "__main__":
    main()
