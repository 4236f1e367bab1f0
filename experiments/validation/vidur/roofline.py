"""The roofline's efficiencies, fitted to a Vidur profile, and the error that remains per step kind.

Builds `VidurCostModel` (measured operators, priced as Vidur 0.0.26 prices a batch: its rounding,
decode batching overhead and NCCL launches, no per-step CPU time) and `RooflineCostModel` for
CodeLlama-34B at TP2 on an A100, both without a per-step overhead (Vidur counts none). Three fits:

- ``attn_mfu`` from attention alone: its FLOPs over the measured time of every profiled prefill
  attention point;
- the all-reduce: ``latency + bytes / (300 GB/s · efficiency)`` by least squares (log) on the
  profile's TP2 all-reduces from 512 KiB (32 tokens of CodeLlama-34B) up, the sizes of loaded
  decode and prefill steps; the roofline's per-call latency (``ALLREDUCE_LATENCY_S``) is that
  latency plus Vidur's 20 µs NCCL CPU launch (smaller messages take 14–24 µs on the GPU);
- ``mfu`` and ``mbu`` by least squares on log(roofline / Vidur) over whole steps of a loaded
  server, in the profile's range (seeded): 300 decode batches of 64–128 requests, each request's
  context drawn from 64–4,032 tokens, and 300 prefill batches of 1–4 fresh prompts of 32–4,096
  tokens in all. Under load the step times set the throughput and errors compound in the queue
  (at the Azure trace's recorded rate, 1 % of step time is ~3.5 % of TTFT), and loaded decode
  batches are large: fitted over batches of 1–128 requests, mbu comes out 0.62 and the roofline
  is 10 % fast on the trace's 96–128-request batches (the matmuls near the ridge point: a
  128-token step is 20 % slower than a 64-token one in the profile, where the roofline sees the
  same weight bytes). A per-step overhead is not fitted: Vidur counts none, and left free it
  trades against mbu (0 with small batches in the fit, 10 ms with loaded ones only).

It prints roofline / Vidur per step kind for the shipped defaults (the fits, rounded), on the
fitted shapes, on a grid of single shapes in the profile's range and past it (Vidur's side
extrapolated, see testbed/sim/vidur_cost.py). The shapes and the fits are
`testbed.sim.roofline_fit` (tests/test_cost_model.py bounds the same ratios).

    python -m experiments.validation.vidur.roofline [PROFILE_DIR]     # ~15 s

The figures in testbed/sim/cost_model.py's docstring come from this script.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from testbed.config.assembly import assemble, compose_config
from testbed.data import local_path, lookup
from testbed.sim import cost_model
from testbed.sim.roofline_fit import (ALLREDUCE_TOKENS, attention_efficiency, fit_allreduce,
                                      fit_mfu_mbu, grid_steps, loaded_steps, ratios)
from testbed.sim.vidur_cost import NCCL_LAUNCH_S

DEFAULT_PROFILE = local_path(lookup("vidur_a100_codellama34b_tp2"))  # the data folder's


def main(profile_dir: Path) -> None:
    def cost(*overrides: str):
        run = assemble(compose_config(["model=codellama_34b", "hardware=a100", *overrides]))
        return run, run.build_cost_model()

    # Vidur's step times (no per-step overhead, as Vidur 0.0.26) and the shipped roofline without
    # the hardware's step overhead, both from the run config
    run, vidur = cost("cost_model=vidur", f"cost_model.profile_dir={Path(profile_dir).resolve()}")
    model, hw = run.model_shape, run.hardware
    _, r = cost("cost_model=roofline", "cost_model.overhead_s=0.0")

    # attention alone first: its FLOPs over every profiled prefill point's measured time
    eff, attn_mfu = attention_efficiency(vidur, r)
    print(f"prefill attention at {eff.size} profiled points: FLOPs / (peak x time) "
          f"{eff.min():.2f}-{eff.max():.2f}, median {np.median(eff):.2f}, overall {attn_mfu:.3f}")

    # the all-reduce: latency + bytes / (bandwidth x efficiency), from 512 KiB up
    latency, ar_eff, error = fit_allreduce(vidur, model, hw)
    smallest = ALLREDUCE_TOKENS[0] * model.hidden_size * model.dtype_bytes // 1024
    print(f"all-reduce from {smallest} KiB: {latency * 1e6:.1f} us + bytes / "
          f"({ar_eff:.3f} x {hw.interconnect_bw / 1e9:.0f} GB/s), within {error:.0%}; with "
          f"Vidur's NCCL launch {NCCL_LAUNCH_S * 1e6:.0f} us: "
          f"{(latency + NCCL_LAUNCH_S) * 1e6:.0f} us per call "
          f"(shipped {cost_model.ALLREDUCE_LATENCY_S * 1e6:.0f} us)")

    fit = loaded_steps()
    fit_on = [s for steps in fit.values() for s in steps]
    mfu, mbu = fit_mfu_mbu(vidur, model, hw, attn_mfu, fit_on)
    print(f"fitted on {len(fit_on)} loaded steps: mfu={mfu:.3f} attn_mfu={attn_mfu:.3f} "
          f"mbu={mbu:.3f}")
    print(f"shipped defaults: mfu={r.mfu} attn_mfu={r.attn_mfu} mbu={r.mbu}, "
          f"overhead_s={hw.step_overhead_s} (hardware=a100)")
    print(f"{'step kind':<28} {'shapes':>6} {'min':>6} {'median':>7} {'max':>6}   "
          "(roofline / Vidur, GPU time)")
    for kind, steps in (fit | grid_steps()).items():
        ratio = ratios(r, vidur, steps)
        print(f"{kind:<28} {len(steps):>6} {ratio.min():6.2f} {np.median(ratio):7.2f} "
              f"{ratio.max():6.2f}")


if __name__ == "__main__":
    from experiments import entry

    ap = argparse.ArgumentParser(prog="python -m experiments.validation.vidur.roofline",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("profile_dir", nargs="?", type=Path, default=DEFAULT_PROFILE,
                    help="a Vidur profile folder (default: %(default)s)")
    entry(main, ap.parse_args().profile_dir)
