"""The engine on a GPU, one JSON (part of gpu_validate.sh): its decode step beside the byte floor,
the kernels it launches, CUDA graphs, and what prefix sharing buys end to end.

On random models of a ``model`` preset's shape (default Llama-2-7B, bf16), in one process,
each section on its own (a failure is recorded and the next runs):

- ``bandwidth``: the device-to-device copy bandwidth (a 4 GiB copy, bytes read and written over
  the best of 5), which prices the byte floor of a step: every weight and every KV token it
  reads, read once (`gpu_runs.byte_floor_s`);
- ``kv_pool``: the KV pool sized from what the device has free once the weights are loaded;
- ``syncs``: synchronizing calls inside the forward (CUDA's sync debug mode) over every step of
  two eager runs (``triton`` and ``cascade_triton``: prefill behind a cached prefix and decode),
  0 expected;
- ``kernels``: CUDA kernels one eager decode step of ``--requests`` x (``--prefix`` shared +
  ``--suffix`` own) tokens launches (torch's profiler), plain and cascade, and per layer;
- ``tiers``: the engine's tier copies (GPU to pinned host memory and back, its own copy path)
  beside the host link's bandwidth measured in the same run (`gpu_tiers`);
- ``runs``: each of `gpu_runs.RUNS` through `testbed.execute` (as ``python -m testbed.run``
  runs them; each writes its run directory under ``--runs-dir``): the 32-request decode step at
  ``--requests`` x (``--prefix`` + ``--suffix``) and steps of 8 and 16 requests, each beside its
  byte floor (the median decode step at the full batch: its share of the timeline, host work
  included, and its split, ``gpu_s`` by CUDA events and ``host_s`` by the clock), eager and CUDA
  graphs, plain and cascade, and plain with ``scheduler.overlap=true``; tree-of-thought
  (``--problems``) radix+lpm (graphs, with overlap, eager, cascade with the rule and with every
  node) and none+fcfs; chat and few-shot with 32-token answers, plain and cascade; few-shot
  radix+lpm and none+fcfs; every run's decode steps by batch size in GPU and host time beside
  their byte floor; the throughput ratios (on the run's timeline, and on the wall clock).

    python -m experiments.validation.gpu_engine --out FILE.json [--runs-dir DIR]
        [--model llama2_7b] [--sections bandwidth kv_pool syncs kernels tiers runs]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

from testbed.config.assembly import assemble, compose_config
from testbed.engine.executor import EngineExecutor
from testbed.engine.kv_cache import KVCache
from testbed.engine.loader import build_model, config_from_model_group, parse_dtype
from testbed.engine.runner import ModelRunner
from testbed.execute import execute
from testbed.serving.serve import serve
from testbed.workloads.request import Request

from experiments.validation.gpu_runs import (RUNS, Floor, Shape, decode_median, ratios,
                                             run_overrides, shape_floor_tokens, step_split)
from experiments.validation.gpu_tiers import tier_copies


def copy_bandwidth(device: str, gib: int = 4, repeats: int = 5) -> float:
    """Bytes a second a device-to-device copy moves (read plus written), best of ``repeats``."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / best


def shared_prefix_requests(n: int, prefix: int, suffix: int, new: int, vocab: int) -> list:
    rng = np.random.default_rng(0)
    shared = rng.integers(0, vocab, prefix)
    return [Request(f"r{i}", np.concatenate([shared, rng.integers(0, vocab, suffix)])
                    .astype(np.int32), np.zeros(new, dtype=np.int32)) for i in range(n)]


def counted_forward(runner: ModelRunner) -> list[int]:
    """Wrap the runner's forward: count synchronizing calls in it (CUDA's sync debug mode)."""
    counts: list[int] = []
    forward = runner.forward

    def wrapped(inputs):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return forward(inputs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                counts.append(sum("synchroniz" in str(w.message) for w in seen))

    runner.forward = wrapped
    return counts


def syncs(model, run, args) -> dict:
    """Synchronizing calls inside the eager forward, prefill behind a prefix and decode."""
    requests = shared_prefix_requests(4, 256, 16, 8, model.config.vocab_size)
    out = {}
    for attention in ("triton", "cascade_triton"):
        runner = ModelRunner(model, num_slots=4 * 300, attention=attention)
        counts = counted_forward(runner)
        serve(requests, run.build_cache(4 * 300, requests), run.scheduler,
              EngineExecutor(runner), generate=True, decode_groups=run.decode_groups()
              if attention.startswith("cascade") else None)
        out[attention] = {"syncs_in_forward": sum(counts), "forwards": len(counts)}
    return out


def kernels(model, args) -> dict:
    """CUDA kernels one eager decode step launches, plain and cascade (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from experiments.benchmarks.decode_batches import decode_batch

    n, context = args.requests, args.prefix + args.suffix
    out = {}
    for attention in ("triton", "cascade_triton"):
        batch = decode_batch(n, context, args.prefix, model.config.vocab_size)
        runner = ModelRunner(model, n * (context + 2) + 1, attention=attention)
        group = [(args.prefix, list(range(n)))]
        runner.decode_groups = lambda entries: group
        for _ in range(2):
            runner.run(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.run(batch)
            torch.cuda.synchronize()
        launched = [e for e in prof.events() if e.device_type.name == "CUDA"]
        names: dict[str, list] = {}
        for e in launched:
            entry = names.setdefault(e.name[:80], [0, 0.0])
            entry[0] += 1
            entry[1] += e.device_time_total if hasattr(e, "device_time_total") else 0.0
        out[attention] = {"kernels_a_step": len(launched),
                          "kernels_a_layer": len(launched) / model.config.num_layers,
                          "by_name": dict(sorted(names.items(), key=lambda kv: -kv[1][0]))}
        del runner
    return out


def runs(args, base: list[str], floor: Floor | None, out: dict, save) -> dict:
    """Each run of `RUNS` into ``out`` (``save()`` after each: a time-boxed caller keeps what
    finished): its summary's figures, its decode steps by batch size beside their byte floor
    (`step_split`), and for the step-shape runs the median decode step beside its own."""
    shape = Shape(args.requests, args.prefix, args.suffix, args.new, args.problems)
    for name in RUNS:
        if args.only and name not in args.only:
            continue
        run_dir = Path(args.runs_dir) / name
        try:
            started = time.perf_counter()
            summary = execute(compose_config([*base, *run_overrides(name, shape),
                                              "progress=false"]), run_dir)
            keep = ("throughput_req_s", "makespan_s", "hit_rate", "decode_steps",
                    "mean_decode_batch", "graph_capture_s", "graph_memory_bytes",
                    "graph_replays", "graphs_captured", "kv_capacity_tokens", "cuda_graph",
                    "layer_kernels", "layer_kernels_error", "graph_error",
                    "graph_capture_failures", "ttft_p50_s", "tpot_p50_s")
            run_s = (summary.get("timing") or {}).get("run_s")
            out[name] = {k: summary.get(k) for k in keep} | {
                "wall_s": time.perf_counter() - started, "run_s": run_s,
                "wall_throughput_req_s": summary.get("num_requests", 0) / run_s
                if run_s else None}
            steps = [json.loads(line) for line in
                     (run_dir / "steps.jsonl").read_text().splitlines()]
            out[name]["decode_split"] = step_split(steps, floor)
            if name.startswith(("shape", "small")):
                requests = int(name.rsplit("_b", 1)[1]) if name.startswith("small") \
                    else args.requests
                out[name] |= decode_median(steps, requests)
                median = out[name]["decode_step_s"]
                if floor and median:
                    at = floor.of(shape_floor_tokens(name, shape, requests))
                    out[name] |= {"byte_floor_s": at, "over_floor": median / at}
        except Exception as e:  # noqa: BLE001 - recorded, the next run goes on
            out[name] = {"error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-2000:]}
        gc.collect()
        torch.cuda.empty_cache()
        save()
    out["ratios"] = ratios(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs-dir", default=None, help="run directories (default: beside --out)")
    ap.add_argument("--model", default="llama2_7b", help="conf/model preset (random weights)")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the runs section "
                    "(Triton under TRITON_INTERPRET=1; model=tiny)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--problems", type=int, default=12, help="tree-of-thought problems")
    ap.add_argument("--mem-fraction", type=float, default=0.9)
    ap.add_argument("--sections", nargs="*",
                    default=["bandwidth", "kv_pool", "syncs", "kernels", "tiers", "runs"])
    ap.add_argument("--only", nargs="*", default=None, help="runs to do (default: all)")
    args = ap.parse_args()
    args.runs_dir = args.runs_dir or str(Path(args.out).parent / "runs")
    base = [f"model={args.model}", "backend=engine", f"hardware={args.hardware}",
            f"engine.device={args.device}", f"engine.dtype={args.dtype}"]
    run = assemble(compose_config([*base, "cache=radix", "scheduler=lpm"]))
    report: dict = {"model": args.model, "dtype": args.dtype, "errors": {}}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def section(name, fn):
        if name not in args.sections:
            return
        started = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded, the next section goes on
            report["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        report.setdefault("seconds", {})[name] = time.perf_counter() - started
        out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")  # as it goes
        print(f"{name}: {time.perf_counter() - started:.1f} s "
              f"{'(failed)' if name in report['errors'] else ''}", flush=True)

    section("bandwidth", lambda: {"copy_bytes_per_s": copy_bandwidth(args.device)})
    bandwidth = report.get("bandwidth", {}).get("copy_bytes_per_s")
    shape = run.model_shape
    floor = Floor(shape.linear_params * shape.dtype_bytes, shape.kv_bytes_per_token,
                  bandwidth) if bandwidth else None
    model = None
    if {"kv_pool", "syncs", "kernels", "tiers"} & set(args.sections):
        model = build_model(config_from_model_group(run.config["model"]), seed=0,
                            dtype=parse_dtype(args.dtype), device=args.device)

    def kv_pool():
        free, total = torch.cuda.mem_get_info(model.device)
        pool = ModelRunner(model, num_slots=None, mem_fraction=args.mem_fraction,
                           cuda_graph=False)
        found = {"slots": pool.num_slots, "free_bytes": free, "total_bytes": total,
                 "kv_bytes_per_token": KVCache.bytes_per_token(model.config, model.dtype),
                 "kv_pool_bytes": pool.kv_cache.nbytes}
        del pool
        torch.cuda.empty_cache()
        return found

    section("kv_pool", kv_pool)
    section("syncs", lambda: syncs(model, run, args))
    section("kernels", lambda: kernels(model, args))
    section("tiers", lambda: tier_copies(model, shape.kv_bytes_per_token))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    report["runs"] = {}
    save = lambda: out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")  # noqa: E731
    section("runs", lambda: runs(args, base, floor, report["runs"], save))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    from experiments import entry
    entry(main)
