"""The roofline's efficiencies, fitted to a Vidur profile, and the error that remains per step kind.

Builds `VidurCostModel` (measured operators) and `RooflineCostModel` for CodeLlama-34B at TP2 on an
A100, both without the per-step CPU overhead (GPU time only, as Vidur profiles it). ``attn_mfu``
comes from attention alone: its FLOPs over the measured time of every profiled prefill attention
point. ``mfu`` and ``mbu`` are then fitted by least squares on log(roofline / Vidur) over whole
steps in the profile's range: decode batches of 1–128 requests at 128–4,032 tokens of context,
and single prefill chunks of 64–4,096 tokens over 0–4,032 cached ones (chunk + cache ≤ 4,096).
It prints roofline / Vidur per step kind for the shipped defaults (the fit, rounded), on those
shapes and on long-context shapes past the profile (Vidur's side extrapolated, see
testbed/sim/vidur_cost.py).

    python experiments/roofline_vs_vidur_profile.py [PROFILE_DIR]     # ~5 s

The figures in testbed/sim/cost_model.py's docstring come from this script.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import least_squares

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testbed.sim.cost_model import RooflineCostModel, StepShape  # noqa: E402
from testbed.sim.specs import hardware_spec, model_spec  # noqa: E402
from testbed.sim.vidur_cost import VidurCostModel  # noqa: E402
from testbed.sim.vidur_profile import load_vidur_profile  # noqa: E402

DEFAULT_PROFILE = ROOT.parent / "shared" / "vidur" / "a100_codellama34b_tp2"


def shapes() -> dict[str, list[StepShape]]:
    """Step shapes by kind: in the profile's range, and past it."""
    decode = [StepShape.decode([k] * b) for b in (1, 2, 4, 8, 16, 32, 64, 128)
              for k in (128, 512, 1024, 2048, 4032)]
    fresh = [StepShape((n,), (0,)) for n in (64, 128, 256, 512, 1024, 2048, 3072, 4096)]
    cached = [StepShape((n,), (c,)) for n in (64, 256, 512, 1024, 2048)
              for c in (512, 1024, 2048, 4032 - n) if n + c <= 4096]
    long_decode = [StepShape.decode([k] * b) for b in (1, 8, 32, 128) for k in (16384, 65536)]
    long_prefill = [StepShape((n,), (c,)) for n in (512, 2048, 8192) for c in (8192, 32768, 100000)]
    return {"decode": decode, "prefill, nothing cached": fresh, "prefill over a cache": cached,
            "decode past the profile": long_decode, "prefill past the profile": long_prefill}


def roofline(model, hw, x) -> RooflineCostModel:
    return RooflineCostModel(model, hw, mfu=x[0], attn_mfu=x[1], mbu=x[2], overhead_s=0.0)


def main(profile_dir: Path) -> None:
    def conf(group: str, name: str) -> dict:
        return yaml.safe_load((ROOT / "conf" / group / f"{name}.yaml").read_text())

    model, hw = model_spec(conf("model", "codellama_34b")), hardware_spec(conf("hardware", "a100"))
    vidur = VidurCostModel(load_vidur_profile(profile_dir, model), model, overhead_s=0.0)
    kinds = shapes()
    fit_on = kinds["decode"] + kinds["prefill, nothing cached"] + kinds["prefill over a cache"]
    measured = np.array([vidur.step_time(s) for s in fit_on])

    # attention alone first: its FLOPs over every profiled prefill point's measured time
    grid, full = vidur.profile.prefill, RooflineCostModel(model, hw)
    flops, seconds = [], []
    for i, n in enumerate(grid.rows):
        for j, c in enumerate(grid.cols):
            if np.isfinite(grid.values[i, j]):
                flops.append(full.attention_flops(StepShape((int(n),), (int(c),)))
                             / model.num_layers)
                seconds.append(grid.values[i, j])
    eff = np.array(flops) / (hw.flops * np.array(seconds))
    attn_mfu = sum(flops) / (hw.flops * sum(seconds))
    print(f"prefill attention at {eff.size} profiled points: FLOPs / (peak x time) "
          f"{eff.min():.2f}-{eff.max():.2f}, median {np.median(eff):.2f}, overall {attn_mfu:.3f}")

    def residuals(x):
        r = roofline(model, hw, (x[0], attn_mfu, x[1]))
        return np.log([r.step_time(s) for s in fit_on]) - np.log(measured)

    x = least_squares(residuals, x0=[0.6, 0.7], bounds=([0.05] * 2, [1.0] * 2)).x
    x = (x[0], attn_mfu, x[1])
    print(f"fitted on {len(fit_on)} profiled shapes: mfu={x[0]:.3f} attn_mfu={x[1]:.3f} "
          f"mbu={x[2]:.3f}")
    r = RooflineCostModel(model, hw, overhead_s=0.0)
    print(f"shipped defaults: mfu={r.mfu} attn_mfu={r.attn_mfu} mbu={r.mbu}")
    print(f"{'step kind':<26} {'shapes':>6} {'min':>6} {'median':>7} {'max':>6}   "
          "(roofline / Vidur, GPU time)")
    for kind, steps in kinds.items():
        ratio = np.array([r.step_time(s) / vidur.step_time(s) for s in steps])
        print(f"{kind:<26} {len(steps):>6} {ratio.min():6.2f} {np.median(ratio):7.2f} "
              f"{ratio.max():6.2f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_PROFILE)
