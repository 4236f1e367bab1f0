"""Time-series figures of one run, drawn from its ``steps.jsonl`` (docs/design.md §3).

When a report covers a single sim or engine run, ``python -m testbed.report RUN_DIR`` adds:

- ``hit_rate_over_time.png``: the hit rate of the requests first admitted in each time window
  (their hit tokens over their prompt tokens), the cumulative hit rate, and the run's;
- ``kv_over_time.png``: the KV pool stacked: in use by requests, evictable cache, free (per
  replica);
- ``batch_queue_over_time.png``: batch size (decode and prefill steps apart), and the requests
  waiting and running.

Times are simulated seconds; values are averaged over the steps that end in each window (for the
KV pool and the queue a window without steps keeps the last value: nothing changed; batch sizes
have a gap there, and are drawn step by step when there are at most as many steps as windows).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from testbed.report.figures import new_figure, save_figure

HIT_WINDOWS = 50  # windows of the hit-rate figure
GAUGE_WINDOWS = 400  # windows of the gauges' figures


def load_steps(run_dir: Path) -> pd.DataFrame | None:
    """The run's ``steps.jsonl`` as a table (None when it has none, or no steps)."""
    path = run_dir / "steps.jsonl"
    if not path.is_file() or path.stat().st_size == 0:
        return None
    steps = pd.read_json(path, lines=True)
    return steps.assign(end_s=steps["start_s"] + steps["duration_s"])


def windowed_hit_rate(steps: pd.DataFrame, windows: int = HIT_WINDOWS) -> pd.DataFrame:
    """Per window of equal length from the first step's start to the last step's end: the
    prompt and hit tokens of the requests first admitted in it (at a step's start) and their
    ratio (NaN where none was admitted), and the cumulative ratio up to the window's end."""
    t0, t1 = steps["start_s"].min(), steps["end_s"].max()
    width = (t1 - t0) / windows if t1 > t0 else 1.0
    at = np.minimum(((steps["start_s"] - t0) // width).astype(int), windows - 1)
    hit = np.bincount(at, weights=steps["admitted_hit_tokens"], minlength=windows)
    prompt = np.bincount(at, weights=steps["admitted_prompt_tokens"], minlength=windows)
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where(prompt > 0, hit / prompt, np.nan)
        total = np.cumsum(prompt)
        cumulative = np.where(total > 0, np.cumsum(hit) / total, np.nan)
    starts = t0 + width * np.arange(windows)
    return pd.DataFrame({"start_s": starts, "end_s": starts + width, "hit_tokens": hit,
                         "prompt_tokens": prompt, "hit_rate": rate,
                         "cumulative_hit_rate": cumulative})


def binned(steps: pd.DataFrame, columns: list[str], windows: int = GAUGE_WINDOWS,
           span: tuple[float, float] | None = None, hold: bool = True) -> pd.DataFrame:
    """Mean of ``columns`` over the steps ending in each of ``windows`` equal windows of
    ``span`` (default: the steps' own), indexed by the window's middle. A window without steps
    keeps the previous value with ``hold`` (a gauge: nothing changed), else is NaN (a gap)."""
    t0, t1 = span or (steps["start_s"].min(), steps["end_s"].max())
    width = (t1 - t0) / windows if t1 > t0 else 1.0
    at = np.clip(((steps["end_s"] - t0) // width).astype(int), 0, windows - 1)
    count = np.bincount(at, minlength=windows)
    out = {}
    for c in columns:
        sums = np.bincount(at, weights=steps[c].astype(float), minlength=windows)
        with np.errstate(invalid="ignore"):
            out[c] = np.where(count > 0, sums / np.maximum(count, 1), np.nan)
    table = pd.DataFrame(out, index=t0 + width * (np.arange(windows) + 0.5))
    return table.ffill() if hold else table


def hit_rate_over_time_figure(steps: pd.DataFrame, path: Path,
                              run_hit_rate: float | None = None) -> Path | None:
    if steps["admitted_prompt_tokens"].sum() == 0:
        return None
    w = windowed_hit_rate(steps)
    fig, axes = new_figure(1, 1, (9, 4))
    ax = axes[0][0]
    width = w["end_s"].iloc[0] - w["start_s"].iloc[0]
    ax.bar(w["start_s"], w["hit_rate"].fillna(0), width=width, align="edge", color="tab:blue",
           alpha=0.6, label=f"per window of {width:.3g} s (admitted in it)")
    ax.step(w["end_s"], w["cumulative_hit_rate"], where="post", color="black",
            label="cumulative")
    if run_hit_rate is not None:
        ax.axhline(run_hit_rate, color="tab:red", linestyle="--", linewidth=0.8,
                   label=f"run ({run_hit_rate:.3f}, aborted requests included)")
    ax.set(xlabel="time (s, simulated)", ylabel="hit rate (cached / prompt tokens)",
           ylim=(0, 1.05), title="Hit rate over time (requests at their first admission)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return save_figure(fig, path)


def kv_over_time_figure(steps: pd.DataFrame, path: Path) -> Path | None:
    if steps["kv_used_tokens"].isna().all():
        return None  # an unbounded pool: no occupancy to stack
    replicas = sorted(steps["replica"].unique())
    fig, axes = new_figure(len(replicas), 1, (9, 2.8 * len(replicas) + 0.6))
    span = (steps["start_s"].min(), steps["end_s"].max())
    cols = ["kv_used_tokens", "evictable_tokens", "free_tokens"]
    for ax, r in zip(axes[:, 0], replicas):
        g = binned(steps[steps["replica"] == r], cols, span=span)
        ax.stackplot(g.index, *(g[c] for c in cols), step="mid",
                     labels=["in use by requests", "evictable (cached, unprotected)", "free"],
                     colors=["tab:red", "tab:blue", "0.85"])
        ax.set(ylabel="KV (tokens)", xlim=span,
               title=f"replica {r}" if len(replicas) > 1 else None)
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("time (s, simulated)")
    axes[0][0].legend(loc="lower right", fontsize="small")
    fig.suptitle("KV pool occupancy over time")
    return save_figure(fig, path)


def batch_queue_over_time_figure(steps: pd.DataFrame, path: Path) -> Path:
    replicas = sorted(steps["replica"].unique())
    span = (steps["start_s"].min(), steps["end_s"].max())
    fig, axes = new_figure(2, 1, (9, 6))
    top, bottom = axes[0][0], axes[1][0]
    for r in replicas:
        mine = steps[steps["replica"] == r]
        tag = f" (replica {r})" if len(replicas) > 1 else ""
        for kind, style in (("decode", "-"), ("prefill", "none")):
            steps_of = mine[mine["kind"] == kind]
            if len(steps_of) > GAUGE_WINDOWS:  # windows without such a step are gaps
                g = binned(steps_of, ["batch_size"], span=span, hold=False)["batch_size"]
            else:  # few enough to draw each
                g = steps_of.set_index("end_s")["batch_size"]
            if len(g):
                top.plot(g.index, g, linestyle=style, marker="." if style == "none" else None,
                         label=f"{kind} steps{tag}")
        g = binned(mine, ["waiting", "running"], span=span)
        bottom.plot(g.index, g["waiting"], label=f"waiting{tag}")
        bottom.plot(g.index, g["running"], linestyle="--", label=f"running{tag}")
    top.set(ylabel="batch size (requests)", xlim=span,
            title="Batch size (each step, or the mean per window when there are many)")
    bottom.set(ylabel="requests", xlabel="time (s, simulated)", xlim=span,
               title="Queue: waiting for admission, and running")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return save_figure(fig, path)


def timeseries_figures(df: pd.DataFrame, root: Path, figdir: Path) -> list[tuple[Path, str]]:
    """The time-series figures, as (png path, title), when the report covers one successful run
    that wrote steps.jsonl; none otherwise."""
    ok = df[df["status"] == "ok"]
    if len(ok) != 1:
        return []
    row = ok.iloc[0]
    steps = load_steps(root / str(row["run"]))
    if steps is None:
        return []
    hit = row.get("hit_rate")
    made = [
        (hit_rate_over_time_figure(steps, figdir / "hit_rate_over_time.png",
                                   None if pd.isna(hit) else float(hit)),
         "Hit rate over time"),
        (kv_over_time_figure(steps, figdir / "kv_over_time.png"), "KV pool occupancy over time"),
        (batch_queue_over_time_figure(steps, figdir / "batch_queue_over_time.png"),
         "Batch size and queue over time"),
    ]
    return [(p, t) for p, t in made if p is not None]
