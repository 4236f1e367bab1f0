"""The figures of a sweep report (``python -m testbed.report``), drawn from its results table.

Each figure is drawn only when the table has what it needs, skips failed runs, and has a title,
axes with units and a legend. Figures are plain ``matplotlib.figure.Figure`` objects rendered by
the Agg canvas (PNG), so importing this module leaves pyplot's backend alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import NullFormatter

from testbed.report.table import (
    load_requests, setting_keys, settings, variant_key, variant_parts)

MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
FAMILIES = ["Greys", "Blues", "Oranges", "Greens", "Purples", "Reds"]
DPI = 120


def variants(df: pd.DataFrame) -> list[str]:
    return sorted(df["variant"].unique(), key=variant_key)


def colors(names: list[str]) -> dict[str, tuple]:
    """One colour family per first part of a variant (its cache), shades for the rest."""
    heads = list(dict.fromkeys(n.split("/")[0] for n in names))
    if len(heads) > len(FAMILIES) or len(heads) == len(names):
        cmap = colormaps["tab10" if len(names) <= 10 else "tab20"]
        return {n: cmap(i % cmap.N) for i, n in enumerate(names)}
    out = {}
    for head, family in zip(heads, FAMILIES):
        members = [n for n in names if n.split("/")[0] == head]
        cmap = colormaps[family]
        for i, n in enumerate(members):
            out[n] = cmap(0.4 + 0.5 * (i / (len(members) - 1) if len(members) > 1 else 0.5))
    return out


def new_figure(rows: int, cols: int, size: tuple[float, float]) -> tuple[Figure, np.ndarray]:
    """A constrained-layout figure on an Agg canvas and its grid of axes."""
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False)


def bar_figure(bars: int, per_bar: float = 0.22) -> tuple[Figure, Axes]:
    """A figure of one axes wide enough for ``bars`` bars (``per_bar`` inches each, at least 7)."""
    fig, axes = new_figure(1, 1, (max(7, 1.0 + per_bar * bars), 4.8))
    return fig, axes[0][0]


def save_figure(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as a PNG to ``path`` (creating its folder) and return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


def replicates(runs: pd.DataFrame, value: str) -> pd.DataFrame:
    """``value`` per setting over runs of one variant: ``mean``, ``min``, ``max``, ``count``
    (repeated runs of one config, e.g. engine runs, are replicates: a bar shows their mean and a
    whisker their range)."""
    return runs.dropna(subset=[value]).groupby("setting")[value].agg(
        ["mean", "min", "max", "count"])


def _grouped_bars(ok: pd.DataFrame, value: str, ax, marker: Callable | None = None) -> None:
    names, groups = variants(ok), settings(ok)
    col = colors(names)
    width = 0.8 / len(names)
    for j, v in enumerate(names):
        runs = replicates(ok[ok["variant"] == v], value)
        xs = [i for i, s in enumerate(groups) if s in runs.index]
        got = runs.loc[[groups[x] for x in xs]]
        spread = (got["mean"] - got["min"], got["max"] - got["mean"])
        ax.bar([x - 0.4 + width * (j + 0.5) for x in xs], got["mean"], width, label=v,
               color=col[v], edgecolor="black", linewidth=0.3,
               yerr=spread if (got["count"] > 1).any() else None, capsize=2)
    if marker:
        marker(groups)
    else:  # label the best bar of each group
        for i, s in enumerate(groups):
            means = ok[(ok["setting"] == s) & ok[value].notna()].groupby("variant")[value].mean()
            if len(means):  # the best bar: the highest mean of a variant's replicates
                j, top = names.index(means.idxmax()), means.max()
                ax.annotate(f"{top:.2f}×", (i - 0.4 + width * (j + 0.5), top), ha="center",
                            va="bottom", fontsize="small")
    _setting_axis(ok, ax, groups)


def _setting_axis(ok: pd.DataFrame, ax, groups: list[str]) -> None:
    """The x axis of bars grouped by setting: one tick per setting, named by what varies."""
    only_workload = setting_keys(ok) in ([], ["workload"])
    ax.set_xlabel("workload" if only_workload else "setting")
    ax.set_xticks(range(len(groups)), groups, rotation=20 if len(groups) > 4 else 0,
                  ha="right" if len(groups) > 4 else "center")
    ax.grid(axis="y", alpha=0.3)


def throughput_figure(ok: pd.DataFrame, path: Path) -> Path | None:
    ok = ok[ok["throughput_vs_nocache"].notna()]
    if ok.empty:
        return None
    fig, ax = bar_figure(len(ok))
    _grouped_bars(ok, "throughput_vs_nocache", ax)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="no cache (1×)")
    ax.set_ylabel("throughput relative to no cache (×, requests/s ratio)")
    ax.set_title("Throughput normalised to no cache (cache=none, scheduler=fcfs)")
    fig.legend(loc="outside right upper", title="/".join(variant_parts(ok)), fontsize="small")
    return save_figure(fig, path)


def hit_rate_figure(ok: pd.DataFrame, path: Path) -> Path | None:
    ok = ok[ok["hit_rate"].notna()]
    if ok.empty:
        return None
    fig, ax = bar_figure(len(ok))

    def ideal(groups):
        for i, s in enumerate(groups):
            value = ok.loc[ok["setting"] == s, "ideal_hit_rate"].max()
            ax.hlines(value, i - 0.45, i + 0.45, color="black", linewidth=1.5,
                      label="ideal (unlimited cache, perfect reuse)" if i == 0 else None)
            ax.plot(i, value, marker="v", color="black", markersize=6)

    _grouped_bars(ok, "hit_rate", ax, marker=ideal)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("hit rate (cached / prompt tokens)")
    ax.set_title("Prefix-cache hit rate against the ideal")
    fig.legend(loc="outside right upper", title="/".join(variant_parts(ok)), fontsize="small")
    return save_figure(fig, path)


def cold_warm_figure(ok: pd.DataFrame, path: Path) -> Path | None:
    """TTFT p99 of cache-cold requests (solid bars) beside that of cache-warm ones (hatched), per
    setting and variant: LPM serves warm requests first and can starve cold ones under load."""
    ok = ok[ok["ttft_p99_cold_s"].notna() | ok["ttft_p99_warm_s"].notna()]
    if ok.empty:
        return None
    names, groups = variants(ok), settings(ok)
    col = colors(names)
    fig, ax = bar_figure(len(ok), per_bar=0.44)
    width = 0.8 / len(names)
    for j, v in enumerate(names):
        for k, metric in enumerate(("ttft_p99_cold_s", "ttft_p99_warm_s")):
            got = replicates(ok[ok["variant"] == v], metric)["mean"]  # replicates: their mean
            xs = [i for i, s in enumerate(groups) if s in got.index]
            warm = k == 1  # hatched in the variant's colour, so dark colours still show it
            ax.bar([x - 0.4 + width * (j + 0.25 + 0.5 * k) for x in xs],
                   [got[groups[x]] for x in xs], width / 2, label=None if warm else v,
                   color="white" if warm else col[v], hatch="//" if warm else None,
                   edgecolor=col[v] if warm else "black", linewidth=0.8 if warm else 0.3)
    values = ok[["ttft_p99_cold_s", "ttft_p99_warm_s"]].to_numpy(dtype=float)
    pos = values[values > 0]
    if len(pos) and pos.max() / pos.min() > 100:  # a starved cold p99 dwarfs the warm one
        ax.set_yscale("log")
    _setting_axis(ok, ax, groups)
    ax.set_ylabel("TTFT p99 (s)")
    ax.set_title("TTFT p99: cache-cold vs cache-warm requests")
    handles, labels = ax.get_legend_handles_labels()
    handles += [Patch(facecolor="grey", edgecolor="black", linewidth=0.3),
                Patch(facecolor="white", edgecolor="grey", hatch="//")]
    labels += ["cold: hit < half the prompt", "warm: the rest"]
    fig.legend(handles, labels, loc="outside right upper", title="/".join(variant_parts(ok)),
               fontsize="small")
    return save_figure(fig, path)


def _capacity(ok: pd.DataFrame) -> pd.Series:
    """The cache size a run had: the configured one, else the one derived from model + hardware."""
    cap = pd.to_numeric(ok["capacity_tokens"], errors="coerce")
    if "kv_capacity_tokens" in ok:
        cap = cap.fillna(pd.to_numeric(ok["kv_capacity_tokens"], errors="coerce"))
    return cap


def _tokens(n: float) -> str:
    """A token count for an axis: 2k, 1.5M."""
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n:g}"


def capacity_figure(ok: pd.DataFrame, path: Path) -> Path | None:
    ok = ok.assign(capacity=_capacity(ok)).dropna(subset=["capacity", "hit_rate"])
    if ok["capacity"].nunique() < 2:
        return None
    keys = ["workload", *(k for k in setting_keys(ok)
                          if k not in ("workload", "capacity_tokens", "kv_capacity_tokens"))]
    ok = ok.assign(panel=ok[keys].astype(str).agg(" · ".join, axis=1))
    panels = list(dict.fromkeys(ok.sort_values(keys, kind="stable")["panel"]))
    fig, axes = new_figure(1, len(panels), (4.2 * len(panels) + 1.5, 4))
    names = sorted(ok["variant"].unique(), key=variant_key)
    col = colors(names)
    for ax, panel in zip(axes[0], panels):
        p = ok[ok["panel"] == panel]
        for i, v in enumerate(names):
            line = p[p["variant"] == v].sort_values("capacity")
            if not line.empty:  # markers differ so that lines on top of each other still show
                ax.plot(line["capacity"], line["hit_rate"], marker=MARKERS[i % len(MARKERS)],
                        color=col[v], label=v, alpha=0.85)
        ax.axhline(p["ideal_hit_rate"].max(), color="black", linestyle="--", linewidth=0.8,
                   label="ideal (unlimited)")
        if p["capacity"].max() / max(p["capacity"].min(), 1) >= 10:
            ax.set_xscale("log")
            ticks = sorted(p["capacity"].unique())
            ax.set_xticks(ticks, [_tokens(t) for t in ticks], rotation=45 if len(ticks) > 6 else 0)
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(title=panel, xlabel="cache capacity (tokens)",
               ylabel="hit rate (cached / prompt tokens)", ylim=(0, 1.05))
        ax.grid(alpha=0.3)
    return finish_figure(fig, axes[0][0], ok, "Hit rate vs cache capacity", path)


def finish_figure(fig: Figure, legend_from: Axes, ok: pd.DataFrame, title: str,
                  path: Path) -> Path:
    """One legend for the figure (the variants, from one panel), its title, and save it."""
    handles, labels = legend_from.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", title="/".join(variant_parts(ok)),
               fontsize="small")
    fig.suptitle(title)
    return save_figure(fig, path)


def latency_cdf_figure(ok: pd.DataFrame, root: Path, path: Path) -> Path | None:
    groups, names = settings(ok), variants(ok)
    lat = {(s, v): load_requests(root, run) for s, v, run in ok[["setting", "variant", "run"]]
           .itertuples(index=False)}
    if all(d["e2e_s"].dropna().empty for d in lat.values()):
        return None
    fig, axes = new_figure(2, len(groups), (3.6 * len(groups) + 1.8, 6.4))
    col = colors(names)
    for row, (metric, what) in enumerate([("ttft_s", "TTFT"), ("e2e_s", "end-to-end latency")]):
        for ax, s in zip(axes[row], groups):
            values = [d[metric].dropna() for (gs, _), d in lat.items() if gs == s]
            pos = np.concatenate([v[v > 0].to_numpy() for v in values] or [np.array([])])
            for v in names:
                d = lat.get((s, v))
                x = np.sort(d[metric].dropna().to_numpy()) if d is not None else np.array([])
                if len(x):
                    ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", color=col[v],
                            label=v)
            if len(pos) and pos.max() / pos.min() > 100:
                ax.set_xscale("log")
            ax.set(title=f"{s}: {what}" if row == 0 else what, xlabel=f"{what} (s)",
                   ylabel="fraction of requests", ylim=(0, 1.02))
            ax.grid(alpha=0.3)
    return finish_figure(fig, axes[0][0], ok, "Latency CDFs per request (TTFT top, end-to-end bottom)", path)


def load_figure(ok: pd.DataFrame, path: Path) -> Path | None:
    ok = ok.assign(rate=pd.to_numeric(ok["arrival_rate"], errors="coerce")).dropna(subset=["rate"])
    if ok["rate"].nunique() < 2 or ok["e2e_p50_s"].isna().all():
        return None
    keys = [k for k in setting_keys(ok) if k not in ("arrival_rate", "arrival_kind")]
    ok = ok.assign(line=ok["variant"] + (" · " + ok[keys].astype(str).agg(" · ".join, axis=1)
                                         if keys else ""))
    names = sorted(ok["line"].unique(), key=variant_key)
    col = colors(names)
    fig, grid = new_figure(1, 2, (11, 4.2))
    axes = grid[0]
    for ax, (metric, what) in zip(axes, [("ttft", "TTFT"), ("e2e", "end-to-end latency")]):
        for n in names:
            line = ok[ok["line"] == n].sort_values("rate")
            ax.plot(line["rate"], line[f"{metric}_p50_s"], marker="o", color=col[n],
                    label=f"{n} p50")
            ax.plot(line["rate"], line[f"{metric}_p99_s"], marker="^", linestyle="--",
                    color=col[n], label=f"{n} p99")
        ax.set_yscale("log")
        ax.set(title=f"{what} vs load", xlabel="arrival rate (programs/s)", ylabel=f"{what} (s)")
        ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize="small",
               title="/".join(variant_parts(ok)) + " (p50 —, p99 --)")
    fig.suptitle("Latency vs offered load")
    return save_figure(fig, path)


def make_figures(df: pd.DataFrame, root: Path, figdir: Path) -> list[tuple[Path, str]]:
    """Every figure the table supports, as (png path, title)."""
    ok = df[df["status"] == "ok"]
    if ok.empty:
        return []
    made = [
        (throughput_figure(ok, figdir / "throughput_vs_nocache.png") if
         "throughput_vs_nocache" in ok else None, "Throughput normalised to no cache"),
        (hit_rate_figure(ok, figdir / "hit_rate.png"), "Hit rate against the ideal"),
        (capacity_figure(ok, figdir / "hit_rate_vs_capacity.png"), "Hit rate vs capacity"),
        (latency_cdf_figure(ok, root, figdir / "latency_cdf.png") if "ttft_p50_s" in ok
         else None, "Latency CDFs"),
        (load_figure(ok, figdir / "latency_vs_load.png") if "e2e_p50_s" in ok else None,
         "Latency vs load"),
        (cold_warm_figure(ok, figdir / "ttft_cold_vs_warm.png") if "ttft_p99_cold_s" in ok
         else None, "TTFT p99: cache-cold vs cache-warm requests"),
    ]
    return [(p, t) for p, t in made if p is not None]
