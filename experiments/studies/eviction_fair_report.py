"""Tables and figures of the fair eviction study (`experiments.studies.eviction_fair`): per
workload and capacity, each policy's replay hit rate under 0.5.23 and 0.4.10, its share of the gap
from LRU to the oracle, and its simulated hit rate, TTFT p50/p99 and throughput against LRU's."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from experiments import save_figure  # noqa: E402


def gap_closed(hit: float, lru: float, oracle: float) -> float:
    """(hit − LRU's) / (oracle's − LRU's); NaN where the oracle is not above LRU."""
    return (hit - lru) / (oracle - lru) if oracle > lru else float("nan")


def table(df: pd.DataFrame, workload: str, capacity: int) -> pd.DataFrame:
    """One workload at one capacity: a row per policy."""
    cell = df[(df["workload"] == workload) & (df["capacity_tokens"] == capacity)]
    rep = {rel: cell[(cell["measure"] == "replay") & (cell["release"] == rel)]
           .set_index("eviction")["hit_rate"] for rel in ("0.5.23", "0.4.10")}
    sim = cell[cell["measure"] == "sim"].set_index("eviction")
    new = rep["0.5.23"]
    rows = []
    for policy, hit in new.items():
        row = {"policy": policy, "hit 0.5.23": hit, "hit 0.4.10": rep["0.4.10"].get(policy),
               "gap closed": gap_closed(hit, new.get("lru", float("nan")),
                                        new.get("oracle", float("nan")))}
        if policy in sim.index:
            s, lru = sim.loc[policy], sim.loc["lru"] if "lru" in sim.index else None
            row |= {"sim hit": s["hit_rate"], "TTFT p50 s": s["ttft_p50_s"],
                    "TTFT p99 s": s["ttft_p99_s"], "tok/s": s["throughput_tok_s"],
                    "tok/s vs lru": (s["throughput_tok_s"] / lru["throughput_tok_s"] - 1
                                     if lru is not None else float("nan"))}
        rows.append(row)
    return pd.DataFrame(rows)


def fmt(value, column: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "—"
    if column in ("gap closed", "tok/s vs lru"):
        return f"{value:+.1%}"
    if column == "tok/s":
        return f"{value:,.0f}"
    if column.startswith("TTFT"):
        return f"{value:.3g}"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def markdown(t: pd.DataFrame) -> str:
    cols = list(t.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, row in t.iterrows():
        lines.append("| " + " | ".join(fmt(row[c], c) for c in cols) + " |")
    return "\n".join(lines)


def write_report(df: pd.DataFrame, path: Path, trained_on: tuple[str, int]) -> None:
    """Every workload at every capacity, as markdown tables."""
    out = [f"# Fair eviction study: tables\n\nThe transferred model (`learned@conversation`) "
           f"was trained on {trained_on[0]} at {trained_on[1]:,} tokens (0.5.23).\n"]
    for workload in dict.fromkeys(df["workload"]):
        for capacity in sorted(set(df.loc[df["workload"] == workload, "capacity_tokens"])):
            out.append(f"\n## {workload}, {capacity:,} tokens\n\n{markdown(table(df, workload, capacity))}\n")
    path.write_text("".join(out))


def plot(df: pd.DataFrame, out: Path) -> None:
    """hit_rate.png: replay hit rate (0.5.23) against capacity, a panel per workload;
    throughput.png: simulated throughput relative to LRU's, a panel per workload."""
    names = list(dict.fromkeys(df["workload"]))
    for measure, y, fname, label in (
            ("replay", "hit_rate", "hit_rate.png", "hit rate (replay, SGLang 0.5.23's rules)"),
            ("sim", "throughput_tok_s", "throughput.png", "throughput / LRU's (simulated)")):
        part = df[(df["measure"] == measure) & (df["release"] == "0.5.23")]
        if part.empty:
            continue
        fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4), squeeze=False)
        colors = {p: f"C{i}" for i, p in enumerate(dict.fromkeys(df["eviction"]))}
        for ax, name in zip(axes[0], names):
            w = part[part["workload"] == name]
            lru = w[w["eviction"] == "lru"].set_index("capacity_tokens")[y]
            for policy, g in w.groupby("eviction", sort=False):
                g = g.sort_values("capacity_tokens")
                values = g[y] if measure == "replay" else \
                    g[y].to_numpy() / g["capacity_tokens"].map(lru).to_numpy()
                style = dict(color="black", linewidth=2) if policy == "oracle" else \
                    dict(color=colors[policy], linewidth=2.2 if policy.startswith("learned")
                         else 1, linestyle="--" if policy == "learned@conversation" else "-")
                ax.plot(g["capacity_tokens"], values, marker="o", markersize=3, label=policy,
                        **style)
            ax.set_xscale("log")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("capacity (tokens)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].set_ylabel(label)
        axes[0][-1].legend(fontsize=7)
        save_figure(fig, out / fname)
        plt.close(fig)
