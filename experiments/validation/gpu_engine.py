"""The engine's hot path and cascade decoding on a GPU, one JSON (part of gpu_validate.sh).

On a random model of a ``model`` preset's shape (default Llama-2-7B, bf16, Triton attention):
- ``kv_pool``: the KV pool sized from what the device has free once the weights are loaded
  (`ModelRunner` without ``num_slots``): slots, free and total bytes, KV bytes per token;
- ``syncs``: every step of two served runs under ``torch.cuda.set_sync_debug_mode("warn")``
  around the forward (all layers): synchronizing calls counted, 0 expected;
- ``cascade``: ``--requests`` requests sharing a ``--prefix``-token prompt, each with its own
  ``--suffix`` tokens, greedy for ``--new`` tokens, served with ``attention=triton`` and
  ``cascade_triton``: median decode-step time of each, their ratio, and the fraction of
  generated tokens that agree (bf16: rounding may flip a near tie).

    python -m experiments.validation.gpu_engine --out FILE.json [--model llama2_7b] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from testbed.assembly import Assembly, assemble, compose_config
from testbed.engine.executor import EngineExecutor
from testbed.engine.kv_cache import KVCache
from testbed.engine.loader import build_model, config_from_model_group, parse_dtype
from testbed.engine.runner import ModelRunner
from testbed.serving.serve import serve
from testbed.workloads.request import Request


def shared_prefix_requests(n: int, prefix: int, suffix: int, new: int, vocab: int) -> list:
    rng = np.random.default_rng(0)
    shared = rng.integers(0, vocab, prefix)
    return [Request(f"r{i}", np.concatenate([shared, rng.integers(0, vocab, suffix)])
                    .astype(np.int32), np.zeros(new, dtype=np.int32)) for i in range(n)]


def counted_forward(runner: ModelRunner, cuda: bool) -> list[int]:
    """Wrap the runner's forward: count synchronizing calls in it (CUDA's sync debug mode)."""
    counts: list[int] = []
    forward = runner.forward

    def wrapped(inputs):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                return forward(inputs)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
                counts.append(sum("synchroniz" in str(w.message) for w in seen))

    runner.forward = wrapped
    return counts


def serve_with(run: Assembly, model, attention: str, requests: list, slots: int,
               cuda: bool) -> dict:
    # the runner and executor are built here, not by run.build_executor: both attentions share
    # one loaded model, and the runner's forward is wrapped to count synchronizing calls
    runner = ModelRunner(model, num_slots=slots, attention=attention)
    syncs = counted_forward(runner, cuda)
    started = time.perf_counter()
    _, result = serve(requests, run.build_cache(slots, requests), run.scheduler,
                      EngineExecutor(runner), generate=True, record_steps=True)
    decode = [s.duration_s for s in result.steps if s.kind == "decode"]
    return {"wall_s": time.perf_counter() - started, "decode_steps": len(decode),
            "decode_step_median_s": statistics.median(decode) if decode else None,
            "syncs_in_forward": sum(syncs), "steps": len(syncs),
            "outputs": [r.output for r in result.reqs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama2_7b", help="conf/model preset (random weights)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--mem-fraction", type=float, default=0.9)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    # the run config's model group (its shape), radix cache (LRU) and LPM scheduler
    run = assemble(compose_config([f"model={args.model}", "backend=engine", "cache=radix",
                                   "eviction=lru", "scheduler=lpm", f"device={args.device}",
                                   f"dtype={args.dtype}"]))
    group = run.config["model"]
    dtype = parse_dtype(args.dtype)
    model = build_model(config_from_model_group(group), seed=0, dtype=dtype, device=args.device)
    report: dict = {"model": args.model, "device": args.device, "dtype": args.dtype}
    if cuda:
        free, total = torch.cuda.mem_get_info(model.device)
        pool = ModelRunner(model, num_slots=None, mem_fraction=args.mem_fraction)
        report["kv_pool"] = {"slots": pool.num_slots, "free_bytes": free, "total_bytes": total,
                             "mem_fraction": args.mem_fraction,
                             "kv_bytes_per_token": KVCache.bytes_per_token(model.config, dtype),
                             "kv_pool_bytes": pool.kv_cache.nbytes}
        del pool
        torch.cuda.empty_cache()
    requests = shared_prefix_requests(args.requests, args.prefix, args.suffix, args.new,
                                      model.config.vocab_size)
    slots = args.requests * (args.prefix + args.suffix + args.new) + 1
    kernels = "triton" if cuda else "torch"
    runs = {name: serve_with(run, model, name, requests, slots, cuda)
            for name in (kernels, f"cascade_{kernels}")}
    plain, cascade = runs[kernels], runs[f"cascade_{kernels}"]
    agree = np.mean([a == b for x, y in zip(plain.pop("outputs"), cascade.pop("outputs"))
                     for a, b in zip(x, y)])
    report["syncs"] = {name: {"syncs_in_forward": r["syncs_in_forward"], "steps": r["steps"]}
                       for name, r in runs.items()}
    report["cascade"] = {"requests": args.requests, "prefix": args.prefix,
                         "suffix": args.suffix, "new": args.new, "plain": plain,
                         "cascade": cascade, "token_agreement": float(agree),
                         "decode_speedup": plain["decode_step_median_s"]
                         / cascade["decode_step_median_s"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"kv pool {report.get('kv_pool', {}).get('slots')} slots; syncs in forward "
          f"{sum(r['syncs_in_forward'] for r in report['syncs'].values())}; cascade decode step "
          f"{report['cascade']['decode_speedup']:.2f}x faster, tokens agree "
          f"{agree:.3f}; wrote {args.out}")


if __name__ == "__main__":
    main()
