"""The eviction study in one process: hit rate against cache capacity, one line per policy.

Replays a workload (default: the Mooncake conversation trace, ``data:mooncake_conversation``)
through the radix cache for every eviction policy at every capacity and every ``--evict-units``
(``cache.evict_unit``: node = SGLang's whole leaves, page = only the tail pages needed; pages of
``--page-size`` tokens), with the oracle (Belady's farthest next use: a reference, not a proven
bound with variable-size entries) and the unlimited-cache ideal as reference lines. Writes
``eviction.csv`` (with ``gap_closed``: the share of the gap from LRU to the oracle a policy closes at
its capacity and unit) and ``eviction.png`` into ``--out`` and prints the table at
``--report-capacity`` with each policy's fraction of the oracle, the gap it closes and its replay
time relative to LRU.

The grid is the Hydra preset's, conf/experiment/eviction.yaml (``+experiment=eviction`` runs it
as separate jobs): its sweep's ``eviction`` policies, ``cache.capacity_tokens`` and
``cache.evict_unit`` values and its trace are this study's defaults, read from that file
(`preset_grid`), so the two cannot drift; ``--policies``, ``--capacities``, ``--evict-units``,
``--trace`` or ``--workload`` override them. Output goes to docs/results/eviction/<name>/ (the
workload's name, ``mooncake`` for the default trace, ``all`` for ``--combine``) unless ``--out``.

    python -m experiments.studies.eviction [--trace FILE|data:NAME --format mooncake] [--out DIR]
    python -m experiments.studies.eviction --workload chat     # a generated workload instead
    python -m experiments.studies.eviction --workload chat --set workload.num_sessions=400
    python -m experiments.studies.eviction --combine docs/results/eviction/*/eviction.csv
        # one figure (a panel per workload) and the table of all cells, into .../eviction/all
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tqdm import tqdm  # noqa: E402

from experiments import REPO, entry  # noqa: E402
from testbed.config.assembly import assemble, compose_config  # noqa: E402
from testbed.config.cli import CONF_DIR  # noqa: E402
from testbed.data.fetch import lookup  # noqa: E402
from testbed.results.metrics import ideal_hit_rate  # noqa: E402
from testbed.backends.replay import replay  # noqa: E402

PRESET = CONF_DIR / "experiment" / "eviction.yaml"
RESULTS = REPO / "docs" / "results" / "eviction"
# the folder under RESULTS of a trace given as data:NAME (others: the workload or file name)
FOLDERS = {"data:mooncake_conversation": "mooncake",
           "data:mooncake_synthetic": "mooncake_synthetic"}


def preset_grid(path: Path = PRESET) -> dict[str, Any]:
    """The grid of ``+experiment=eviction``: its sweep's policies, capacities and evict units,
    and its trace (path and format)."""
    cfg = OmegaConf.load(path)
    sweep = cfg.hydra.sweeper.params

    def values(key: str) -> list[str]:
        return [v.strip() for v in str(sweep[key]).split(",")]

    return {"policies": values("eviction"),
            "capacities": [int(float(c)) for c in values("cache.capacity_tokens")],
            "evict_units": values("cache.evict_unit"),
            "trace": cfg.workload.path, "format": cfg.workload.format}


def default_out(args) -> Path:
    """docs/results/eviction/<name>: ``all`` for --combine, else the workload's or trace's."""
    if args.combine:
        return RESULTS / "all"
    if args.workload:
        return RESULTS / args.workload
    return RESULTS / FOLDERS.get(args.trace, Path(args.trace).stem)


def workload_overrides(args) -> list[str]:
    """The workload of the study as config overrides: a generated one, or the trace file."""
    if args.workload:
        return [f"workload={args.workload}", *args.set]
    return ["workload=trace", f"workload.path={args.trace}", f"workload.format={args.format}",
            *args.set]


def main() -> None:
    grid = preset_grid()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=grid["trace"],
                    help="a trace file, or data:NAME (python -m testbed.data lists them; "
                         "default: the preset's, %(default)s)")
    ap.add_argument("--format", default=grid["format"])
    ap.add_argument("--workload", help="a generated workload name instead of a trace")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for the workload (repeatable), e.g. "
                         "workload.num_sessions=400")
    ap.add_argument("--combine", type=Path, nargs="+", metavar="CSV",
                    help="draw one figure from these studies' eviction.csv into --out and stop")
    ap.add_argument("--capacities", type=lambda s: [int(float(x)) for x in s.split(",")],
                    default=grid["capacities"], help="default: the preset's")
    ap.add_argument("--policies", type=lambda s: s.split(","), default=grid["policies"],
                    help="default: the preset's, %(default)s")
    ap.add_argument("--evict-units", type=lambda s: s.split(","), default=grid["evict_units"],
                    help="cache.evict_unit values (default: the preset's, %(default)s)")
    ap.add_argument("--page-size", type=int, default=1, help="cache.page_size (default 1)")
    ap.add_argument("--report-capacity", type=int, default=3_000_000)
    ap.add_argument("--out", type=Path, help="default: docs/results/eviction/<name>")
    ap.add_argument("--replot", action="store_true", help="redraw from --out/eviction.csv only")
    args = ap.parse_args()
    args.out = args.out or default_out(args)
    if args.combine:
        combine(args.combine, args.out)
        return
    if args.replot:
        df = pd.read_csv(args.out / "eviction.csv")
        plot(with_gap_closed(df), df["ideal_hit_rate"].iloc[0], df["workload"].iloc[0],
             args.out / "eviction.png")
        report(df, args.report_capacity)
        return

    # one run config per policy (eviction=NAME; the default cache, radix, and for GDSF's recompute
    # cost the default model and hardware), each built by the assembly step
    runs = {(policy, unit): assemble(compose_config([
                *workload_overrides(args), f"eviction={policy}", "backend=replay",
                f"cache.page_size={args.page_size}", f"cache.evict_unit={unit}"]))
            for policy in args.policies for unit in args.evict_units}
    requests = next(iter(runs.values())).requests()
    name = " ".join([args.workload or trace_name(args.trace), *args.set])
    prompt = sum(len(r.prompt) for r in requests)
    ideal = ideal_hit_rate(requests)
    rows = []
    grid = [(p, u, c) for c in args.capacities for u in args.evict_units for p in args.policies]
    for policy, unit, capacity in tqdm(grid, desc="eviction study", unit="replay"):
        cache = runs[policy, unit].build_cache(capacity, requests)
        started = time.perf_counter()
        records = replay(requests, cache)
        rows.append({"workload": name, "eviction": policy, "evict_unit": unit,
                     "capacity_tokens": capacity,
                     "hit_rate": sum(r.cached_tokens for r in records) / prompt,
                     "evicted_tokens": sum(r.evicted_tokens for r in records),
                     "replay_s": time.perf_counter() - started, "ideal_hit_rate": ideal})
    df = with_gap_closed(pd.DataFrame(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "eviction.csv", index=False)
    plot(df, ideal, name, args.out / "eviction.png")
    report(df, args.report_capacity)
    print(f"wrote {args.out / 'eviction.csv'} and {args.out / 'eviction.png'}")


def trace_name(trace: str) -> str:
    """The trace file's stem (for data:NAME, the file the data folder holds it as)."""
    if trace.startswith("data:"):
        return Path(lookup(trace[len("data:"):]).filename).stem
    return Path(trace).stem


def with_gap_closed(df: pd.DataFrame) -> pd.DataFrame:
    """``gap_closed`` = (hit − LRU's) / (oracle's − LRU's) at the same capacity and unit (NaN
    without an LRU and an oracle row, or where they are equal)."""
    if "evict_unit" not in df:  # a CSV written before the unit axis
        df = df.assign(evict_unit="node")
    key = ["capacity_tokens", "evict_unit"]
    ref = df.pivot_table(index=key, columns="eviction", values="hit_rate")
    lru = df.set_index(key).index.map(ref["lru"]) if "lru" in ref else float("nan")
    oracle = df.set_index(key).index.map(ref["oracle"]) if "oracle" in ref else float("nan")
    gap = pd.Series(oracle, index=df.index) - pd.Series(lru, index=df.index)
    return df.assign(gap_closed=(df["hit_rate"] - pd.Series(lru, index=df.index))
                     / gap.where(gap > 0))


def plot(df: pd.DataFrame, ideal: float, name: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    if "evict_unit" not in df:
        df = df.assign(evict_unit="node")
    units = list(dict.fromkeys(df["evict_unit"]))
    colors = {p: f"C{i}" for i, p in enumerate(dict.fromkeys(df["eviction"]))}
    for (policy, unit), g in df.groupby(["eviction", "evict_unit"], sort=False):
        style = dict(color="black", linewidth=2) if policy == "oracle" else \
            dict(color=colors[policy])
        label = policy if len(units) == 1 else f"{policy}, {unit}"
        ax.plot(g["capacity_tokens"] / 1e6, g["hit_rate"], marker="o", markersize=3,
                linestyle=":" if unit == "page" else "-", label=label, **style)
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


def combine(paths: list[Path], out: Path) -> None:
    """One figure of several studies (a panel per workload: hit rate against capacity, a line
    per policy, node solid and page dotted) and ``eviction_all.csv`` with every cell's hit rate,
    gap closed, replay time and replay time relative to LRU's in the same cell; prints where a
    policy is above the oracle."""
    df = pd.concat([with_gap_closed(pd.read_csv(p)) for p in paths], ignore_index=True)
    key = ["workload", "capacity_tokens", "evict_unit"]
    at = df.set_index(key).index
    for ref in ("lru", "oracle"):
        cell = df[df["eviction"] == ref].set_index(key)
        df[f"{ref}_hit_rate"] = at.map(cell["hit_rate"])
        if ref == "lru":
            df["replay_x_lru"] = df["replay_s"].to_numpy() / at.map(cell["replay_s"]).to_numpy()
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "eviction_all.csv", index=False)
    above = df[(df["eviction"] != "oracle") & (df["hit_rate"] > df["oracle_hit_rate"])]
    print(f"{len(df)} cells; a policy above the oracle in {len(above)}:")
    if len(above):
        print(above[[*key, "eviction", "hit_rate", "oracle_hit_rate"]].to_string(index=False))
    names = list(dict.fromkeys(df["workload"]))
    colors = {p: f"C{i}" for i, p in enumerate(dict.fromkeys(df["eviction"]))}
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        for (policy, unit), g in df[df["workload"] == name].groupby(["eviction", "evict_unit"],
                                                                    sort=False):
            style = dict(color="black", linewidth=2) if policy == "oracle" else \
                dict(color=colors[policy])
            ax.plot(g["capacity_tokens"] / 1e6, g["hit_rate"], marker="o", markersize=2,
                    linestyle=":" if unit == "page" else "-",
                    label=policy if unit == "node" else None, **style)
        ax.axhline(df.loc[df["workload"] == name, "ideal_hit_rate"].iloc[0], color="grey",
                   linestyle=":")
        ax.set_xscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("capacity (million tokens)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("hit rate (solid: evict_unit=node, dotted: page)")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "eviction_all.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / 'eviction_all.csv'} and {out / 'eviction_all.png'}")


def report(df: pd.DataFrame, capacity: int) -> None:
    df = with_gap_closed(df)
    for unit, g in df[df["capacity_tokens"] == capacity].groupby("evict_unit", sort=False):
        at = g.set_index("eviction")
        oracle = at["hit_rate"].get("oracle")
        lru = at.loc["lru"] if "lru" in at.index else None
        print(f"\nat {capacity:,} tokens, evict_unit={unit} (ideal "
              f"{at['ideal_hit_rate'].iloc[0]:.4f}):")
        print(f"{'policy':<16}{'hit rate':>10}{'of oracle':>11}{'vs lru':>9}{'gap closed':>12}"
              f"{'replay s':>10}{'x lru':>7}")
        for policy, row in at.iterrows():
            frac = row["hit_rate"] / oracle if oracle else float("nan")
            rel = row["hit_rate"] / lru["hit_rate"] - 1 if lru is not None else float("nan")
            t = row["replay_s"] / lru["replay_s"] if lru is not None else float("nan")
            print(f"{policy:<16}{row['hit_rate']:>10.4f}{frac:>11.1%}{rel:>+9.1%}"
                  f"{row['gap_closed']:>12.1%}{row['replay_s']:>10.2f}{t:>7.2f}")


if __name__ == "__main__":
    entry(main)
