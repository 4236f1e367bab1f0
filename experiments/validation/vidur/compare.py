"""Our simulator against Vidur (MLSys 2024) on the same Azure requests: how far is each cost model?

Vidur (PyPI ``vidur==0.0.26``, CPU only) predicts A100 serving from measured operator profiles; here
it simulates CodeLlama-34B on one TP2 replica of A100s with its vLLM scheduler (at most 128
requests, 4,096 tokens per batch) and a random-forest predictor trained on ``--profile-dir``. Our
simulator runs the same requests with ``model=codellama_34b hardware=a100 cache=none
scheduler=fcfs`` and the same two limits, once per ``--cost-models`` entry. Both see the first
``--requests`` rows of an Azure LLM inference 2023 trace at each arrival-time stretch in
``--scales`` (1 = the recorded rate, 2 = half of it, ...).

Requests are clipped to the 4,096 tokens Vidur's profile covers, identically for both: output :=
min(max(GeneratedTokens, 1), 4095), then prompt := min(max(ContextTokens, 1), 4096 - output)
(Vidur's own rule shortens the prompt; bounding the output first keeps the prompt >= 1).

Metrics, computed from each side's per-request times in the same way: TTFT = first token (the end
of the step that completes the prefill) - arrival; TPOT = (e2e - TTFT) / (output - 1) over requests
with > 1 output token; e2e = finish - arrival; makespan = last finish - first arrival; p50/p90/p99
by ``numpy.percentile`` (linear interpolation). From Vidur's ``request_metrics.csv``: TTFT =
``prefill_e2e_time``, e2e = ``request_e2e_time``, arrival from the input by request id. Vidur's
own ``decode_time_execution_plus_preemption_normalized`` divides by all output tokens (the first
comes from the prefill), so it is not used. Errors are (ours - Vidur) / Vidur.

Vidur pins old dependencies: it gets its own virtual environment in ``--cache-dir`` (pip installs
it once, a few minutes) and runs as a subprocess (`drive`, ``drive.py``) with the four profile CSVs
served as an offline Hugging Face hub cache (``HF_HUB_OFFLINE=1``). A cost model that fails (e.g.
not in this checkout) is reported with its one-line error and the run goes on.

    python -m experiments.validation.vidur [--requests 2000] [--scales 1,2,4] \
        [--cost-models roofline,vidur] [--quick] [--out DIR] [--trace FILE] [--profile-dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from experiments import REPO
from testbed.data import local_path, lookup

VIDUR = "vidur==0.0.26"
PROFILE_FILES = {"compute": ("mlp", "attention"), "network": ("all_reduce", "send_recv")}
# the data folder's copies, where `python -m testbed.data fetch NAME` put them; else none
DEFAULT_PROFILE = local_path(lookup("vidur_a100_codellama34b_tp2"))
DEFAULT_TRACE = local_path(lookup("azure_conv_2023"))
DEFAULT_CACHE = Path.home() / ".cache" / "radix-testbed" / "vidur-0.0.26"
MAX_TOKENS = 4096  # prompt + output: what Vidur's profile and predictor cover
BATCH_CAP = 128
BATCH_TOKENS = 4096
QUANTILES = (50, 90, 99)
METRICS = [f"{m}_p{q}_s" for m in ("ttft", "tpot", "e2e") for q in QUANTILES] + ["makespan_s"]
THREADS = "2"  # a shared 2-core machine: Vidur's random forests and BLAS use at most this many
OURS = ["backend=sim", "workload=trace", "workload.format=azure", "model=codellama_34b",
        "hardware=a100", "cache=none", "scheduler=fcfs",
        f"scheduler.max_running_requests={BATCH_CAP}",
        f"scheduler.max_prefill_tokens={BATCH_TOKENS}", "scheduler.chunked_prefill_size=null",
        "progress=false"]
RF_FAST = {"num_estimators": 250, "max_depth": 16, "min_samples_split": 2, "k_fold_cv_splits": 3}


class Fail(Exception):
    """A problem the user must fix: one line, naming the flag."""


# ---------------------------------------------------------------- inputs
def clipped_requests(trace: Path, n: int) -> pd.DataFrame:
    """The first ``n`` rows of an Azure trace, clipped (module docstring), with arrival seconds."""
    raw = pd.read_csv(trace, nrows=n, dtype={"TIMESTAMP": str})
    missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(raw.columns)
    if missing:
        raise Fail(f"--trace {trace}: not an Azure LLM inference CSV "
                   f"(no {', '.join(sorted(missing))} column)")
    stamps = pd.to_datetime(raw["TIMESTAMP"], format="ISO8601")  # as testbed.workloads.traces
    output = raw["GeneratedTokens"].clip(lower=1, upper=MAX_TOKENS - 1).astype(int)
    prompt = np.minimum(raw["ContextTokens"].clip(lower=1), MAX_TOKENS - output).astype(int)
    return pd.DataFrame({"id": range(len(raw)), "timestamp": raw["TIMESTAMP"],
                         "arrival_s": (stamps - stamps.iloc[0]).dt.total_seconds(),
                         "prompt": prompt, "output": output,
                         "raw_prompt": raw["ContextTokens"], "raw_output": raw["GeneratedTokens"]})


def write_inputs(reqs: pd.DataFrame, folder: Path) -> tuple[Path, Path]:
    """The clipped requests as an Azure CSV (ours) and as Vidur's trace-replay CSV."""
    folder.mkdir(parents=True, exist_ok=True)
    azure, vidur = folder / "requests_azure.csv", folder / "requests_vidur.csv"
    pd.DataFrame({"TIMESTAMP": reqs["timestamp"], "ContextTokens": reqs["prompt"],
                  "GeneratedTokens": reqs["output"]}).to_csv(azure, index=False)
    pd.DataFrame({"Date": "1970-01-01", "Time": reqs["arrival_s"],
                  "PromptTokenCount": reqs["prompt"],
                  "CompletionTokenCount": reqs["output"]}).to_csv(vidur, index=False)
    return azure, vidur


def figures(arrival: np.ndarray, ttft: np.ndarray, e2e: np.ndarray, output: np.ndarray) -> dict:
    """The compared metrics from per-request times (seconds), the same for both simulators."""
    many = output > 1
    series = {"ttft": ttft, "tpot": (e2e - ttft)[many] / (output[many] - 1), "e2e": e2e}
    out = {f"{name}_p{q}_s": float(np.percentile(v, q))
           for name, v in series.items() for q in QUANTILES}
    out["makespan_s"] = float((arrival + e2e).max() - arrival.min())
    return out


# ---------------------------------------------------------------- Vidur
def vidur_python(cache: Path) -> Path:
    """The Python of Vidur's virtual environment in ``cache``, created and installed once."""
    python = cache / "venv" / "bin" / "python"
    check = [str(python), "-c", f"import importlib.metadata as m; "
             f"assert m.version('vidur') == '{VIDUR.split('==')[1]}'"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / "pip.log"
    print(f"installing {VIDUR} into {cache / 'venv'} (once; a few minutes; log {log})")
    with log.open("w") as f:
        for cmd in ([sys.executable, "-m", "venv", str(cache / "venv")],
                    [str(python), "-m", "pip", "install", VIDUR]):
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode:
                raise Fail(f"--cache-dir {cache}: `{' '.join(cmd[-3:])}` failed; see {log}")
    return python


def profile_digest(profile: Path) -> str:
    """SHA-1 over the four profile CSVs: names the offline datasets, so a new profile retrains."""
    files = [f for group in PROFILE_FILES.values() for f in group]
    missing = [f"{f}.csv" for f in files if not (profile / f"{f}.csv").is_file()]
    if missing:
        raise Fail(f"--profile-dir {profile}: missing {', '.join(missing)} (Vidur's A100 "
                   "CodeLlama-34B TP2 operator profile, microsoft/vidur data/profiling/a100)")
    digest = hashlib.sha1()
    for f in files:
        digest.update((profile / f"{f}.csv").read_bytes())
    return digest.hexdigest()


def offline_hub(profile: Path, predictor_dir: Path) -> dict[str, str]:
    """Lay the profile out as the Hugging Face hub cache that Vidur's ``snapshot_download(repo,
    cache_dir=<predictor cache>/profiling_data/<kind>/)`` resolves offline; returns the repo ids."""
    revision = profile_digest(profile)
    configs = {"compute": {"model": "codellama/CodeLlama-34b-Instruct-hf", "device_sku": "a100"},
               "network": {"sku": "a100_dgx"}}
    repos = {}
    for kind, files in PROFILE_FILES.items():
        repo = f"local/a100-codellama34b-tp2-{kind}-{revision[:12]}"
        root = predictor_dir / "profiling_data" / kind / f"datasets--{repo.replace('/', '--')}"
        snapshot = root / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / "main").write_text(revision)
        (snapshot / "config.json").write_text(json.dumps(configs[kind]))
        for name in files:
            target = snapshot / f"{name}.csv.xz"  # the only name Vidur reads
            if not target.exists():
                partial = target.with_suffix(".partial")
                with (profile / f"{name}.csv").open("rb") as src, lzma.open(partial, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                partial.replace(target)
        repos[kind] = repo
    return repos


def vidur_flags(trace: Path, scale: float, repos: dict[str, str], predictor_dir: Path,
                out: Path, rf: str) -> list[str]:
    pred = "--random_forrest_execution_time_predictor_config_"
    flags = {
        "--seed": 0,
        "--replica_config_model_name": "codellama/CodeLlama-34b-Instruct-hf",
        "--replica_config_device": "a100", "--replica_config_network_device": "a100_dgx",
        "--replica_config_tensor_parallel_size": 2, "--replica_config_num_pipeline_stages": 1,
        "--cluster_config_num_replicas": 1,
        "--replica_scheduler_config_type": "vllm",
        "--vllm_scheduler_config_batch_size_cap": BATCH_CAP,
        "--vllm_scheduler_config_max_tokens_in_batch": BATCH_TOKENS,
        "--request_generator_config_type": "trace_replay",
        "--trace_request_generator_config_trace_file": trace,
        "--trace_request_generator_config_date": "1970-01-01",
        "--trace_request_generator_config_prefill_scale_factor": 1,
        "--trace_request_generator_config_decode_scale_factor": 1,
        "--trace_request_generator_config_time_scale_factor": scale,
        "--trace_request_generator_config_max_tokens": MAX_TOKENS,
        "--execution_time_predictor_config_type": "random_forrest",
        f"{pred}model_profiling_dataset": repos["compute"],
        f"{pred}network_profiling_dataset": repos["network"],
        f"{pred}cache_dir": predictor_dir,
        f"{pred}prediction_max_tokens_per_request": MAX_TOKENS,
        f"{pred}num_training_job_threads": THREADS,
        "--metrics_config_output_dir": out,
    }
    if rf == "fast":  # one grid point, 3 folds (~1 min to train) instead of 27 x 10
        flags |= {f"{pred}{k}": v for k, v in RF_FAST.items()}
    args = [str(a) for kv in flags.items() for a in kv]
    return args + ["--no-metrics_config_store_plots", "--no-metrics_config_enable_chrome_trace"]


def run_vidur(python: Path, flags: list[str], folder: Path, reqs: pd.DataFrame) -> dict:
    """One Vidur run into ``folder``: figures, restarts and wall times. Vidur's interpreter runs
    ``drive.py`` by its file path (it imports Vidur only); this package is not there."""
    shutil.rmtree(folder, ignore_errors=True)  # Vidur adds a dated folder per run: keep one
    folder.mkdir(parents=True)
    timings_path, log = folder / "timings.json", folder / "vidur.log"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
                        "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore",
                        "OMP_NUM_THREADS": THREADS, "OPENBLAS_NUM_THREADS": THREADS,
                        "MKL_NUM_THREADS": THREADS}
    started = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run([str(python), str(Path(__file__).with_name("drive.py")),
                             str(timings_path), *flags], cwd=folder, env=env, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - started
    if rc:
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise Fail(f"Vidur failed ({tail[0]}); see {log}")
    timings = json.loads(timings_path.read_text())
    m = pd.read_csv(Path(timings["output_dir"]) / "request_metrics.csv")
    m = m.set_index(m.columns[0]).sort_index()  # the first column is the request id
    if (len(m) != len(reqs) or (m.index.to_numpy() != reqs["id"].to_numpy()).any()
            or (m["request_num_prefill_tokens"].to_numpy() != reqs["prompt"].to_numpy()).any()
            or (m["request_num_decode_tokens"].to_numpy() != reqs["output"].to_numpy()).any()):
        raise Fail(f"Vidur's requests differ from the input; see {timings['output_dir']}")
    scale = float(flags[flags.index("--trace_request_generator_config_time_scale_factor") + 1])
    arrival = reqs["arrival_s"].to_numpy() * scale
    return {**figures(arrival, m["prefill_e2e_time"].to_numpy(), m["request_e2e_time"].to_numpy(),
                      reqs["output"].to_numpy()),
            "preemptions": int(m["request_num_restarts"].sum()), "wall_s": wall,
            "sim_s": timings["loop_s"], "setup_s": timings["setup_s"]}


# ---------------------------------------------------------------- ours
def cost_model_overrides(name: str, profile: Path) -> list[str]:
    overrides = [f"cost_model={name}"]
    if name == "vidur":  # the profile-driven cost model reads the same four CSVs
        overrides.append(f"cost_model.profile_dir={profile}")
    return overrides


def run_ours(trace: Path, scale: float, overrides: list[str], folder: Path,
             reqs: pd.DataFrame) -> dict:
    """One run of ``testbed.run``; raises Fail with its one-line error if it fails."""
    cmd = [sys.executable, "-m", "testbed.run", *OURS, f"workload.path={trace}",
           f"arrival.time_scale={scale}", *overrides, f"hydra.run.dir={folder}"]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                    os.environ.get("PYTHONPATH")])),
                        "OMP_NUM_THREADS": THREADS}
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        lines = [l for l in done.stderr.strip().splitlines() if l.strip()] or ["(no output)"]
        line = next((l for l in reversed(lines) if l.startswith("error: ")), lines[-1])
        raise Fail(line.removeprefix("error: "))
    summary = json.loads((folder / "summary.json").read_text())
    r = pd.read_json(folder / "requests.jsonl", lines=True)
    r["id"] = r["id"].astype(int)
    r = r.set_index("id").sort_index()
    if (len(r) != len(reqs) or (r["prompt_tokens"].to_numpy() != reqs["prompt"].to_numpy()).any()
            or (r["output_tokens"].to_numpy() != reqs["output"].to_numpy()).any()):
        raise Fail(f"our requests differ from the input; see {folder}")
    if not np.allclose(r["arrival_s"].to_numpy(), reqs["arrival_s"].to_numpy() * scale,
                       rtol=1e-12, atol=1e-9):
        raise Fail(f"our arrival times differ from the input's x {scale:g}; see {folder}")
    if r["aborted"].any():
        raise Fail(f"{int(r['aborted'].sum())} requests aborted (never fit the KV cache)")
    arrival = r["arrival_s"].to_numpy()
    return {**figures(arrival, r["first_token_s"].to_numpy() - arrival,
                      r["finish_s"].to_numpy() - arrival, r["output_tokens"].to_numpy()),
            "preemptions": int(summary["preemptions"]), "wall_s": wall,
            "sim_s": summary["wall_s"], "loop_s": summary["timing"]["run_s"],
            "kv_capacity_tokens": summary.get("kv_capacity_tokens")}


# ---------------------------------------------------------------- report
def print_tables(rows: list[dict]) -> None:
    head = (f"{'scale':>5} {'simulator':<16}" + "".join(f"{m.removesuffix('_s'):>10}"
                                                         for m in METRICS))
    print("\nAbsolute (TTFT, e2e, makespan in s; TPOT in ms). wall_s: the whole subprocess; "
          "sim_s: Vidur's event loop, our testbed.run wall_s (trace load + simulation)")
    print(head + f"{'preempt':>8}{'wall_s':>8}{'sim_s':>8}")
    for r in rows:
        if r.get("error"):
            continue
        cells = "".join(f"{r[m] * (1e3 if m.startswith('tpot') else 1):>10.3f}" for m in METRICS)
        print(f"{r['scale']:>5g} {r['simulator']:<16}{cells}{r['preemptions']:>8}"
              f"{r['wall_s']:>8.1f}{r['sim_s']:>8.1f}")
    print("\nError against Vidur, (ours - Vidur) / Vidur")
    print(head)
    for r in rows:
        if r["simulator"] == "vidur":
            continue
        if r.get("error"):
            print(f"{r['scale']:>5g} {r['simulator']:<16} failed: {r['error']}")
            continue
        print(f"{r['scale']:>5g} {r['simulator']:<16}"
              + "".join(f"{r['err_' + m]:>+10.1%}" for m in METRICS))


def ours_rows(scale: float, vidur: dict, azure: Path, cost_models: list[str], profile: Path,
              out: Path, reqs: pd.DataFrame) -> list[dict]:
    """One row per cost model: its figures and error against Vidur's, or why it failed."""
    tag, rows = f"x{scale:g}", []
    for name in cost_models:
        row = {"scale": scale, "simulator": f"ours:{name}", "error": None}
        try:
            ours = run_ours(azure, scale, cost_model_overrides(name, profile),
                            out / "ours" / tag / name, reqs)
            row |= ours | {f"err_{m}": (ours[m] - vidur[m]) / vidur[m] for m in METRICS}
            print(f"{tag}: ours:{name} {ours['wall_s']:.1f} s", flush=True)
        except Exception as e:  # a cost model this checkout lacks, or one that breaks: go on
            row["error"] = str(e) if isinstance(e, Fail) else f"{type(e).__name__}: {e}"
            print(f"{tag}: ours:{name} failed: {row['error']}", flush=True)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.validation.vidur",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="first N rows of the trace")
    ap.add_argument("--scales", default="1,2,4", help="arrival-time stretches, comma-separated")
    ap.add_argument("--cost-models", default="roofline,vidur", help="ours, comma-separated")
    ap.add_argument("--quick", action="store_true", help="300 requests, the first scale only")
    ap.add_argument("--trace", type=Path,
                    default=DEFAULT_TRACE if DEFAULT_TRACE.is_file() else None,
                    help="Azure LLM inference 2023 CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    ap.add_argument("--profile-dir", type=Path,
                    default=DEFAULT_PROFILE if DEFAULT_PROFILE.is_dir() else None,
                    help="Vidur's A100 CodeLlama-34B TP2 profile: mlp/attention/all_reduce/"
                         "send_recv .csv (microsoft/vidur data/profiling/a100)")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                    help="Vidur's virtual environment and trained predictor live here")
    ap.add_argument("--rf", choices=("fast", "full"), default="fast",
                    help="Vidur's random-forest grid: fast = 1 setting, 3 folds (~1 min); "
                         "full = Vidur's default 27 settings x 10 folds (about an hour)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "vs_vidur")
    args = ap.parse_args()
    n = 300 if args.quick else args.requests
    try:
        scales = [float(s) for s in args.scales.split(",")]
    except ValueError:
        print(f"vs_vidur: --scales must be numbers separated by commas, got {args.scales!r}",
              file=sys.stderr)
        return 2
    scales = scales[:1] if args.quick else scales
    cost_models = [c for c in args.cost_models.split(",") if c]
    try:
        if args.profile_dir is None:
            raise Fail("no Vidur profile found: pass --profile-dir DIR (Vidur's A100 "
                       "CodeLlama-34B TP2 mlp, attention, all_reduce, send_recv CSVs) or run "
                       "python -m testbed.data fetch vidur_a100_codellama34b_tp2")
        if args.trace is None or not args.trace.is_file():
            raise Fail(f"no Azure trace {'found' if args.trace is None else f'at {args.trace}'}: "
                       "pass --trace FILE (azure_llm_inference_2023_conv.csv) or run "
                       "python -m testbed.data fetch azure_conv_2023")
        if n < 1 or any(s <= 0 for s in scales):
            raise Fail("--requests and every --scales entry must be > 0")
        cache = args.cache_dir.expanduser()
        predictor_dir = cache / f"predictor-{args.rf}"  # Vidur's model hash omits the grid
        repos = offline_hub(args.profile_dir, predictor_dir)
        python = vidur_python(cache)
        reqs = clipped_requests(args.trace, n)
        out = args.out
        azure, vidur_trace = write_inputs(reqs, out)
        clipped = int(((reqs["prompt"] != reqs["raw_prompt"])
                       | (reqs["output"] != reqs["raw_output"])).sum())
        print(f"{len(reqs)} requests of {args.trace.name} recorded over "
              f"{reqs['arrival_s'].iloc[-1]:.1f} s; {clipped} clipped to {MAX_TOKENS} tokens "
              f"(output <= {MAX_TOKENS - 1}, then prompt <= {MAX_TOKENS} - output); "
              f"arrival stretches {scales}")
        rows = []
        for scale in scales:
            tag, folder = f"x{scale:g}", out / "vidur" / f"x{scale:g}"
            vidur = run_vidur(python, vidur_flags(vidur_trace, scale, repos, predictor_dir,
                                                  folder, args.rf), folder, reqs)
            print(f"{tag}: vidur {vidur['wall_s']:.1f} s (setup {vidur['setup_s']:.1f} s, "
                  f"loop {vidur['sim_s']:.1f} s)", flush=True)
            rows.append({"scale": scale, "simulator": "vidur", **vidur})
            rows += ours_rows(scale, vidur, azure, cost_models, args.profile_dir, out, reqs)
    except Fail as e:
        print(f"vs_vidur: {e}", file=sys.stderr)
        return 2
    print_tables(rows)
    pd.DataFrame(rows).to_csv(out / "vs_vidur.csv", index=False)
    (out / "vs_vidur.json").write_text(json.dumps({
        "requests": len(reqs), "trace": str(args.trace), "scales": scales, "vidur": VIDUR,
        "vidur_rf": args.rf, "profile_dir": str(args.profile_dir),
        "profile_sha1": profile_digest(args.profile_dir), "max_tokens": MAX_TOKENS,
        "clipped_requests": clipped, "ours": OURS, "rows": rows}, indent=2) + "\n")
    print(f"\nresults in {out}/vs_vidur.csv and vs_vidur.json")
    return 0

