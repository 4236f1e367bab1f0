"""The roofline's efficiencies fitted to a Vidur profile: the step shapes and the three fits.

`RooflineCostModel`'s defaults (``attn_mfu``, ``mfu``, ``mbu`` and the all-reduce's per-call
latency) come from these fits on the CodeLlama-34B TP2 A100 profile, against `VidurCostModel`
priced as Vidur 0.0.26 prices a batch (no per-step overhead):

- `attention_efficiency`: ``attn_mfu``, the profiled prefill attention's FLOPs over its measured
  time at every profiled point;
- `fit_allreduce`: ``latency + bytes / (interconnect · efficiency)`` by least squares (log) on the
  profile's all-reduces from 512 KiB (32 tokens of CodeLlama-34B) up, the sizes of loaded steps;
- `fit_mfu_mbu`: ``mfu`` and ``mbu`` by least squares on log(roofline / Vidur) over the whole
  steps of a loaded server (`loaded_steps`).

`grid_steps` holds single shapes by kind, in the profile's range and past it, on which
``python -m experiments.validation.vidur.roofline`` prints the ratios that remain (the figures in
cost_model.py's docstring) and tests/test_cost_model.py bounds them.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from scipy.optimize import least_squares

from testbed.sim.cost_model import RooflineCostModel
from testbed.sim.step_shape import StepShape

# all-reduce sizes of the fit, in tokens of hidden state (512 KiB up for CodeLlama-34B)
ALLREDUCE_TOKENS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def loaded_steps(seed: int = 0) -> dict[str, list[StepShape]]:
    """Whole steps of a loaded server, in the profile's range (the fit's shapes): 300 decode
    batches of 64-128 requests at contexts of 64-4,032 tokens, 300 prefill batches of 1-4 fresh
    prompts of 32-4,096 tokens in all."""
    rng = np.random.default_rng(seed)
    decode = [StepShape.decode(rng.integers(64, 4033, int(rng.integers(64, 129))).tolist())
              for _ in range(300)]
    prefill = []
    for _ in range(300):
        k = int(rng.integers(1, 5))
        prefill.append(StepShape(rng.integers(32, 4096 // k + 1, k).tolist(), [0] * k))
    return {"decode, 64-128 requests": decode, "prefill, 1-4 fresh prompts": prefill}


def grid_steps() -> dict[str, list[StepShape]]:
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


def ratios(model, reference, steps: Iterable[StepShape]) -> np.ndarray:
    """``model``'s step time over ``reference``'s, per step."""
    return np.array([model.step_time(s) / reference.step_time(s) for s in steps])


def attention_efficiency(vidur, roofline: RooflineCostModel) -> tuple[np.ndarray, float]:
    """Per profiled prefill-attention point, its FLOPs (``roofline``'s count, one layer) over
    peak FLOP/s × measured time; and all points' FLOPs over peak × all their time (``attn_mfu``)."""
    prefill, layers, peak = vidur.profile.prefill, roofline.model.num_layers, roofline.hw.flops
    flops, seconds = [], []
    for i, n in enumerate(prefill.rows):
        for j, c in enumerate(prefill.cols):
            if np.isfinite(prefill.values[i, j]):
                flops.append(roofline.attention_flops(StepShape((int(n),), (int(c),))) / layers)
                seconds.append(prefill.values[i, j])
    return np.array(flops) / (peak * np.array(seconds)), sum(flops) / (peak * sum(seconds))


def fit_allreduce(vidur, model, hw) -> tuple[float, float, float]:
    """The profiled all-reduce as ``latency + bytes moved / (interconnect_bw · efficiency)``:
    (latency in seconds, efficiency, the largest relative error of the fit)."""
    per_token = model.hidden_size * model.dtype_bytes
    tokens = np.array(ALLREDUCE_TOKENS)
    measured = np.array([vidur.allreduce.at(t * per_token) for t in tokens])
    moved = 2 * (model.tp - 1) / model.tp * tokens * per_token

    def residuals(x):
        return np.log(x[0] + moved / (hw.interconnect_bw * x[1])) - np.log(measured)

    latency, efficiency = least_squares(residuals, x0=[1e-5, 0.6],
                                        bounds=([0.0, 0.05], [1e-3, 1.0])).x
    error = np.abs(np.exp(residuals((latency, efficiency))) - 1).max()
    return float(latency), float(efficiency), float(error)


def fit_mfu_mbu(vidur, model, hw, attn_mfu: float,
                steps: list[StepShape]) -> tuple[float, float]:
    """``mfu`` and ``mbu`` minimising Σ log(roofline / Vidur)² over ``steps`` (no overhead)."""
    measured = np.array([vidur.step_time(s) for s in steps])

    def residuals(x):  # the roofline at trial efficiencies: built here, outside any config
        r = RooflineCostModel(model, hw, mfu=x[0], attn_mfu=attn_mfu, mbu=x[1], overhead_s=0.0)
        return np.log([r.step_time(s) for s in steps]) - np.log(measured)

    mfu, mbu = least_squares(residuals, x0=[0.6, 0.6], bounds=([0.05] * 2, [1.0] * 2)).x
    return float(mfu), float(mbu)
