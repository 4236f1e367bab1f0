"""Where a decode step's time goes on the engine: torch's profiler over synthetic decode batches.

Builds the engine's executor as ``testbed.serve`` would (the config's model, device, dtype and
attention; one torch thread on a CPU), runs decode batches of ``--batch`` requests each holding
``--context`` cached tokens (`testbed.calibrate.synthetic_batch`), and prints the step time and
the operators that take it, grouped into what they do (weights' matmuls, attention, KV
writes and gathers, sampling, the rest), each as a share of the profiled CPU time. The step
time is measured apart from the profiler, which slows every operator down.

    python -m experiments.benchmarks.decode_profile [--batch 1 8 32] [--context 448]
        [--steps 10] [--served [--served-tokens 48] [--repeats 3]]
        [overrides, e.g. model=smollm2_135m attention=torch]

``--served`` also starts ``testbed.serve`` with the same overrides and, for each ``--batch``
B, runs a closed loop of B streams (each one completion of ``--served-tokens`` forced tokens
on a prompt of random ids, no shared prefix), side by side with the offline step at B, in turn
``--repeats`` times: the server's own step records (``GET /debug/steps``) give its steady
decode step at B, what the engine thread spent in it and what it waited, and the table prints
served / offline (the fastest repeat of each; `experiments.benchmarks.served_step`).

The CPU's native kernels (``engine.cpu_kernels=native``: attention over the pool in place, the
layer's elementwise steps, few-row matmuls on weight panels) are C functions called through
``ctypes``, no torch operators: the profiler does not see them, so their time is in the step's
but in none of the shares, which cover only the torch operators' time, printed beside the step
(run with ``engine.cpu_kernels=torch`` for the torch path's shares, or see
`experiments.benchmarks.cpu_engine` for the kernels' own times).

Used in docs/results/vs_vllm_serving.md to say where the engine's decode step loses to vLLM's.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from testbed.config.assembly import assemble, compose_config
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


def decode_batches(batch: int, context: int, n: int, vocab: int) -> list:
    rng = np.random.default_rng(0)
    shape = StepShape.decode((context,) * batch)
    return [synthetic_batch(shape, vocab, rng) for _ in range(n)]


def offline_step(executor, batch: int, context: int, steps: int, vocab: int
                 ) -> tuple[float, float]:
    """The median wall and thread-CPU seconds of ``steps`` decode steps (after two warm-ups),
    without the profiler (its hooks around every operator slow the step down: 86 ms against
    45 ms at batch 1 here)."""
    wall, cpu = [], []
    for i, b in enumerate(decode_batches(batch, context, steps + 2, vocab)):
        t, c = time.perf_counter(), time.thread_time()
        executor.execute(b)
        if i >= 2:
            wall.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
    return float(np.median(wall)), float(np.median(cpu))


def profile_decode(executor, batch: int, context: int, steps: int, vocab: int) -> dict:
    step_s, _ = offline_step(executor, batch, context, steps, vocab)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in decode_batches(batch, context, steps, vocab):
            executor.execute(b)
    groups: dict[str, float] = {}
    for event in prof.key_averages():
        groups[group_of(event.key)] = groups.get(group_of(event.key), 0.0) \
            + event.self_cpu_time_total
    total = sum(groups.values())
    return {"batch": batch, "context": context, "step_ms": 1e3 * step_s,
            "torch_ops_ms": total / 1e3 / steps,  # profiled µs over the steps
            **{g: v / total for g, v in sorted(groups.items(), key=lambda x: -x[1])}}


def served_vs_offline(executor, args, vocab: int) -> None:
    """``--served``: closed loops of each ``--batch`` on ``testbed.serve`` (same overrides),
    side by side with the offline step at that batch, ``--repeats`` times in turn; the fastest
    of each counts (`experiments.benchmarks.served_step`)."""
    from experiments.benchmarks.served_step import measure
    from testbed.api.server import start_server

    tokens = args.served_tokens
    prompt = args.context - tokens // 2  # the decode steps' contexts centre on --context
    capacity = max(args.batch) * (args.context + tokens) + 1024
    overrides = [f"cache.capacity_tokens={capacity}"] + args.overrides
    handle = start_server(["engine.device=cpu", *overrides], in_process=False, timeout_s=600)
    offline: dict[int, list] = {b: [] for b in args.batch}
    served: dict[int, list] = {b: [] for b in args.batch}
    try:
        for r in range(args.repeats):
            for b in args.batch:
                offline[b].append(offline_step(executor, b, args.context, args.steps, vocab))
                served[b].append(measure(handle.url, b, prompt, tokens, 1, vocab, seed=r))
                print(f"  repeat {r + 1}, batch {b}: offline {1e3 * offline[b][-1][0]:.1f} ms, "
                      f"served {1e3 * served[b][-1].step_s:.1f} ms", flush=True)
    finally:
        handle.stop()
    print(f"\nserved (testbed.serve, closed loops, {tokens} tokens on ~{args.context} each) "
          f"against offline, fastest of {args.repeats} (ms; the served step's waits and cores "
          "are the fastest repeat's; cores: mean over the loop)")
    print("| batch | offline step | served step | served / offline | offline CPU | engine CPU | "
          "CPU served / offline | waited for a core | waited asleep | handing | HTTP CPU | "
          "others' cores |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in args.batch:
        off, off_cpu = min(w for w, _ in offline[b]), min(c for _, c in offline[b])
        best = min(served[b], key=lambda s: s.step_s)
        cpu = min(s.engine_cpu_s for s in served[b])
        others = "–" if best.others_cores is None else f"{best.others_cores:.2f}"
        core, asleep = ("–", "–") if best.runqueue_s is None else \
            (f"{1e3 * best.runqueue_s:.1f}", f"{1e3 * (best.waited_s - best.runqueue_s):.1f}")
        print(f"| {b} | {1e3 * off:.1f} | {1e3 * best.step_s:.1f} | {best.step_s / off:.2f} | "
              f"{1e3 * off_cpu:.1f} | {1e3 * cpu:.1f} | {cpu / off_cpu:.2f} | {core} | {asleep} | "
              f"{1e3 * best.handing_s:.2f} | {1e3 * best.http_cpu_s:.2f} | {others} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.benchmarks.decode_profile",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=448)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--served", action="store_true",
                    help="also closed loops of each batch on testbed.serve, against offline")
    ap.add_argument("--served-tokens", type=int, default=48,
                    help="output tokens of each served request")
    ap.add_argument("--repeats", type=int, default=3, help="of the served comparison")
    ap.add_argument("overrides", nargs="*", default=["model=smollm2_135m"])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as testbed.serve on a CPU
    run = assemble(compose_config(["backend=engine", "engine.device=cpu", *args.overrides]))
    shapes = [StepShape.decode((args.context,) * b) for b in args.batch]
    executor = run.build_executor(grid_slots(shapes))
    vocab = run.model_shape.vocab_size
    for b in args.batch:
        row = profile_decode(executor, b, args.context, args.steps, vocab)
        parts = "  ".join(f"{k} {v:.0%}" for k, v in row.items() if isinstance(v, float)
                          and k not in ("step_ms", "torch_ops_ms"))
        print(f"batch {b:>3}, context {args.context}: {row['step_ms']:.1f} ms, torch operators "
              f"{row['torch_ops_ms']:.1f} ms of it (profiled): {parts}")
    if args.served:
        served_vs_offline(executor, args, vocab)


if __name__ == "__main__":
    from experiments import entry
    entry(main)
