"""Where a decode step's time goes on the engine: torch's profiler over synthetic decode batches.

Builds the engine's executor as ``testbed.serve`` would (the config's model, device, dtype and
attention; one torch thread on a CPU), runs decode batches of ``--batch`` requests each holding
``--context`` cached tokens (`testbed.calibrate.synthetic_batch`), and prints the step time and
the operators that take it, grouped into what they do (weights' matmuls, attention, KV
writes and gathers, sampling, the rest), each as a share of the profiled CPU time.

    python -m experiments.benchmarks.decode_profile [--batch 1 8 32] [--context 448]
        [--steps 10] [--served] [overrides, e.g. model=smollm2_135m attention=torch]

``--served`` also starts ``testbed.serve`` with the same overrides and streams one completion
of 48 tokens on a prompt of ``--context`` tokens, twice: the median gap between its tokens is a
served decode step at batch 1, to set beside the engine's own.

The CPU's in-place decode kernel (``engine.cpu_kernels=native``, `testbed.engine.cpu_attention`)
is a C function called through ``ctypes``, no torch operator: the profiler does not see it, so
its time is in the step's but in none of the shares (run with ``engine.cpu_kernels=torch`` for
the gathered attention's share, or see `experiments.benchmarks.cpu_engine`).

Used in docs/results/vs_vllm_serving.md to say where the engine's decode step loses to vLLM's.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from testbed.assembly import assemble, compose_config
from testbed.calibrate import grid_slots, synthetic_batch
from testbed.sim.step_shape import StepShape

#: operator name fragments -> what they do (first match wins)
GROUPS = [
    ("matmul: weights", ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm",
                         "_linear_pointwise")),  # the last: oneDNN on packed weights (issue 46)
    ("attention", ("scaled_dot_product", "softmax", "aten::baddbmm")),
    ("KV gather / write", ("index", "gather", "scatter", "aten::copy_", "aten::cat",
                          "aten::stack")),
    ("sampling", ("argmax", "topk", "sort", "multinomial", "log_softmax")),
    ("norms, rotary, activations", ("rms", "pow", "rsqrt", "mul", "add", "silu", "neg", "cos",
                                    "sin", "mean")),
]


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, fragments in GROUPS:
        if any(f.lower() in lowered for f in fragments):
            return group
    return "other"


def profile_decode(executor, batch: int, context: int, steps: int, vocab: int) -> dict:
    rng = np.random.default_rng(0)
    shape = StepShape.decode((context,) * batch)
    batches = [synthetic_batch(shape, vocab, rng) for _ in range(steps + 2)]
    for b in batches[:2]:  # warm-up
        executor.execute(b)
    wall = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in batches[2:]:
            t = time.perf_counter()
            executor.execute(b)
            wall.append(time.perf_counter() - t)
    groups: dict[str, float] = {}
    for event in prof.key_averages():
        groups[group_of(event.key)] = groups.get(group_of(event.key), 0.0) \
            + event.self_cpu_time_total
    total = sum(groups.values())
    return {"batch": batch, "context": context, "step_ms": 1e3 * float(np.median(wall)),
            **{g: v / total for g, v in sorted(groups.items(), key=lambda x: -x[1])}}


def served_step_ms(overrides: list[str], context: int, tokens: int = 48) -> float:
    """The median inter-token gap of one streamed completion on ``testbed.serve`` (the faster of
    two)."""
    import httpx

    from testbed.api.server import start_server
    handle = start_server(["engine.device=cpu", *overrides], in_process=False, timeout_s=600)
    try:
        best = np.inf
        for _ in range(2):
            body = {"prompt": list(range(1000, 1000 + context)), "max_tokens": tokens,
                    "ignore_eos": True, "stream": True}
            times = []
            with httpx.stream("POST", handle.url + "/v1/completions", json=body,
                              timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())
            best = min(best, float(np.median(np.diff(times[1:]))))
        return 1e3 * best
    finally:
        handle.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.benchmarks.decode_profile",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=448)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--served", action="store_true", help="also a served step at batch 1")
    ap.add_argument("overrides", nargs="*", default=["model=smollm2_135m"])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as testbed.serve on a CPU
    run = assemble(compose_config(["backend=engine", "engine.device=cpu", *args.overrides]))
    shapes = [StepShape.decode((args.context,) * b) for b in args.batch]
    executor = run.build_executor(grid_slots(shapes))
    for b in args.batch:
        row = profile_decode(executor, b, args.context, args.steps, run.model_shape.vocab_size)
        parts = "  ".join(f"{k} {v:.0%}" for k, v in row.items() if isinstance(v, float)
                          and k != "step_ms")
        print(f"batch {b:>3}, context {args.context}: {row['step_ms']:.1f} ms   {parts}")
    if args.served:
        ms = served_step_ms(args.overrides, args.context)
        print(f"served (testbed.serve, one stream), context {args.context}: {ms:.1f} ms a token")


if __name__ == "__main__":
    main()
