"""The markdown of a sweep report: findings computed from the results table, tables, figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from testbed.report.table import setting_keys, settings, variant_key


def findings(df: pd.DataFrame) -> list[str]:
    """Markdown bullets computed from the table, formatted as the table formats them: per
    setting the best variant (highest throughput; lowest median latency when programs arrive at a
    set rate; highest hit rate without timing), its speedup over no cache, and its hit rate as a
    share of the ideal."""
    ok = df[df["status"] == "ok"]
    has = lambda c: c in ok and ok[c].notna().any()  # noqa: E731
    open_loop = has("e2e_p50_s") and ok["arrival_rate"].notna().all()
    metric, lowest = (("e2e_p50_s", True) if open_loop else ("throughput_req_s", False)
                      if has("throughput_req_s") else ("hit_rate", False))
    lines, wins = [], {}
    for setting in settings(ok):
        g = ok[(ok["setting"] == setting) & ok[metric].notna()]
        if g.empty:
            continue
        g = g.assign(_rank=g["variant"].map(variant_key).map(tuple))  # exact ties: fixed order
        best = g.sort_values([metric, "_rank"], ascending=[lowest, True], kind="stable").iloc[0]
        near = g[metric] <= 1.01 * best[metric] if lowest else g[metric] >= 0.99 * best[metric]
        tied = sorted(g.loc[near & (g["variant"] != best["variant"]), "variant"], key=variant_key)
        if not tied:
            wins[best["variant"]] = wins.get(best["variant"], 0) + 1
        ties = f" (within 1%: {', '.join(f'`{t}`' for t in tied)})" if tied else ""
        hit = (f"its hit rate {best['hit_rate']:.3f} is {100 * best['hit_vs_ideal']:.1f}% of the "
               f"ideal {best['ideal_hit_rate']:.3f}")
        head = f"- **{setting}**: "
        if open_loop:
            lines.append(f"{head}lowest median latency is `{best['variant']}`{ties}: e2e p50 "
                         f"{best['e2e_p50_s']:.3g} s, p99 {best['e2e_p99_s']:.3g} s at "
                         f"{best['throughput_req_s']:.4g} req/s; {hit}.")
        elif metric == "hit_rate":
            lines.append(f"{head}best hit rate is `{best['variant']}`{ties}; {hit}.")
        elif best["throughput_vs_nocache"] == best["throughput_vs_nocache"]:
            lines.append(f"{head}best is `{best['variant']}`{ties} at "
                         f"{best['throughput_vs_nocache']:.2f}× the throughput of "
                         f"`{best['baseline']}`; {hit}.")
        else:
            lines.append(f"{head}best is `{best['variant']}`{ties} at "
                         f"{best['throughput_req_s']:.4g} req/s (no cache=none run to compare); "
                         f"{hit}.")
    if len(lines) > 1 and wins:
        top = max(wins, key=wins.get)
        lines.append(f"- `{top}` is best by more than 1% in {wins[top]} of {len(lines)} settings.")
    elif len(lines) > 1:
        lines.append("- no variant is best by more than 1% in any setting.")
    failed = int((df["status"] == "failed").sum())
    if failed:
        kinds = df.loc[df["status"] == "failed", "failure"].value_counts()
        parts = [f"{kinds[k]} {FAILURE_NAMES.get(k, k)}" for k in FAILURE_ORDER if k in kinds]
        lines.append(f"- {failed} of {len(df)} runs failed ({', '.join(parts)}; status `failed` "
                     "in the table, listed under Failed runs).")
    return lines


# Internal errors are defects of the testbed: listed before refused inputs, which are the user's.
FAILURE_ORDER = ("internal", "unknown", "bad_input")
FAILURE_NAMES = {"internal": "internal errors", "bad_input": "refused inputs",
                 "unknown": "of unknown kind"}


def failures_table(df: pd.DataFrame) -> str:
    """Failed runs, internal errors first, each with its run dir and error."""
    failed = df[df["status"] == "failed"]
    if failed.empty:
        return ""
    rank = {k: i for i, k in enumerate(FAILURE_ORDER)}
    failed = failed.assign(_k=failed["failure"].map(rank).fillna(len(rank)))
    failed = failed.sort_values(["_k", "run"], kind="stable")
    return markdown_table(failed, ["failure", "run", "error"])


FORMATS = {"hit_rate": ".3f", "ideal_hit_rate": ".3f", "hit_vs_ideal": ".1%",
           "throughput_vs_nocache": ".2f", "throughput_req_s": ".4g", "throughput_tok_s": ".4g",
           "makespan_s": ".4g", "ttft_p50_s": ".3g", "ttft_p99_s": ".3g", "ttft_p99_cold_s": ".3g",
           "ttft_p99_warm_s": ".3g", "e2e_p50_s": ".3g", "e2e_p99_s": ".3g", "arrival_rate": "g",
           "tpot_p50_s": ".3g"}
FORMATS |= {f"{k}_error": "+.1%" for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                                            "e2e_p50_s", "makespan_s")}


def _cell(v: Any, fmt: str | None = None) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    if fmt and isinstance(v, (int, float, np.number)) and not isinstance(v, bool):
        return format(v, fmt)
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(df: pd.DataFrame, cols: list[str], names: dict[str, str] | None = None) -> str:
    names = names or {}
    cols = [c for c in cols if c in df]
    head = "| " + " | ".join(names.get(c, c) for c in cols) + " |"
    rule = "|" + "|".join(" --- " for _ in cols) + "|"
    body = ["| " + " | ".join(_cell(v, FORMATS.get(c)) for c, v in zip(cols, row)) + " |"
            for row in df[cols].itertuples(index=False)]
    return "\n".join([head, rule, *body])


def pivot_table(df: pd.DataFrame, value: str) -> str:
    """Variants down, settings across: one figure per cell (ok runs only)."""
    ok = df[df["status"] == "ok"]
    if value not in ok or ok[value].isna().all():
        return ""
    p = ok.pivot_table(index="variant", columns="setting", values=value, aggfunc="first",
                       sort=False)
    p = p.loc[sorted(p.index, key=variant_key), [c for c in settings(ok) if c in p.columns]]
    head = "| variant | " + " | ".join(map(str, p.columns)) + " |"
    rule = "|" + "|".join(" --- " for _ in range(len(p.columns) + 1)) + "|"
    body = ["| " + " | ".join([f"`{v}`"] + [_cell(x, FORMATS.get(value)) for x in row]) + " |"
            for v, row in zip(p.index, p.itertuples(index=False))]
    return "\n".join([head, rule, *body])


def sweep_command(root: Path) -> str | None:
    """The command line of the Hydra multirun that made ``root`` (from its multirun.yaml)."""
    path = root / "multirun.yaml"
    if not path.is_file():
        return None
    try:
        overrides = yaml.safe_load(path.read_text())["hydra"]["overrides"]["task"]
    except (yaml.YAMLError, KeyError, TypeError):
        return None
    return " ".join(["python -m testbed.run -m", *overrides])


def side_by_side_section(table: pd.DataFrame) -> list[str]:
    """The report's lines for `testbed.report.side_by_side`'s table: each figure of each run and,
    for predicted runs, its error against the measured reference."""
    cols = ["group", "workload", "backend", "run", "reference"]
    names: dict[str, str] = {}
    for figure in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "e2e_p50_s",
                   "makespan_s"):
        cols.append(figure)
        if f"{figure}_error" in table and table[f"{figure}_error"].notna().any():
            cols.append(f"{figure}_error")
            names[f"{figure}_error"] = "error"
    return ["## Predicted against measured", "",
            "Runs of one workload (the same `workload`, `arrival` and `seed` config) on the "
            "simulator and on a server or the engine; `error` is the predicted figure's relative "
            "error against the reference run (a server's, else an engine's). Per-request figures "
            "are in `side_by_side.csv` and the figures below.", "",
            markdown_table(table, cols, names), ""]


def write_report(df: pd.DataFrame, root: Path, out: Path, figures: list[tuple[str, str]],
                 side_by_side: pd.DataFrame | None = None) -> Path:
    """report.md in ``out``: findings, tables, predicted against measured (when there are such
    runs), the figures (paths relative to ``out``), all runs."""
    ok = df["status"] == "ok"
    keys = setting_keys(df)
    rank = {v: i for i, v in enumerate(sorted(df["variant"].unique(), key=variant_key))}
    rows = df.assign(_v=df["variant"].map(rank))
    rows = rows.sort_values([*keys, "_v"], kind="stable", na_position="last",
                            key=lambda c: c if c.dtype != object else c.astype(str))
    shown = [*keys, "variant", "status"]
    nums = ["hit_rate", "ideal_hit_rate", "hit_vs_ideal", "throughput_req_s",
            "throughput_vs_nocache", "ttft_p50_s", "ttft_p99_cold_s", "ttft_p99_warm_s",
            "e2e_p50_s", "e2e_p99_s", "preemptions", "error"]
    names = {"hit_vs_ideal": "hit / ideal", "throughput_vs_nocache": "× no cache",
             "throughput_req_s": "req/s", "ideal_hit_rate": "ideal"}
    timed = "throughput_req_s" in df and df["throughput_req_s"].notna().any()
    text = [f"# Sweep report: `{root}`", "",
            f"{len(df)} runs ({int(ok.sum())} ok, {int((~ok).sum())} failed), made by "
            f"`python -m testbed.report {root}`; every figure here is in `results.csv`. "
            "Hit rate is cached over prompt tokens; the ideal is an unlimited cache with perfect "
            "reuse (docs/design.md §3)."
            + (" Throughput is requests per second of (simulated) time; `× no cache` divides it "
               "by the `none/fcfs` run of the same setting (else the slowest `none` run)."
               if timed else ""), "",
            "## Findings", "", *(findings(df) or ["- no successful runs"]), ""]
    if (command := sweep_command(root)) is not None:
        text[2:2] = [f"Sweep: `{command}`.", ""]
    if failures := failures_table(df):
        text += ["## Failed runs", "", failures, ""]
    for value, title in (("throughput_vs_nocache", "Throughput relative to no cache (×)"),
                         ("hit_rate", "Hit rate")):
        table = pivot_table(df, value)
        if table:
            text += [f"## {title}", "", table, ""]
    if side_by_side is not None:
        text += side_by_side_section(side_by_side)
    text += ["## Figures", ""]
    text += [f"![{title}]({rel})\n" for rel, title in figures] or ["(no figure: too little data)",
                                                                     ""]
    nums = [c for c in nums if c in rows and rows[c].notna().any()]
    text += ["## All runs", "", markdown_table(rows, shown + nums, names), ""]
    path = out / "report.md"
    path.write_text("\n".join(text))
    return path
