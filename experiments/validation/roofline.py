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
extrapolated, see testbed/sim/vidur_cost.py).

    python experiments/roofline_vs_vidur_profile.py [PROFILE_DIR]     # ~15 s

The figures in testbed/sim/cost_model.py's docstring come from this script.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testbed.assembly import assemble, compose_config  # noqa: E402
from testbed.sim import cost_model  # noqa: E402
from testbed.sim.cost_model import RooflineCostModel, StepShape  # noqa: E402
from testbed.sim.vidur_cost import NCCL_LAUNCH_S  # noqa: E402

DEFAULT_PROFILE = ROOT.parent / "shared" / "vidur" / "a100_codellama34b_tp2"


def loaded(seed: int = 0) -> dict[str, list[StepShape]]:
    """Whole steps of a loaded server, in the profile's range (the fit's shapes)."""
    rng = np.random.default_rng(seed)
    decode = [StepShape.decode(rng.integers(64, 4033, int(rng.integers(64, 129))).tolist())
              for _ in range(300)]
    prefill = []
    for _ in range(300):
        k = int(rng.integers(1, 5))
        prefill.append(StepShape(rng.integers(32, 4096 // k + 1, k).tolist(), [0] * k))
    return {"decode, 64-128 requests": decode, "prefill, 1-4 fresh prompts": prefill}


def grid() -> dict[str, list[StepShape]]:
    """Single shapes by kind: in the profile's range, and past it."""
    decode = [StepShape.decode([k] * b) for b in (1, 2, 4, 8, 16, 32, 64, 128)
              for k in (128, 512, 1024, 2048, 4032)]
    fresh = [StepShape((n,), (0,)) for n in (64, 128, 256, 512, 1024, 2048, 3072, 4096)]
    cached = [StepShape((n,), (c,)) for n in (64, 256, 512, 1024, 2048)
              for c in (512, 1024, 2048, 4032 - n) if n + c <= 4096]
    long_decode = [StepShape.decode([k] * b) for b in (1, 8, 32, 128) for k in (16384, 65536)]
    long_prefill = [StepShape((n,), (c,)) for n in (512, 2048, 8192) for c in (8192, 32768, 100000)]
    return {"decode, 1-128 requests": decode, "prefill, nothing cached": fresh,
            "prefill over a cache": cached, "decode past the profile": long_decode,
            "prefill past the profile": long_prefill}


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
    prefill, full = vidur.profile.prefill, r
    flops, seconds = [], []
    for i, n in enumerate(prefill.rows):
        for j, c in enumerate(prefill.cols):
            if np.isfinite(prefill.values[i, j]):
                flops.append(full.attention_flops(StepShape((int(n),), (int(c),)))
                             / model.num_layers)
                seconds.append(prefill.values[i, j])
    eff = np.array(flops) / (hw.flops * np.array(seconds))
    attn_mfu = sum(flops) / (hw.flops * sum(seconds))
    print(f"prefill attention at {eff.size} profiled points: FLOPs / (peak x time) "
          f"{eff.min():.2f}-{eff.max():.2f}, median {np.median(eff):.2f}, overall {attn_mfu:.3f}")

    # the all-reduce: latency + bytes / (bandwidth x efficiency), from 512 KiB up
    per_token = model.hidden_size * model.dtype_bytes
    tokens = np.array([32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096])
    measured_ar = np.array([vidur.allreduce.at(t * per_token) for t in tokens])
    moved = 2 * (model.tp - 1) / model.tp * tokens * per_token

    def ar_residuals(x):
        return np.log(x[0] + moved / (hw.interconnect_bw * x[1])) - np.log(measured_ar)

    latency, ar_eff = least_squares(ar_residuals, x0=[1e-5, 0.6],
                                    bounds=([0.0, 0.05], [1e-3, 1.0])).x
    print(f"all-reduce from {tokens[0] * per_token // 1024} KiB: {latency * 1e6:.1f} us + bytes / "
          f"({ar_eff:.3f} x {hw.interconnect_bw / 1e9:.0f} GB/s), within "
          f"{np.abs(np.exp(ar_residuals((latency, ar_eff))) - 1).max():.0%}; with Vidur's NCCL "
          f"launch {NCCL_LAUNCH_S * 1e6:.0f} us: {(latency + NCCL_LAUNCH_S) * 1e6:.0f} us per call "
          f"(shipped {cost_model.ALLREDUCE_LATENCY_S * 1e6:.0f} us)")

    fit = loaded()
    fit_on = [s for steps in fit.values() for s in steps]
    measured = np.array([vidur.step_time(s) for s in fit_on])

    def residuals(x):  # the roofline at trial efficiencies: built here, outside any config
        r = RooflineCostModel(model, hw, mfu=x[0], attn_mfu=attn_mfu, mbu=x[1], overhead_s=0.0)
        return np.log([r.step_time(s) for s in fit_on]) - np.log(measured)

    x = least_squares(residuals, x0=[0.6, 0.6], bounds=([0.05] * 2, [1.0] * 2)).x
    print(f"fitted on {len(fit_on)} loaded steps: mfu={x[0]:.3f} attn_mfu={attn_mfu:.3f} "
          f"mbu={x[1]:.3f}")
    print(f"shipped defaults: mfu={r.mfu} attn_mfu={r.attn_mfu} mbu={r.mbu}, "
          f"overhead_s={hw.step_overhead_s} (hardware=a100)")
    print(f"{'step kind':<28} {'shapes':>6} {'min':>6} {'median':>7} {'max':>6}   "
          "(roofline / Vidur, GPU time)")
    for kind, steps in (fit | grid()).items():
        ratio = np.array([r.step_time(s) / vidur.step_time(s) for s in steps])
        print(f"{kind:<28} {len(steps):>6} {ratio.min():6.2f} {np.median(ratio):7.2f} "
              f"{ratio.max():6.2f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_PROFILE)
