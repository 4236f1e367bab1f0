"""The live routing study's verdicts: each front beside smg, and a front's throughput beside
another's over the repeats as a paired estimate.

`summary` (a row a workload and front) and `checks` (the acceptance lines) read the table of
runs `experiments.studies.routing_live` writes; `report` prints both.

Each repeat of `experiments.studies.routing_live` runs every front once, back to back on the same
replicas, so a repeat's two runs meet the same machine: the ratio of their throughputs is one
paired sample. Over the repeats: the mean of ``front / rival - 1``, its 95% confidence interval
(Student's t over the repeats, which are independent runs of the same code), and in how many
repeats the front served at least the rival's.

"Not below the rival's" is read as non-inferiority: the interval's lower end is above ``-margin``.
Two fronts that make the same decisions serve the same throughput in expectation, and any one
pair of runs differs by the chance of the run (a chat run's split between the replicas, the
machine's speed), so a zero margin could not be met by a front equal to the rival; the margin
says how large a deficit the repeats rule out. Beside it, the same pairs with each run's
throughput multiplied by its replicas' CPU-clocked step seconds (``engine_busy_s``), over the
repeats in which both runs reached the same hit rate: the same work's step seconds move only with
the machine's speed, so what is left is what the front itself costs (its CPU on the shared cores,
the split of the work between the replicas). A reading beside the verdict, not the verdict: it
leaves out the pairs whose work differed. `pool` joins several studies' tables (their
``routing_live.csv``) into one, each study's repeats numbered after the last's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from scipy import stats

from testbed.errors import BadInput

RIVAL = "smg_cache_aware"
#: the deficit the repeats must rule out, as a share of the rival's throughput (--margin)
MARGIN = 0.02


@dataclass(frozen=True)
class Paired:
    """``front / rival - 1`` over the repeats in which both ran."""

    runs: int
    mean: float
    low: float   # the 95% confidence interval (nan with one run)
    high: float
    led: int     # repeats in which the front's figure was at least the rival's

    def not_below(self, margin: float) -> bool:
        """The interval's lower end is above ``-margin`` (False with one run: no interval)."""
        return not math.isnan(self.low) and self.low > -margin

    def says(self) -> str:
        interval = ("no interval from one run" if math.isnan(self.low)
                    else f"95% CI {self.low:+.1%}..{self.high:+.1%}")
        return f"paired {self.mean:+.1%} ({interval}, {self.runs} runs)"


def paired(table: pd.DataFrame, front: str, rival: str = RIVAL, column: str = "requests_per_s",
           speed: str | None = None) -> Paired | None:
    """``front``'s ``column`` beside ``rival``'s, repeat by repeat (None where no repeat ran
    both). ``speed`` (a column such as ``engine_busy_s``, the replicas' CPU-clocked step
    seconds) multiplies each run's figure first, over the repeats in which the two runs reached
    the same hit rate (to 3 places: the same prefill work beside the same forced outputs): the
    same work's engine seconds grow as the shared machine slows, so the product takes the
    machine's drift out of the pair, and a run that made its engines work more is left out
    rather than hidden."""
    t = table if "repeat" in table.columns else table.assign(repeat=1)
    same_work = None
    if speed is not None:
        if speed not in t.columns or t[speed].isna().all():
            return None
        hits = t.pivot_table(index="repeat", columns="front", values="hit_rate").round(3)
        if front in hits.columns and rival in hits.columns:
            same_work = hits.index[hits[front] == hits[rival]]
        t = t.assign(**{column: t[column] * t[speed]})
    per = t.pivot_table(index="repeat", columns="front", values=column)
    if front not in per.columns or rival not in per.columns:
        return None
    both = per[[front, rival]].dropna()
    if same_work is not None:
        both = both[both.index.isin(same_work)]
    if both.empty:
        return None
    ratio = both[front] / both[rival] - 1.0
    n, mean = len(ratio), float(ratio.mean())
    if n < 2:
        return Paired(n, mean, math.nan, math.nan, int((ratio >= 0).sum()))
    half = float(stats.t.ppf(0.975, n - 1)) * float(ratio.std(ddof=1)) / math.sqrt(n)
    return Paired(n, mean, mean - half, mean + half, int((ratio >= 0).sum()))


def pool(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """Several studies' rows as one study: each table's repeats numbered after the last one's
    (a table without a ``repeat`` column is one repeat)."""
    out, offset = [], 0
    for t in tables:
        t = t if "repeat" in t.columns else t.assign(repeat=1)
        out.append(t.assign(repeat=t["repeat"].astype(int) + offset))
        offset += int(t["repeat"].max())
    return pd.concat(out, ignore_index=True)


def read_studies(paths: list[Path]) -> pd.DataFrame:
    """The ``routing_live.csv`` files (or folders holding one) of earlier studies, pooled."""
    files = [p / "routing_live.csv" if p.is_dir() else p for p in paths]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise BadInput(f"--pooled: no study table at {' '.join(missing)} (give a study's "
                       f"routing_live.csv or the --out folder holding it)")
    return pool([pd.read_csv(f) for f in files])


def runs_of(table: pd.DataFrame) -> int:
    return int(table["repeat"].max()) if "repeat" in table.columns else 1


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """A row a workload and front: how many runs, and the median, least and most of each run's
    hit rate and throughput; the median of the other measured figures; the twin's largest
    error over the runs."""
    rows = []
    for (w, f), t in table.groupby(["workload", "front"], sort=False):
        row = {"workload": w, "front": f, "runs": len(t)}
        for c in ("hit_rate", "requests_per_s"):
            row |= {c: t[c].median(), f"{c}_min": t[c].min(), f"{c}_max": t[c].max()}
        for c in ("ttft_p50_s", "imbalance", "front_cpu_s", "engine_busy_s"):
            if c in t.columns:
                row[c] = t[c].median()
        if "sim_hit_rate" in t.columns and t["sim_hit_rate"].notna().any():
            row["sim_hit_rate_error_max"] = (t.sim_hit_rate - t.hit_rate).abs().max()
            row["sim_requests_per_s_error_max"] = (t.sim_requests_per_s / t.requests_per_s
                                                   - 1).abs().max()
        rows.append(row)
    return pd.DataFrame(rows)


def checks(table: pd.DataFrame, margin: float = MARGIN) -> list[str]:
    """The acceptance lines: beside smg (the medians over the runs when there are several, with
    how many runs each front led in; throughput over repeats as a paired estimate,
    `paired`, "not below" when it rules out a deficit of ``margin``),
    then each run's simulator twin."""
    lines = []
    runs = runs_of(table)
    for w, t in table.groupby("workload"):
        by = t.groupby("front", sort=False)[["hit_rate", "requests_per_s"]].median()
        count = t.groupby("front").size()
        if {"cache_aware", "smg_cache_aware"} <= set(by.index):

            def of(*fronts: str) -> str:
                """Over how many runs the fronts' medians are (nothing for single runs)."""
                n = sorted({int(count[f]) for f in fronts})
                if runs == 1:
                    return ""
                return (f" (median of {n[0]} runs)" if len(n) == 1
                        else f" (medians of {' and '.join(map(str, n))} runs)")

            def led(f: str, column: str, also: tuple[str, ...] = ()) -> str:
                """In how many repeats that ran them all ``f``'s ``column`` was at least the
                others'."""
                if runs == 1:
                    return ""
                per = t.pivot_table(index="repeat", columns="front", values=column)
                per = per[[f, "smg_cache_aware", *also]].dropna()
                rivals = per[["smg_cache_aware", *also]].max(axis=1)
                return f"; at least theirs in {int((per[f] >= rivals).sum())} of {len(per)}"

            ca, smg = by.loc["cache_aware", "hit_rate"], by.loc["smg_cache_aware", "hit_rate"]
            lines.append(f"{w}: cache_aware hit {ca:.3f} >= smg's {smg:.3f}"
                         f"{of('cache_aware', 'smg_cache_aware')}: {ca >= smg}"
                         + led("cache_aware", "hit_rate"))
            if "kv_events" in by.index:
                kv = by.loc["kv_events", "hit_rate"]
                lines.append(f"{w}: kv_events hit {kv:.3f} >= both"
                             f"{of('kv_events', 'cache_aware', 'smg_cache_aware')}: "
                             f"{kv >= max(ca, smg)}"
                             + led("kv_events", "hit_rate", ("cache_aware",)))
            thr = by.loc["smg_cache_aware", "requests_per_s"]
            for f in ("cache_aware", "kv_events"):
                if f not in by.index:
                    continue
                rps = by.loc[f, "requests_per_s"]
                if runs == 1:
                    lines.append(f"{w}: {f} {rps:.2f} req/s >= smg's {thr:.2f}: {rps >= thr}")
                    continue
                p = paired(t, f)  # (repeats: a deficit ruled out, not a lead in one run)
                lines.append(f"{w}: {f} {rps:.2f} req/s beside smg's {thr:.2f}"
                             f"{of(f, 'smg_cache_aware')}; {p.says()}; rules out "
                             f"{margin:.0%} below smg's: {p.not_below(margin)}; at least theirs "
                             f"in {p.led} of {p.runs}")
                q = paired(t, f, speed="engine_busy_s")  # (none behind vLLM: no steps read)
                if q is not None:
                    lines.append(f"{w}: {f} beside smg's with the engines' speed taken out (req/s "
                                 f"× their CPU-clocked step seconds, the repeats in which both "
                                 f"reached the same hit rate): {q.says()}")
        if "sim_hit_rate" not in t.columns:  # vLLM replicas: no simulator twin
            continue
        for _, r in t.iterrows():
            if pd.isna(r.sim_hit_rate):  # a table kept without its twins' columns (--pooled)
                continue
            f = r.front if runs == 1 else f"{r.front} (run {int(r['repeat'])})"
            dh = abs(r.sim_hit_rate - r.hit_rate)
            dt = abs(r.sim_requests_per_s / r.requests_per_s - 1)
            priced = r.get("sim_priced_by")
            lines.append(f"{w}: {f}: simulator's hit rate within 0.03 ({dh:.3f}): {dh <= 0.03}; "
                         f"throughput within 10% ({dt:.1%}): {dt <= 0.10}"
                         + (f" [{priced}]" if isinstance(priced, str) else ""))
            if pd.notna(r.get("sim_hit_rate_min")):
                lo, hi = r.sim_hit_rate_min, r.sim_hit_rate_max
                lines.append(f"{w}: {f}: the jittered twins' hit rates {lo:.3f}..{hi:.3f}; the "
                             f"live {r.hit_rate:.3f} within 0.03 of that range: "
                             f"{lo - 0.03 <= r.hit_rate <= hi + 0.03}")
    return lines


def report(table: pd.DataFrame, margin: float) -> None:
    """The runs, their summary where there are repeats, and the checks, printed."""
    from testbed.report.markdown import markdown_table
    print(markdown_table(table.round(3), list(table.columns)))
    if runs_of(table) > 1:
        medians = summary(table)
        print(markdown_table(medians.round(3), list(medians.columns)))
    print("\n".join(checks(table, margin)))
