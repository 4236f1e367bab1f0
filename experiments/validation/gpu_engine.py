"""The engine on a GPU, one JSON (part of gpu_validate.sh): its decode step beside the byte floor,
the kernels it launches, CUDA graphs, and what prefix sharing buys end to end.

On random models of a ``model`` preset's shape (default Llama-2-7B, bf16), in one process,
each section on its own (a failure is recorded and the next runs):

- ``bandwidth``: the device-to-device copy bandwidth (a 4 GiB copy, bytes read and written over
  the best of 5), which prices the byte floor of a step: every weight and every KV token it
  reads, read once (`byte_floor_s`);
- ``kv_pool``: the KV pool sized from what the device has free once the weights are loaded;
- ``syncs``: synchronizing calls inside the forward (CUDA's sync debug mode) over every step of
  two eager runs (``triton`` and ``cascade_triton``: prefill behind a cached prefix and decode),
  0 expected;
- ``kernels``: CUDA kernels one eager decode step of ``--requests`` x (``--prefix`` shared +
  ``--suffix`` own) tokens launches (torch's profiler), plain and cascade, and per layer;
- ``runs``: runs through `testbed.execute` (as ``python -m testbed.run`` runs them; each writes
  its run directory under ``--runs-dir``): the decode step at that shape as steps.jsonl records
  it (the median of the decode steps at the full batch: its share of the timeline, host work
  included, and its split, ``gpu_s`` by CUDA events and ``host_s`` by the clock), eager and CUDA
  graphs, plain and cascade, and plain with ``scheduler.overlap=true`` (the serving loop
  launches each step before reading the last one back: the host's work hidden behind the GPU's),
  each beside its byte floor; tree-of-thought (``--problems``) radix+lpm (graphs, with overlap,
  eager, cascade) and none+fcfs, with each run's decode steps split into GPU and host time by
  batch size; few-shot radix+lpm and none+fcfs; the throughput ratios (on the run's timeline,
  and on the wall clock: requests over the run's seconds).

    python -m experiments.validation.gpu_engine --out FILE.json [--runs-dir DIR]
        [--model llama2_7b] [--sections bandwidth kv_pool syncs kernels runs]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

from testbed.assembly import assemble, compose_config
from testbed.engine.executor import EngineExecutor
from testbed.engine.kv_cache import KVCache
from testbed.engine.loader import build_model, config_from_model_group, parse_dtype
from testbed.engine.runner import ModelRunner
from testbed.execute import execute

from testbed.serving.serve import serve
from testbed.workloads.request import Request


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


def byte_floor_s(weight_bytes: int, kv_tokens: int, kv_bytes_per_token: int,
                 bandwidth: float) -> float:
    """A step that reads every matmul weight (the LM head's included, not the embedding table:
    a gather of a few rows) and ``kv_tokens`` tokens of KV once, at ``bandwidth``: no decode
    step can take less (norm weights and activations left out make it lower still)."""
    return (weight_bytes + kv_tokens * kv_bytes_per_token) / bandwidth


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


TOT = ["workload=tree_of_thought", "cache=radix", "scheduler=lpm", "engine.attention=triton"]
SHAPE = ["workload=shared_prefix", "engine.cuda_graph_max_batch=32"]  # one batch size: 32
OVERLAP = "scheduler.overlap=true"
RUNS = {  # name -> overrides (besides the model's), the ones the acceptance reads first
    "tot_radix": TOT,
    "tot_none": ["workload=tree_of_thought", "cache=none", "scheduler=fcfs",
                 "engine.attention=triton"],
    "tot_radix_overlap": [*TOT, OVERLAP],
    "shape_plain_graph": [*SHAPE, "engine.attention=triton"],
    "shape_plain_graph_overlap": [*SHAPE, "engine.attention=triton", OVERLAP],
    "shape_cascade_graph": [*SHAPE, "engine.attention=cascade_triton"],
    "shape_plain_eager": [*SHAPE, "engine.attention=triton", "engine.cuda_graph=false"],
    "shape_cascade_eager": [*SHAPE, "engine.attention=cascade_triton",
                            "engine.cuda_graph=false"],
    "fewshot_radix": ["workload=few_shot", "cache=radix", "scheduler=lpm",
                      "engine.attention=triton"],
    "fewshot_none": ["workload=few_shot", "cache=none", "scheduler=fcfs",
                     "engine.attention=triton"],
    "tot_radix_cascade": [*TOT[:3], "engine.attention=cascade_triton"],
    "tot_radix_eager": [*TOT, "engine.cuda_graph=false"],
}


def step_split(run_dir: Path) -> dict:
    """A run's decode steps by batch size: medians of each step's share of the timeline
    (``duration_s``), its GPU time (``gpu_s``, CUDA events) and its host time (``host_s``:
    forming, launching, reading back, applying), from steps.jsonl."""
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    out = {}
    for low, high in ((1, 16), (17, 32), (33, 64), (65, 512)):
        chosen = [s for s in steps if s["kind"] == "decode" and low <= s["batch_size"] <= high]
        if chosen:
            out[f"batch_{low}_{high}"] = {"steps": len(chosen)} | {
                k: statistics.median(s[k] for s in chosen)
                for k in ("duration_s", "gpu_s", "host_s")}
    return out


def decode_median(run_dir: Path, batch: int) -> dict:
    """Medians over the decode steps of ``batch`` requests in steps.jsonl: the step's share of
    the timeline, its GPU and its host time; and how many there were."""
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    chosen = [s for s in steps if s["kind"] == "decode" and s["batch_size"] == batch]
    if not chosen:
        return {"decode_step_s": None, "decode_steps_at_batch": 0}
    return {"decode_step_s": statistics.median(s["duration_s"] for s in chosen),
            "decode_gpu_s": statistics.median(s["gpu_s"] for s in chosen),
            "decode_host_s": statistics.median(s["host_s"] for s in chosen),
            "decode_steps_at_batch": len(chosen)}


def runs(args, base: list[str], bandwidth: float | None, model_shape, out: dict,
         save) -> dict:
    """Each run of `RUNS` into ``out`` (``save()`` after each: a time-boxed caller keeps what
    finished)."""
    shape = [f"workload.prompts_per_group={args.requests}", "workload.num_groups=1",
             f"workload.system_prompt_len={args.prefix}",
             f"workload.question_len={args.suffix}", f"workload.output_len={args.new}"]
    for name, overrides in RUNS.items():
        if args.only and name not in args.only:
            continue
        extra = shape if name.startswith("shape") else \
            [f"workload.num_problems={args.problems}"] if name.startswith("tot") else []
        run_dir = Path(args.runs_dir) / name
        try:
            started = time.perf_counter()
            summary = execute(compose_config([*base, *overrides, *extra, "progress=false"]),
                              run_dir)
            keep = ("throughput_req_s", "makespan_s", "hit_rate", "decode_steps",
                    "mean_decode_batch", "graph_capture_s", "graph_memory_bytes",
                    "graph_replays", "graphs_captured", "kv_capacity_tokens", "cuda_graph",
                    "layer_kernels", "layer_kernels_error", "graph_error",
                    "graph_capture_failures")
            run_s = (summary.get("timing") or {}).get("run_s")
            out[name] = {k: summary.get(k) for k in keep} | {
                "wall_s": time.perf_counter() - started, "run_s": run_s,
                "wall_throughput_req_s": summary.get("num_requests", 0) / run_s
                if run_s else None}
            if name.startswith("tot"):
                out[name]["decode_split"] = step_split(run_dir)
            if name.startswith("shape"):
                out[name] |= decode_median(run_dir, args.requests)
                median = out[name]["decode_step_s"]
                context = args.prefix + args.suffix + args.new // 2  # the median step's
                kv = args.requests * context if "plain" in name else \
                    args.prefix + args.requests * (context - args.prefix)
                if bandwidth and median:
                    floor = byte_floor_s(model_shape.linear_params * model_shape.dtype_bytes, kv,
                                         model_shape.kv_bytes_per_token, bandwidth)
                    out[name] |= {"byte_floor_s": floor, "over_floor": median / floor}
        except Exception as e:  # noqa: BLE001 - recorded, the next run goes on
            out[name] = {"error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-2000:]}
        gc.collect()
        torch.cuda.empty_cache()
        save()
    ratio = lambda a, b: (out[a]["throughput_req_s"] / out[b]["throughput_req_s"]  # noqa: E731
                          if out.get(a, {}).get("throughput_req_s") and
                          out.get(b, {}).get("throughput_req_s") else None)
    wall = lambda a, b: (out[a]["wall_throughput_req_s"] / out[b]["wall_throughput_req_s"]  # noqa: E731
                         if out.get(a, {}).get("wall_throughput_req_s") and
                         out.get(b, {}).get("wall_throughput_req_s") else None)
    out["ratios"] = {
        "tot_radix_over_none": ratio("tot_radix", "tot_none"),
        "tot_overlap_over_plain": ratio("tot_radix_overlap", "tot_radix"),
        "tot_overlap_over_plain_wall": wall("tot_radix_overlap", "tot_radix"),
        "tot_radix_cascade_over_none": ratio("tot_radix_cascade", "tot_none"),
        "tot_graph_over_eager": ratio("tot_radix", "tot_radix_eager"),
        "fewshot_radix_over_none": ratio("fewshot_radix", "fewshot_none")}
    plain = out.get("shape_plain_graph", {}).get("decode_step_s")
    cascade = out.get("shape_cascade_graph", {}).get("decode_step_s")
    if plain and cascade:
        out["ratios"]["cascade_over_plain_step"] = cascade / plain
    overlapped = out.get("shape_plain_graph_overlap", {}).get("decode_step_s")
    if plain and overlapped:
        out["ratios"]["overlap_over_plain_step"] = overlapped / plain
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
                    default=["bandwidth", "kv_pool", "syncs", "kernels", "runs"])
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
    model = None
    if {"kv_pool", "syncs", "kernels"} & set(args.sections):
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
    del model
    gc.collect()
    torch.cuda.empty_cache()
    report["runs"] = {}
    save = lambda: out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")  # noqa: E731
    section("runs", lambda: runs(args, base, bandwidth, run.model_shape, report["runs"], save))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
