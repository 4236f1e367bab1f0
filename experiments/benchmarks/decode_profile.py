"""Where a decode step's time goes on the engine: torch's profiler over synthetic decode batches.

Builds the engine's executor as ``testbed.serve`` would (the config's model, device, dtype and
attention; one torch thread on a CPU), runs decode batches of ``--batch`` requests each holding
``--context`` cached tokens (`testbed.calibrate.synthetic_batch`), and prints the step time and
the operators that take it, grouped into what they do (weights' matmuls, attention, KV
writes and gathers, sampling, the rest), each as a share of the profiled CPU time.

    python -m experiments.benchmarks.decode_profile [--batch 1 8 32] [--context 448]
        [--steps 10] [overrides, e.g. model=smollm2_135m attention=torch]

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
    ("matmul: weights", ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm")),
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.benchmarks.decode_profile",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=448)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("overrides", nargs="*", default=["model=smollm2_135m"])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as testbed.serve on a CPU
    run = assemble(compose_config(["backend=engine", "device=cpu", *args.overrides]))
    shapes = [StepShape.decode((args.context,) * b) for b in args.batch]
    executor = run.build_executor(grid_slots(shapes))
    for b in args.batch:
        row = profile_decode(executor, b, args.context, args.steps, run.model_shape.vocab_size)
        parts = "  ".join(f"{k} {v:.0%}" for k, v in row.items() if isinstance(v, float)
                          and k != "step_ms")
        print(f"batch {b:>3}, context {args.context}: {row['step_ms']:.1f} ms   {parts}")


if __name__ == "__main__":
    main()
