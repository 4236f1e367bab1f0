"""The simulator's part of the speed benchmark (`experiments.benchmarks.speed`, ``--part sim``):
the Mooncake conversation trace simulated in a fresh process (its phases and peak memory), and
Vidur 0.0.26's event loop beside our simulator's on the Azure code trace (vs_vidur.md's setup).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from experiments.benchmarks.cells import child, mb, peak_during, status, token_mb
from testbed.workloads.request import Request

MOONCAKE_SIM = ["backend=sim", "model=llama3_8b", "hardware=h100", "workload=trace",
                "workload.path=data:mooncake_conversation", "cache=radix", "scheduler=lpm"]


def sim_cell(overrides: list[str]) -> dict:
    """One simulation in this (fresh) process: its phases' seconds and peak memory."""
    from hydra import compose, initialize_config_dir

    from testbed.config.cli import CONF_DIR
    from testbed.execute import execute

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[*overrides, "progress=false"])
    trace: dict[str, float] = {}

    def loaded(requests: list[Request]) -> None:  # the run's own peak counts from here
        trace["mb"] = (status("VmRSS") - before) / 1024
        trace["tokens_mb"] = token_mb(requests)
        Path("/proc/self/clear_refs").write_text("5")
        trace["rss"] = status("VmRSS")

    with tempfile.TemporaryDirectory() as out:
        before = status("VmRSS")
        seconds, _, _ = peak_during(lambda: execute(cfg, Path(out), loaded=loaded))
        summary = json.loads((Path(out) / "summary.json").read_text())
    return {"seconds": seconds, "trace_loaded_mb": trace["mb"], "trace_mb": trace["tokens_mb"],
            "peak_mb": (status("VmHWM") - trace["rss"]) / 1024, **summary["timing"],
            "requests": summary["num_requests"], "output_tokens": summary["output_tokens"],
            "steps": summary.get("prefill_steps", 0) + summary.get("decode_steps", 0),
            "hit_rate": summary["hit_rate"]}


def part_sim(args) -> list[dict]:
    rows = []
    print(f"\n== simulation: {' '.join(MOONCAKE_SIM)}; fastest of {args.rounds}", flush=True)
    best = None
    for _ in range(args.rounds):
        cell = child(["--cell", "sim", *MOONCAKE_SIM], args.budget)
        if "error" in cell:
            print(f"skipped ({cell['error']})")
            break
        if best is None or cell["seconds"] < best["seconds"]:
            best = cell
    if best is not None:
        rows.append({"part": "sim", "trace": "mooncake", "side": "ours", **best,
                     "requests_per_s": best["requests"] / best["seconds"]})
        print(f"whole run {best['seconds']:.1f} s (load {best['load_s']:.1f}, simulate "
              f"{best['run_s']:.1f}, ideal {best['ideal_s']:.1f}, write {best['write_s']:.1f}); "
              f"{best['requests']:,} requests, {best['output_tokens']:,} tokens decoded in "
              f"{best['steps']:,} steps; the trace's tokens {best['trace_mb']:,.0f} MB, loaded "
              f"+{mb(best['trace_loaded_mb'])}, the run's peak beyond it +{mb(best['peak_mb'])};"
              f" hit rate {best['hit_rate']:.6f}", flush=True)
    rows += vidur_rows(args)
    return rows


def vidur_rows(args) -> list[dict]:
    """Vidur's event loop beside ours on the same clipped requests (vs_vidur.md's setup)."""
    from testbed.data.fetch import DataError, resolve_folder, resolve_trace
    from experiments.validation.vidur import compare as vidur
    print(f"\n== simulation: Vidur 0.0.26 beside ours, the first {args.vidur_requests:,} requests "
          "of the Azure 2023 code trace (CodeLlama-34B, TP2 A100s, cache=none fcfs)", flush=True)
    try:
        trace, _ = resolve_trace("data:azure_code_2023")
        profile = resolve_folder("data:vidur_a100_codellama34b_tp2", "cost_model.profile_dir")
        python = vidur.vidur_python(vidur.DEFAULT_CACHE)
    except (DataError, vidur.Fail) as e:
        print(f"skipped ({e})")
        return []
    work = (args.work / "vidur").resolve()  # Vidur runs in a folder of its own
    reqs = vidur.clipped_requests(trace, args.vidur_requests)
    azure, vidur_csv = vidur.write_inputs(reqs, work / "inputs")
    predictor = vidur.DEFAULT_CACHE / "predictor-fast"  # vs_vidur's, trained once
    repos = vidur.offline_hub(profile, predictor)
    flags = vidur.vidur_flags(vidur_csv, 1.0, repos, predictor, work / "vidur_run", "fast")
    theirs = ours = None
    for _ in range(args.rounds):
        v = vidur.run_vidur(python, flags, work / "vidur_run", reqs)
        o = vidur.run_ours(azure, 1.0, vidur.cost_model_overrides("roofline", profile),
                           work / "ours", reqs)
        theirs = v if theirs is None or v["sim_s"] < theirs["sim_s"] else theirs
        ours = o if ours is None or o["loop_s"] < ours["loop_s"] else ours
    n = len(reqs)
    print(f"Vidur: event loop {theirs['sim_s']:.2f} s ({n / theirs['sim_s']:,.0f} req/s), set-up "
          f"{theirs['setup_s']:.1f} s, whole process {theirs['wall_s']:.1f} s")
    print(f"ours:  simulation loop {ours['loop_s']:.2f} s ({n / ours['loop_s']:,.0f} req/s), "
          f"whole process {ours['wall_s']:.1f} s; loop {theirs['sim_s'] / ours['loop_s']:.2f}x "
          "Vidur's speed", flush=True)
    return [{"part": "sim", "trace": "azure_code", "side": "vidur", "requests": n,
             "seconds": theirs["sim_s"], "requests_per_s": n / theirs["sim_s"],
             "setup_s": theirs["setup_s"], "whole_s": theirs["wall_s"]},
            {"part": "sim", "trace": "azure_code", "side": "ours", "requests": n,
             "seconds": ours["loop_s"], "requests_per_s": n / ours["loop_s"],
             "whole_s": ours["wall_s"], "vs_vidur": ours["loop_s"] / theirs["sim_s"]}]
