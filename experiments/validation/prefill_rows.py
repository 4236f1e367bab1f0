"""What does a prefill cost per token, by its number of rows? SmolLM2-135M on this CPU's engine.

Times prefill steps side by side (shuffled, ``--repeats`` passes, medians; fp32, one torch thread,
CPU clock) on fresh prompts, each step given as requests' new-token counts (``--step 477``,
``--step 146,477,50,218`` for four requests), and prints each step's time, its time per token and
a fitted cost model's prediction (``--fitted``, default the shipped
``cost_model=fitted_smollm2_cpu``). A CPU BLAS changes its code path with the number of rows it
multiplies, so the cost per token need not fall steadily with the rows; where it bumps between
the row counts a grid measured, a fit interpolating between them prices such steps short.

    python -m experiments.validation.prefill_rows [--step 256 477 891 1024 146,477,50,218 ...]
        [--repeats 6] [--fitted PATH]

Used in docs/results/sim_vs_engine.md (chat's first prefill).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from experiments.validation import sim_vs_engine as sve
from testbed.config.assembly import assemble
from testbed.calibrate import synthetic_batch, timed_pass
from testbed.sim.step_shape import StepShape

DEFAULT_STEPS = ["256", "477", "891", "1024", "222,222,222,222", "256,256,256,256",
                 "146,477,50,218"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.validation.prefill_rows",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--step", nargs="+", default=DEFAULT_STEPS,
                    help="a prefill step: its requests' new tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--fitted", default=None, help="a fitted cost model's file (default: the "
                    "shipped cost_model=fitted_smollm2_cpu)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sve.BASE[:] = sve.REAL["base"]
    run = assemble(sve.config(["engine.forced=true"], "calibrate"))
    shapes = [StepShape(tuple(int(n) for n in step.split(",")), (0,) * len(step.split(",")))
              for step in args.step]
    engine = run.build_executor(max(s.num_new for s in shapes) + 16)
    engine.clock = time.thread_time
    fitted = sve.fitted_model(args.fitted)
    rng = np.random.default_rng(0)
    batches = [synthetic_batch(s, run.model_shape.vocab_size, rng) for s in shapes]
    timed_pass(engine, batches, rng)  # warm-up
    times = np.median([timed_pass(engine, batches, rng) for _ in range(args.repeats)], axis=0)
    print(f"{'step (new tokens)':<20} {'rows':>5} {'measured ms':>11} {'ms/token':>8} "
          f"{'predicted ms':>12} {'error':>7}")
    for step, shape, t in zip(args.step, shapes, times):
        predicted = fitted.step_time(shape)
        print(f"{step:<20} {shape.num_new:>5} {t * 1e3:>11.1f} {t * 1e3 / shape.num_new:>8.3f} "
              f"{predicted * 1e3:>12.1f} {predicted / t - 1:>+7.1%}")


if __name__ == "__main__":
    from experiments import entry
    entry(main)
