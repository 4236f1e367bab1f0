"""Are a workload's own decode steps priced as the grid's synthetic steps of the same shape?

Runs one held-back workload of ``sim_vs_engine --real`` (default tree-of-thought) on the engine
(SmolLM2-135M, fp32, one torch thread, CPU clock), keeps every decode batch of ``--batch``
requests it ran (their contexts and KV slots), and re-times ``--pick`` of them, shuffled, beside
three synthetic batches of each one's shape (`testbed.calibrate.synthetic_batch`, the grid's layout):

- ``captured``: the batch as the engine ran it, its slots as the radix cache laid them out;
- ``shared``: the same contexts with one prefix shared by every request, as long as gives the
  captured batch's re-read KV (the grid's shared batches, `calibrate.decode_shared`);
- ``unshared``: the same contexts, nothing shared (the grid's uniform batches);

and, once each, the grid's shared batches of ``--batch`` requests at ``--grid-context`` tokens
(all but 64 shared).

Each is printed with its re-read KV (`SharedReads`: every cached slot read again), its median
time over ``--repeats`` shuffled passes, and a fitted cost model's prediction (``--fitted``,
default the shipped ``cost_model=fitted_smollm2_cpu``). Captured and shared batches that take
the same time say the layout does not matter and the shape is priced by what it shares; the
gap between the unshared time and the shared one, per re-read token, is what ``e − h`` should be.

    python -m experiments.validation.captured_steps [--workload tree_of_thought] [--batch 16]
        [--pick 4] [--repeats 12] [--fitted PATH] [--grid-context 256 384 512]

Used in docs/results/sim_vs_engine.md ("Re-read KV").
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from experiments.validation import sim_vs_engine as sve
from testbed.config.assembly import assemble
from testbed.calibrate import batch_on_slots, synthetic_batch, timed_pass
from testbed.scheduler.batch import Batch
from testbed.scheduler.decode_groups import SharedReads
from testbed.sim.step_shape import StepShape


def captured_decodes(workload: str, batch: int) -> tuple[object, list[list[tuple[int, np.ndarray]]]]:
    """The engine, and every decode batch of ``batch`` requests it ran on ``workload``: each
    request's (context, slots of its context)."""
    sve.BASE[:] = sve.REAL["base"]
    run = assemble(sve.config(["engine.forced=true"], "calibrate"))
    engine = run.build_executor(20_000)
    engine.clock = time.thread_time
    kept: list[list[tuple[int, np.ndarray]]] = []
    execute = engine.execute

    def keeping(b: Batch):
        if b.kind == "decode" and len(b.entries) == batch:
            kept.append([(e.context, e.kv_slots()[:e.context].copy()) for e in b.entries])
        return execute(b)

    engine.execute = keeping
    sve.Workload(sve.REAL["held_back"][workload]).serve(engine)
    engine.execute = execute
    return engine, kept


def replayed(requests: list[tuple[int, np.ndarray]], rng: np.random.Generator, vocab: int,
             free: int) -> Batch:
    """A decode batch reading exactly those slots (all cached: a tree-of-thought leaf's context
    is its prompt), each request's new token in a free slot."""
    step = StepShape.decode(tuple(c for c, _ in requests))
    slots = [np.append(own, free + i) for i, (_, own) in enumerate(requests)]
    return batch_on_slots(step, slots, vocab, rng, cached=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.validation.captured_steps",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="tree_of_thought", choices=list(sve.REAL["held_back"]))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--pick", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--fitted", default=None, help="a fitted cost model's file (default: the "
                    "shipped cost_model=fitted_smollm2_cpu)")
    ap.add_argument("--grid-context", type=int, nargs="*", default=[256, 384, 512],
                    help="also the grid's shared batches at these contexts (all but 64 shared)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    engine, kept = captured_decodes(args.workload, args.batch)
    if not kept:
        raise SystemExit(f"{args.workload} ran no decode batch of {args.batch} requests")
    run = assemble(sve.config([]))
    fitted = sve.fitted_model(args.fitted)
    rng = np.random.default_rng(0)
    vocab, free = run.model_shape.vocab_size, 19_000
    rows = []
    for k in np.linspace(0, len(kept) - 1, min(args.pick, len(kept))).astype(int):
        batch = replayed(kept[k], rng, vocab, free)
        contexts = tuple(c for c, _ in kept[k])
        reread = SharedReads()(batch.entries)
        per = reread // (len(contexts) - 1)
        rows += [(f"captured {k}", StepShape.decode(contexts, reread=reread), batch)]
        for name, shape in ((f"shared {k}", StepShape.decode(contexts, reread=per * (len(contexts) - 1))),
                            (f"unshared {k}", StepShape.decode(contexts))):
            rows.append((name, shape, synthetic_batch(shape, vocab, rng)))
    for context in args.grid_context:  # the grid's shared batches of this size, beside them
        shape = StepShape.decode((context,) * args.batch, reread=(args.batch - 1) * (context - 64))
        rows.append((f"grid {context}", shape, synthetic_batch(shape, vocab, rng)))
    batches = [b for *_, b in rows]
    timed_pass(engine, batches, rng)  # warm-up
    times = np.median([timed_pass(engine, batches, rng) for _ in range(args.repeats)], axis=0)
    print(f"{args.workload}: {len(kept)} decode batches of {args.batch}; fitted "
          f"{args.fitted or 'cost_model=fitted_smollm2_cpu'}")
    print(f"{'batch':<12} {'Σcontext':>8} {'unique':>7} {'reread':>7} {'measured ms':>11} "
          f"{'predicted ms':>12} {'error':>7}")
    for (name, shape, _), t in zip(rows, times):
        predicted = fitted.step_time(shape)
        print(f"{name:<12} {shape.num_context:>8} {shape.num_context - shape.reread:>7} "
              f"{shape.reread:>7} {t * 1e3:>11.1f} {predicted * 1e3:>12.1f} "
              f"{predicted / t - 1:>+7.1%}")


if __name__ == "__main__":
    from experiments import entry
    entry(main)
