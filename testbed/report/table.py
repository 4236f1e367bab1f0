"""The results table of a sweep report: one row per run dir under a folder.

A run dir is any folder holding ``summary.json`` (or ``failed.json``: a run that failed, kept with
status ``failed`` and its error). Columns: the run's config choices (flattened from
``summary["config"]``; a group's ``target`` when it names a class of your own: backend, workload, cache, scheduler, eviction, capacity_tokens, arrival,
model, hardware, cost model, seed, and any other config key that differs between runs), its summary
figures as written, and derived columns: ``variant`` (the policy choices that vary, e.g.
``radix/lpm``, and the settings of the cache, scheduler and eviction groups that vary, e.g.
``my_policies.LRUK/k=2``), ``setting`` (everything else that varies, e.g. the workload), ``hit_vs_ideal`` and
``throughput_vs_nocache``: ``throughput_req_s`` over that of the ``cache=none, scheduler=fcfs`` run
of the same setting, or of its slowest ``cache=none`` run when there is no fcfs one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd
from tqdm import tqdm

from testbed.errors import BadInput

# The config choices a study sweeps: column name -> dotted key in the composed config.
CHOICES = {
    "backend": "backend.name", "workload": "workload.name", "cache": "cache.name",
    "scheduler": "scheduler.name", "eviction": "eviction.name",
    "capacity_tokens": "cache.capacity_tokens", "arrival_kind": "arrival.kind",
    "arrival_rate": "arrival.rate", "model": "model.name", "hardware": "hardware.name",
    "cost_model": "cost_model.name", "seed": "seed",
}
GROUPS = {k.split(".")[0] for k in CHOICES.values() if k.endswith(".name")}  # config groups
POLICY = ("cache", "scheduler", "eviction")  # what a variant is made of
IGNORED = {"progress", "timeline"}  # config keys that never change results
BASELINE = {"cache": "none", "scheduler": "fcfs"}
# Known option orders (baseline first); other values follow alphabetically.
ORDER = {v: i for i, v in enumerate(
    ["none", "block_hash", "radix", "fcfs", "random", "lof", "lpm", "dfs_weight", "lru", "fifo",
     "lfu"])}


def variant_key(variant: str) -> list:
    """Sort key of a variant label such as ``radix/lpm``: baselines first."""
    return [(ORDER.get(p, len(ORDER)), p) for p in variant.split("/")]


def find_runs(root: Path) -> list[Path]:
    """Run dirs under ``root``: folders with a summary.json or a failed.json, in natural order."""
    dirs = {p.parent for name in ("summary.json", "failed.json") for p in root.rglob(name)}
    return sorted(dirs, key=lambda d: [int(t) if t.isdigit() else t
                                       for t in re.split(r"(\d+)", str(d.relative_to(root)))])


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out |= _flatten(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: node}


def _config_of_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """A flat config guessed from ``key=value`` overrides (a failed run without its config)."""
    flat: dict[str, Any] = {}
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        flat[f"{key}.name" if key in GROUPS else key] = parsed
    return flat


def read_json(path: Path) -> dict[str, Any]:
    """A run file's JSON object; a corrupt one is refused naming the file and where."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BadInput(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None


def load_run(run_dir: Path, root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(row, flat config) of one run dir. The newer of summary.json and failed.json wins."""
    summary_p, failed_p = run_dir / "summary.json", run_dir / "failed.json"
    row: dict[str, Any] = {"run": str(run_dir.relative_to(root)) or "."}
    if summary_p.is_file() and not (failed_p.is_file()
                                    and failed_p.stat().st_mtime > summary_p.stat().st_mtime):
        summary = read_json(summary_p)
        flat = served_config(_flatten(summary.pop("config", None) or {}), summary)
        row |= {"status": "ok", "error": None, "failure": None}
        row |= {k: v for k, v in summary.items()
                if k not in CHOICES and not isinstance(v, (dict, list))}
    else:
        failed = read_json(failed_p)
        config = failed.get("config")
        flat = _flatten(config) if config else _config_of_overrides(failed.get("overrides", []))
        row |= {"status": "failed",
                "error": f"{failed.get('error_type', 'Error')}: {failed.get('message', '')}",
                # internal (a defect) or bad_input; failed.json files older than the kind: unknown
                "failure": failed.get("kind", "unknown")}
    return row, flat


def served_config(flat: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """The flat config as it bears on what ran: a live server's run (``backend=server``) ran the
    server's model (``server_model``) on no preset hardware or cost model, and only such runs
    have ``server.*`` settings (the address differs from machine to machine, not the study); its
    cache, eviction and scheduler are the server's own, whatever the client's config says."""
    if flat.get("backend.name") != "server":
        return {k: v for k, v in flat.items() if not k.startswith("server.")}
    out = {k: v for k, v in flat.items() if not k.startswith(
        ("model.", "hardware.", "cost_model.", "server.url", "cache.", "eviction.", "scheduler."))}
    return out | {"model.name": summary.get("server_model"), "cache.name": "server",
                  "eviction.name": "server", "scheduler.name": "server"}


def _varying_config(flats: list[dict[str, Any]]) -> list[str]:
    """Dotted config keys, beyond CHOICES, whose values differ between runs that picked the same
    option of their group (so workload.num_tasks does not count just because workloads differ)."""
    targets = {f"{group}.target" for group in GROUPS}  # shown in their group's column
    keys = sorted({k for f in flats for k in f} - set(CHOICES.values()) - IGNORED - targets)
    out = []
    for key in keys:
        group = key.split(".")[0]
        seen: dict[Any, set[str]] = {}
        for f in flats:
            if key in f:
                seen.setdefault(f.get(f"{group}.name"), set()).add(json.dumps(f[key], default=str))
        if any(len(v) > 1 for v in seen.values()):
            out.append(key)
    return out


def load_results(root: str | Path, progress: bool | None = None) -> pd.DataFrame:
    """One row per run under ``root``: config choices, status, summary figures, derived columns."""
    root = Path(root)
    dirs = find_runs(root)
    if not dirs:
        raise BadInput(f"no runs under {root} (no summary.json or failed.json found)")
    rows, flats = [], []
    for d in tqdm(dirs, desc="loading runs", unit="run", disable=None if progress is None
                  else not progress):
        row, flat = load_run(d, root)
        rows.append(row)
        flats.append(flat)
    extra = _varying_config(flats)
    for row, flat in zip(rows, flats):
        row |= {col: flat.get(f"{key[:-5]}.target") or flat.get(key) if key.endswith(".name")
                else flat.get(key) for col, key in CHOICES.items()}
        row |= {key: flat.get(key) for key in extra}
    front = ["run", "status", *CHOICES, *extra]
    df = pd.DataFrame(rows)
    df = df[front + [c for c in df.columns if c not in front]]
    df = _with_derived(df)
    return _arrow_safe(df)


def _varies(df: pd.DataFrame, col: str) -> bool:
    return col in df and df[col].astype(str).nunique() > 1


def setting_keys(df: pd.DataFrame) -> list[str]:
    """Columns that tell settings apart: every varying config column except the policy ones."""
    extra = [c for c in df.columns if "." in c and c.split(".")[0] not in POLICY]
    return [c for c in [*CHOICES, *extra] if c not in POLICY and _varies(df, c)]


def settings(df: pd.DataFrame, keys: list[str] | None = None) -> list[str]:
    """Setting labels ordered by their config values (numbers as numbers)."""
    keys = setting_keys(df) if keys is None else keys
    first = df.drop_duplicates("setting")
    if keys:
        first = first.sort_values(keys, kind="stable", na_position="last",
                                  key=lambda c: c if c.dtype != object else c.astype(str))
    return list(first["setting"])


def _label(values: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)
    return " · ".join(fmt(v) if k == "workload" else f"{k}={fmt(v)}" for k, v in values.items())


def variant_parts(df: pd.DataFrame) -> list[str]:
    """The columns a variant label is made of: the policy choices that vary, then the varying
    settings of those groups (e.g. ``eviction.k``); cache/scheduler if nothing varies."""
    own = [c for c in df.columns if "." in c and c.split(".")[0] in POLICY and _varies(df, c)]
    return [c for c in POLICY if _varies(df, c)] + own or ["cache", "scheduler"]


def _variant_label(row: pd.Series) -> str:
    return "/".join(str(v) if "." not in k else f"{k.split('.', 1)[1]}={v}"
                    for k, v in row.items())


def _with_derived(df: pd.DataFrame) -> pd.DataFrame:
    df["variant"] = df[variant_parts(df)].apply(_variant_label, axis=1)
    keys = ["workload", *(k for k in setting_keys(df) if k != "workload")]
    df["setting"] = df[keys].apply(lambda r: _label(r.to_dict()), axis=1)
    if "hit_rate" in df and "ideal_hit_rate" in df:
        df["hit_vs_ideal"] = df["hit_rate"] / df["ideal_hit_rate"]
    df["baseline"] = None
    df["throughput_vs_nocache"] = np.nan
    if "throughput_req_s" not in df:
        return df
    for _, idx in df.groupby("setting").groups.items():
        g = df.loc[idx]
        ok = g[(g["status"] == "ok") & (g["cache"] == "none") & g["throughput_req_s"].notna()]
        if ok.empty:
            continue
        fcfs = ok[ok["scheduler"] == BASELINE["scheduler"]]
        base = (fcfs if len(fcfs) else ok).sort_values("throughput_req_s", kind="stable").iloc[0]
        df.loc[idx, "baseline"] = base["variant"]
        df.loc[idx, "throughput_vs_nocache"] = g["throughput_req_s"] / base["throughput_req_s"]
    return df


def _arrow_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Object columns mixing types (e.g. an override value) become strings, keeping nulls."""
    for col in df.columns:
        if df[col].dtype == object:
            kinds = {type(v) for v in df[col] if v is not None and v == v}
            if len(kinds) > 1:
                df[col] = df[col].map(lambda v: v if v is None or v != v else str(v))
    return df


def load_requests(root: Path, run: str) -> pd.DataFrame:
    """The run's requests with ``ttft_s`` and ``e2e_s`` (served requests only)."""
    path = root / run / "requests.jsonl"
    if not path.is_file() or path.stat().st_size == 0:
        return pd.DataFrame(columns=["ttft_s", "e2e_s"])
    r = pd.read_json(path, lines=True)
    if "aborted" in r:
        r = r[~r["aborted"].astype(bool)]
    for col in ("first_token_s", "finish_s"):
        if col not in r:
            r[col] = np.nan
    return pd.DataFrame({"ttft_s": r["first_token_s"] - r["arrival_s"],
                         "e2e_s": r["finish_s"] - r["arrival_s"]}).astype(float)
