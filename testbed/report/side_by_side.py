"""Predicted against measured: a simulated run beside a measured run of the same workload.

A report folder may hold runs of one workload on different backends: the simulator (``sim``,
which predicts) and a live server (``server``) or the engine (``engine``), which measure. Runs
belong together when their ``workload``, ``arrival`` and ``seed`` config agree (nothing else: the
server's cache is the server's, the simulator's hardware is a preset). For each such group that
has a predicted and a measured run, `side_by_side` writes

- ``side_by_side.csv``: one row per run (its backend, hit rate, TTFT, TPOT, e2e, makespan) and,
  for the predicted runs, the relative error of each figure against the group's reference: its
  server run, else its first engine run;
- ``figures/side_by_side_N.png``: TTFT and TPOT distributions per request (CDFs, each run a line)
  and each request's hit (cached over prompt tokens) predicted against measured, requests matched
  by id (a workload generated with one seed gives every backend the same ids).

Per request, TTFT is ``first_token_s - arrival_s`` and TPOT ``(finish_s - first_token_s) /
(output_tokens - 1)`` (requests with at least two output tokens), as the summary computes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from testbed.report.figures import colors, new_figure, save_figure
from testbed.report.table import _flatten, read_json

PREDICTED = ("sim",)
MEASURED = ("server", "engine")  # the reference is the first of these a group has
SAME_WORKLOAD = ("workload.", "arrival.", "seed")  # config keys that make runs comparable
FIGURES = ("hit_rate", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "e2e_p50_s", "makespan_s")


def workload_key(config: dict[str, Any]) -> str:
    """What makes two runs runs of the same workload: their workload, arrival and seed config."""
    flat = _flatten(config)
    return json.dumps({k: v for k, v in sorted(flat.items()) if k.startswith(SAME_WORKLOAD)},
                      default=str)


def request_table(run_dir: Path) -> pd.DataFrame:
    """Per served request: ``id``, ``hit`` (cached over prompt tokens; NaN when the backend did
    not report cached tokens), ``ttft_s``, ``tpot_s`` (NaN under two output tokens)."""
    path = run_dir / "requests.jsonl"
    if not path.is_file() or path.stat().st_size == 0:
        return pd.DataFrame(columns=["id", "hit", "ttft_s", "tpot_s"])
    r = pd.read_json(path, lines=True, dtype={"id": str})
    for flag in ("aborted", "failed"):
        if flag in r:
            r = r[~r[flag].fillna(False).astype(bool)]
    for col in ("first_token_s", "finish_s", "cached_tokens"):
        if col not in r:
            r[col] = np.nan
    cached = pd.to_numeric(r["cached_tokens"], errors="coerce")
    prompt = r["prompt_tokens"].where(r["prompt_tokens"] > 0)
    steps = (r["output_tokens"] - 1).where(r["output_tokens"] > 1)
    return pd.DataFrame({"id": r["id"].astype(str), "hit": cached / prompt,
                         "ttft_s": r["first_token_s"] - r["arrival_s"],
                         "tpot_s": (r["finish_s"] - r["first_token_s"]) / steps})


def groups(df: pd.DataFrame, root: Path) -> list[pd.DataFrame]:
    """The ok runs of ``df`` grouped by workload, each group with a predicted and a measured run
    (predicted runs first, then the reference), in the table's order."""
    ok = df[(df["status"] == "ok") & df["backend"].isin(PREDICTED + MEASURED)]
    if ok.empty:
        return []
    keys = [workload_key(read_json(root / run / "summary.json").get("config") or {})
            for run in ok["run"]]
    out = []
    for _, g in ok.assign(_key=keys).groupby("_key", sort=False):
        measured = [b for b in MEASURED if (g["backend"] == b).any()]
        if not measured or not g["backend"].isin(PREDICTED).any():
            continue
        rank = {b: i for i, b in enumerate([*PREDICTED, *measured])}
        out.append(g.assign(_rank=g["backend"].map(rank)).sort_values("_rank", kind="stable")
                   .drop(columns=["_key", "_rank"]))
    return out


def reference(group: pd.DataFrame) -> pd.Series:
    """The measured run the predictions are checked against: the server's, else the engine's."""
    for backend in MEASURED:
        rows = group[group["backend"] == backend]
        if len(rows):
            return rows.iloc[0]
    raise ValueError("a group without a measured run")


def _label(row: pd.Series) -> str:
    return f"{row['backend']} · {row['run']}"


def comparison_rows(group: pd.DataFrame, index: int) -> list[dict[str, Any]]:
    """The table rows of one group: each run's figures and, for predicted runs, their relative
    error against the reference (None where either side lacks the figure)."""
    ref = reference(group)
    rows = []
    for _, run in group.iterrows():
        row: dict[str, Any] = {"group": index, "workload": run.get("workload"),
                               "backend": run["backend"], "run": run["run"],
                               "reference": run["run"] == ref["run"]}
        for figure in FIGURES:
            value = run.get(figure)
            row[figure] = None if value is None or pd.isna(value) else float(value)
            if run["backend"] in PREDICTED:
                want = ref.get(figure)
                ok = row[figure] is not None and want is not None and not pd.isna(want) \
                    and want != 0
                row[f"{figure}_error"] = (row[figure] - float(want)) / float(want) if ok \
                    else None
        rows.append(row)
    return rows


def _cdf(ax, values: pd.Series, color, label: str) -> None:
    x = np.sort(values.dropna().to_numpy(dtype=float))
    if len(x):
        ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", color=color, label=label)


def side_by_side_figure(group: pd.DataFrame, root: Path, path: Path) -> Path:
    """TTFT and TPOT CDFs per run, and per-request hit predicted against measured."""
    ref = reference(group)
    tables = {run: request_table(root / run) for run in group["run"]}
    labels = [_label(row) for _, row in group.iterrows()]
    col = colors(labels)
    fig, grid = new_figure(1, 3, (15, 4.4))
    ttft_ax, tpot_ax, hit_ax = grid[0]
    for (_, row), label in zip(group.iterrows(), labels):
        t = tables[row["run"]]
        _cdf(ttft_ax, t["ttft_s"], col[label], label)
        _cdf(tpot_ax, t["tpot_s"], col[label], label)
    for ax, what, metric in ((ttft_ax, "TTFT", "ttft_s"), (tpot_ax, "TPOT", "tpot_s")):
        values = pd.concat([t[metric] for t in tables.values()]).dropna()
        values = values[values > 0]
        if len(values) and values.max() / values.min() > 100:  # e.g. one cold start among hits
            ax.set_xscale("log")
        ax.set(title=f"{what} per request", xlabel=f"{what} (s)",
               ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    measured = tables[ref["run"]].set_index("id")["hit"]
    for (_, row), label in zip(group.iterrows(), labels):
        if row["backend"] not in PREDICTED:
            continue
        both = pd.concat([tables[row["run"]].set_index("id")["hit"].rename("p"),
                          measured.rename("m")], axis=1, join="inner").dropna()
        hit_ax.scatter(both["m"], both["p"], s=14, alpha=0.6, color=col[label], label=label)
    hit_ax.plot([0, 1], [0, 1], color="grey", linewidth=0.8, linestyle="--", label="equal")
    hit_ax.set(title="hit per request", xlabel=f"measured ({ref['backend']}) cached / prompt",
               ylabel="predicted cached / prompt", xlim=(-0.02, 1.02), ylim=(-0.02, 1.02))
    hit_ax.grid(alpha=0.3)
    handles, names = ttft_ax.get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=min(len(names), 3),
               fontsize="small")
    fig.suptitle(f"{group['workload'].iloc[0]}: predicted against measured "
                 f"(reference: {_label(ref)})")
    return save_figure(fig, path)


def side_by_side(df: pd.DataFrame, root: Path, out: Path
                 ) -> tuple[pd.DataFrame | None, list[tuple[Path, str]]]:
    """The comparison table (also written to ``out/side_by_side.csv``) and its figures; (None,
    []) when no workload has both a predicted and a measured run."""
    found = groups(df, root)
    if not found:
        return None, []
    rows, figures = [], []
    for i, group in enumerate(found, start=1):
        rows += comparison_rows(group, i)
        path = side_by_side_figure(group, root, out / "figures" / f"side_by_side_{i}.png")
        figures.append((path, f"Predicted against measured: {group['workload'].iloc[0]}"))
    table = pd.DataFrame(rows)
    table.to_csv(out / "side_by_side.csv", index=False)
    return table, figures
