"""What the order of a request's KV slots costs the CPU's in-place decode kernel.

The kernel (`testbed.engine.cpu_attention`) reads each key and value row where its slot lies.
The same decode attention (30 layers of SmolLM2-135M's shape: 3 KV heads of 64, 3 query rows
each, a pool of 16,352 slots per layer) over four placements of the same number of slots,
fastest of five, one thread:

- ``ascending``: each request's slots one run (a fresh pool, or one sorted as `KVSlotPool` keeps
  its freed pages since issue 46);
- ``runs``: the requests' slots alternate 32 at a time, as the pool keeps a batch's decoded
  tokens since 2026-12-06 (`KVSlotPool.alloc_after`; the calibration grid's default layout);
- ``interleaved``: the requests' slots alternate one at a time, as decode steps of page 1 handed
  them out before (one slot per request per step, in turn);
- ``scattered``: slots drawn at random from the whole pool, as a free list handed out in freeing
  order becomes over a server's life.

    python -m experiments.benchmarks.slot_order [--shapes 4x1000 16x448] [--repeats 5]
    python -m experiments.benchmarks.slot_order --workload sharegpt_chat [--loop 16]

Prints milliseconds per step's attention and each placement over ``ascending``.

``--workload`` (a workload of `vs_vllm_serving`) times a served pool's own placements instead:
the workload runs on the simulator (radix + LPM, a pool of `vs_vllm_serving`'s size, a closed loop
of ``--loop``) twice, with the pool handing out decode slots as it does for the engine (``runs``:
`KVSlotPool.alloc_after`) and as it did before (``in turn``: `alloc`, what the simulator's own
pool still does), and every decode step's slot lists are kept. Slot ids change no decision, so
both runs make the same steps; each step's attention is timed over both placements side by side,
and the sums printed by batch size.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from testbed.config.assembly import assemble, compose_config
from testbed.calibration.grid import slot_order
from testbed.engine.cpu_attention import load_kernel
from testbed.serving.serve import serve
from testbed.sim.step_shape import StepShape

SLOTS, KV_HEADS, ROWS, HEAD_DIM, LAYERS = 16352, 3, 3, 64, 30


def placements(batch: int, context: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Each placement's slots, request after request (``batch`` of ``context``); ``runs`` and
    ``interleaved`` as the calibration grid lays a batch out
    (`testbed.calibration.grid.slot_order`)."""
    n = batch * context
    step = StepShape.decode((context,) * batch)
    laid = {"ascending": np.arange(1, n + 1)}
    laid |= {layout: np.concatenate([s[:context] for s in slot_order(step, layout)])
             for layout in ("runs", "interleaved")}
    laid["scattered"] = np.random.default_rng(seed).permutation(np.arange(1, SLOTS + 1))[:n]
    return {name: torch.from_numpy(slots.astype(np.int32)) for name, slots in laid.items()}


def served_steps(workload: list[str], loop: int, in_turn: bool
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every decode step (indptr, slots) of ``workload`` served on the simulator, the pool
    handing decode slots out as it does or (``in_turn``) one after another."""
    from experiments.benchmarks.vs_vllm_serving import CAPACITY  # noqa: PLC0415 (matplotlib)
    run = assemble(compose_config([*workload, "backend=sim", "model=smollm2_135m", "hardware=cpu",
                                   "cache=radix", "scheduler=lpm", "engine.forced=true",
                                   f"arrival.max_in_flight={loop}", "progress=false"]))
    requests = run.requests()
    executor = run.build_executor(CAPACITY, requests)
    steps, launch = [], executor.launch

    def keeping(batch):
        if batch.kind == "decode":
            slots = [e.kv_slots()[: e.context + 1] for e in batch.entries]
            indptr = np.cumsum([0] + [len(x) for x in slots])
            steps.append((torch.from_numpy(indptr.astype(np.int64)),
                          torch.from_numpy(np.concatenate(slots).astype(np.int32))))
        return launch(batch)

    executor.launch = keeping
    executor.reads_kv_in_place = not in_turn  # as the engine's: the pool keeps runs
    serve(requests, run.build_cache(CAPACITY, requests), run.scheduler, executor, seed=run.seed,
          max_in_flight=run.max_in_flight)
    return steps


def time_served(kernel, name: str, loop: int, repeats: int, k_bufs, v_bufs) -> None:
    from experiments.benchmarks.vs_vllm_serving import WORKLOADS  # noqa: PLC0415
    runs = served_steps(WORKLOADS[name], loop, in_turn=False)
    turn = served_steps(WORKLOADS[name], loop, in_turn=True)
    if [i.tolist() for i, _ in runs] != [i.tolist() for i, _ in turn]:
        raise SystemExit("error: the two placements' runs made different steps")
    totals: dict[tuple[int, str], float] = {}
    for (indptr, a), (_, b) in zip(runs, turn):
        batch = len(indptr) - 1
        q = torch.randn(batch, KV_HEADS, ROWS, HEAD_DIM)
        best = {"runs": float("inf"), "in turn": float("inf")}
        for _ in range(repeats):  # side by side, step by step
            for label, slots in (("runs", a), ("in turn", b)):
                start = time.perf_counter()
                for k_buf, v_buf in zip(k_bufs, v_bufs):
                    kernel(q, k_buf, v_buf, indptr, slots, HEAD_DIM ** -0.5)
                best[label] = min(best[label], time.perf_counter() - start)
        for label, t in best.items():
            bucket = 1 if batch == 1 else 4 if batch <= 4 else 8 if batch <= 8 else 16
            totals[bucket, label] = totals.get((bucket, label), 0.0) + t
    print(f"{name}, loop {loop}: {len(runs)} decode steps, attention of 30 layers summed "
          f"(fastest of {repeats} each)")
    for bucket in sorted({b for b, _ in totals}):
        r, t = totals[bucket, "runs"], totals[bucket, "in turn"]
        print(f"  batch <= {bucket:2d}: runs {1e3 * r:8.1f} ms, in turn {1e3 * t:8.1f} ms "
              f"({t / r:.2f}x)")
    r = sum(v for (_, label), v in totals.items() if label == "runs")
    t = sum(v for (_, label), v in totals.items() if label == "in turn")
    print(f"  all: runs {1e3 * r:.1f} ms, in turn {1e3 * t:.1f} ms ({t / r:.2f}x)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.benchmarks.slot_order",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4x1000", "16x448"],
                    help="BATCHxCONTEXT, each request's cached tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workload", help="a vs_vllm_serving workload: time its served placements")
    ap.add_argument("--loop", type=int, default=16, help="--workload's closed loop")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kernel, error = load_kernel()
    if kernel is None:
        raise SystemExit(f"error: the decode kernel did not load: {error}")
    k_bufs = [torch.randn(SLOTS + 1, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    v_bufs = [torch.randn(SLOTS + 1, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    if args.workload:
        return time_served(kernel, args.workload, args.loop, args.repeats, k_bufs, v_bufs)
    for shape in args.shapes:
        batch, context = map(int, shape.split("x"))
        if batch * context > SLOTS:
            raise SystemExit(f"error: --shapes {shape}: more than the pool's {SLOTS} slots")
        q = torch.randn(batch, KV_HEADS, ROWS, HEAD_DIM)
        indptr = torch.arange(0, (batch + 1) * context, context, dtype=torch.int64)
        best: dict[str, float] = {}
        for _ in range(args.repeats):  # interleaved, so drift touches every placement alike
            for name, slots in placements(batch, context).items():
                start = time.perf_counter()
                for k_buf, v_buf in zip(k_bufs, v_bufs):
                    kernel(q, k_buf, v_buf, indptr, slots, HEAD_DIM ** -0.5)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
        base = best["ascending"]
        print(f"{batch} x {context}: " + ", ".join(
            f"{name} {1e3 * s:.2f} ms ({s / base:.2f}x)" for name, s in best.items()))


if __name__ == "__main__":
    from experiments import entry
    entry(main)
