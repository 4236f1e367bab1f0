"""``python -m testbed.calibrate [overrides]``: measure engine steps, fit the simulator's cost model.

Runs a grid of real engine steps on the configured ``model``/``device``/``dtype``/``attention`` —
prefills (new tokens × cached context × batch size), decodes (batch size × context; with
``calibrate.decode_ragged`` also batches of mixed contexts, which tell a kernel padded to the
batch's longest KV from one that reads each request's own) and speculative verifications
(``calibrate.verify_new`` queries × ``verify_batch`` × the decode contexts: every query's
logits, fitted as kind ``verify``) — in
``calibrate.repeats`` passes over the grid, each shape once per pass in a shuffled order (the
median counts), fits the ``fitted`` cost model per step kind
(non-negative least squares on relative error; each measured row count, a decode's batch size
or a prefill's new tokens, priced on its own unless ``calibrate.row_table=false``; predictions are floored at the roofline of the
configured ``hardware``), and writes into the run directory:

- ``cost_model.yaml``: the coefficients with the date, model and device (use it with
  ``cost_model=fitted cost_model.path=.../cost_model.yaml``);
- ``calibration.json``: every measured step, the fit, and its error (MAPE per kind);
- ``calibration.png``: predicted against measured step time.

``calibrate.server_runs=[DIR, ...]`` fits a live server instead: the steps it ran are recovered from
the token times those ``backend=server`` runs recorded (`testbed.calibration.server_steps`; the
token budget per step is ``scheduler=vllm``'s ``max_num_batched_tokens``, else
``scheduler.chunked_prefill_size``, or ``calibrate.token_budget``), and no engine is built.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import hydra
import matplotlib
import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from testbed.config import group_values
from testbed.config.cli import check_group_choices, exit_on_bad_input
from testbed.config.assembly import assemble
from testbed.errors import BadInput

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from testbed.calibration.grid import (  # noqa: E402, F401 (the grid's names, importable here too)
    GRID_KEYS, SERVER_KNOT_STEPS, SLOT_LAYOUTS, batch_on_slots, grid, grid_slots, grid_values,
    measure, median_times, ragged_decodes, row_knots, row_table_on, server_row_knots,
    shared_contexts, shared_decodes, slot_layout, slot_order, synthetic_batch, timed_pass,
)
from testbed.calibration.server_steps import read_run, recover_steps, usable  # noqa: E402
from testbed.sim.cost_model import FittedCostModel, RooflineCostModel, save_fitted  # noqa: E402
from testbed.sim.fit import COEFFS, fit_coefficients, mape  # noqa: E402
from testbed.sim.grid_reach import grid_extent  # noqa: E402
from testbed.sim.step_shape import StepShape  # noqa: E402


def plot(samples: list[tuple[StepShape, float]], model: FittedCostModel, path: Path,
         title: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 5))
    for kind, marker in (("prefill", "o"), ("decode", "s"), ("verify", "^")):
        rows = [(t, model.step_time(s)) for s, t in samples if s.kind == kind]
        if rows:
            measured, predicted = np.array(rows).T * 1e3
            ax.scatter(measured, predicted, marker=marker, label=kind, alpha=0.8)
    lo = min(min(t for _, t in samples), min(model.step_time(s) for s, _ in samples)) * 1e3
    hi = max(max(t for _, t in samples), max(model.step_time(s) for s, _ in samples)) * 1e3
    ax.plot([lo, hi], [lo, hi], color="grey", linestyle="--", label="predicted = measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("fitted model's prediction (ms)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def engine_meta(executor: Any, model: Any, hw: Any) -> dict[str, Any]:
    """What a calibration was measured on (saved with the coefficients): with the engine's
    threads and step clock (`testbed.config.engine_timing`), which a run it predicts must share."""
    import torch

    return {"model": model.name, "device": str(executor.device), "hardware": hw.name,
            "dtype": str(executor.dtype).replace("torch.", ""),
            "attention": executor.attention_name,
            "threads": torch.get_num_threads(),
            "clock": "cpu" if executor.clock is time.thread_time else "wall",
            # the CPU's kernels (engine.cpu_kernels): a fit predicts an engine running them
            **({"cpu_kernels": executor.cpu_kernels}
               if getattr(executor, "cpu_kernels", None) is not None else {})}


def floor_check(samples: list[tuple[StepShape, float]], floor: RooflineCostModel
                ) -> dict[str, Any]:
    """How many measured steps ran faster than the roofline floor, which is then no lower bound
    on this machine (its ``hardware`` preset's peak FLOP/s or bandwidth is too low) and would
    lift the fit's predictions above what was measured; warns on stderr when any did."""
    ratios = [floor.floor(s) / t for s, t in samples if t > 0]
    above = [r for r in ratios if r > 1]
    if above:
        print(f"warning: the roofline floor of hardware={floor.hw.name} is above {len(above)} of "
              f"{len(samples)} measured steps (by up to {max(above):.2f}x): hardware.flops and "
              f"hardware.mem_bw are not upper bounds for this machine, so the fit's predictions "
              f"are floored above what it measured; raise them", file=sys.stderr)
    return {"steps_below_floor": len(above)}


def fit_and_write(samples: list[tuple[StepShape, float]], meta: dict[str, Any],
                  floor: RooflineCostModel, run_dir: Path, relative: bool = True,
                  exclude: Sequence[str] = (), row_knots: dict[str, list[int]] | None = None
                  ) -> dict[str, Any]:
    """Fit the `fitted` cost model to ``samples`` (least squares on relative error, else on
    absolute) and write ``cost_model.yaml``, ``calibration.json`` and ``calibration.png`` into
    ``run_dir``; returns the report. ``row_knots``: see `testbed.sim.fit`."""
    coeffs = fit_coefficients(samples, relative=relative, exclude=exclude,
                              row_knots=row_knots)
    fitted = FittedCostModel(coeffs, floor_model=floor)
    meta = meta | {"steps_measured": len(samples), **floor_check(samples, floor),
                   "grid": grid_extent(s for s, _ in samples)}
    run_dir.mkdir(parents=True, exist_ok=True)
    save_fitted(run_dir / "cost_model.yaml", coeffs, meta)
    errors = {kind: mape([fitted.step_time(s) for s, _ in samples if s.kind == kind],
                         [t for s, t in samples if s.kind == kind])
              for kind in ("prefill", "decode", "verify") if kind in coeffs}
    result = {"meta": meta | {"date": dt.date.today().isoformat()}, "coefficients": coeffs,
              "mape": errors, "samples": [
                  {"kind": s.kind, "new": list(s.new), "context": list(s.context),
                   **({"verify": True} if s.verify else {}),
                   "reread": s.reread, "measured_s": t, "predicted_s": fitted.step_time(s)}
                  for s, t in samples]}
    (run_dir / "calibration.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(samples, fitted, run_dir / "calibration.png",
         f"Fitted step time: {meta['model']} on {meta['device']}\n"
         "MAPE " + ", ".join(f"{kind} {e:.1%}" for kind, e in errors.items()))
    return result


def server_samples(cfg: DictConfig, run: Any) -> tuple[list[tuple[StepShape, float]], dict]:
    """The steps of ``calibrate.server_runs``, recovered from their token times, and what was
    recovered (for the meta)."""
    c = cfg.calibrate
    dirs = c.server_runs
    if isinstance(dirs, str) or not isinstance(dirs, Sequence) or not dirs:
        raise BadInput(f"calibrate.server_runs must be a non-empty list of backend=server run "
                       f"directories, got {dirs!r}")
    budget = c.get("token_budget")
    if budget is None:
        sched = run.scheduler  # vLLM's budget, else SGLang's chunk size (None: unchunked)
        budget = getattr(sched, "max_num_batched_tokens", None) or getattr(
            sched, "chunked_prefill_size", None)
    elif isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise BadInput(f"calibrate.token_budget must be an integer >= 1 or null, got {budget!r}")
    gap_s = c.get("gap_s")
    if gap_s is not None and (isinstance(gap_s, bool) or not isinstance(gap_s, (int, float))
                              or gap_s <= 0):
        raise BadInput(f"calibrate.gap_s must be a number > 0 or null, got {gap_s!r}")
    exclude = c.get("exclude_terms") or []
    if isinstance(exclude, str) or not isinstance(exclude, Sequence) \
            or any(t not in COEFFS for t in exclude):
        raise BadInput(f"calibrate.exclude_terms must be a list of the fitted form's terms "
                       f"({', '.join(COEFFS)}), got {exclude!r}")
    # the cache's unit of sharing: a prompt's KV is shared in whole blocks (pages)
    unit = cfg.cache.get("block_size") or cfg.cache.get("page_size") or 1
    samples, recovered, merged = [], 0, 0
    for d in dirs:
        steps = recover_steps(read_run(d), budget, gap_s, unit)
        recovered, merged = recovered + len(steps), merged + sum(s.merged for s in steps)
        samples += [(s.shape, s.duration_s) for s in usable(steps)]
    if not samples:
        raise BadInput(f"calibrate.server_runs: no steps recovered from {list(dirs)}")
    return samples, {"server_runs": [str(d) for d in dirs], "exclude_terms": list(exclude),
                     "token_budget": budget, "share_unit": unit,
                     "gap_s": gap_s, "steps_recovered": recovered, "steps_merged": merged}


def calibrate(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    run = assemble(cfg)
    model, hw = run.model_shape, run.hardware
    if cfg.calibrate.get("server_runs") is not None:
        samples, meta = server_samples(cfg, run)
        meta = {"model": model.name, "device": "server", "hardware": hw.name,
                "fit": "absolute error", **meta}
        # absolute error: a recovered step's time is noisier than a timed one (a burst's steps
        # share theirs), and what a served run adds up is the steps' total
        return fit_and_write(samples, meta, RooflineCostModel(model, hw), run_dir,
                             relative=False, exclude=meta["exclude_terms"],
                             row_knots=server_row_knots(cfg.calibrate, samples))
    if run.backend != "engine":
        raise BadInput(f"testbed.calibrate measures the engine: backend must be engine, got "
                       f"{run.backend}")
    c = cfg.calibrate
    steps = grid(c)
    repeats = group_values.integer(c, "repeats", "calibrate", minimum=1)
    layout = slot_layout(c)
    knots = row_knots(c, steps)
    executor = run.build_executor(grid_slots(steps))
    samples = measure(executor, steps, repeats, model.vocab_size, run.seed,
                      run.get("progress", False), layout)
    return fit_and_write(samples, {**engine_meta(executor, model, hw), "slot_layout": layout},
                         RooflineCostModel(model, hw), run_dir, row_knots=knots)


@hydra.main(version_base=None, config_path="../conf", config_name="calibrate")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with exit_on_bad_input():
        result = calibrate(cfg, run_dir)
    meta = result["meta"]
    print(f"calibrated {meta['model']} on {meta['device']}: {meta['steps_measured']} steps")
    if "server_runs" in meta:
        print(f"  recovered from the token times of {len(meta['server_runs'])} server run(s): "
              f"{meta['steps_recovered']} steps, {meta['steps_merged']} merged (left out)")
    for kind, coeffs in result["coefficients"].items():
        terms = "  ".join(f"{k}={v:.3g}" for k, v in coeffs.items())
        print(f"  {kind:<8} {terms}   MAPE {result['mape'][kind]:.1%}")
    print(f"cost model in {run_dir / 'cost_model.yaml'} "
          f"(use: cost_model=fitted cost_model.path={run_dir / 'cost_model.yaml'})")


if __name__ == "__main__":
    check_group_choices(sys.argv[1:], name="calibrate")
    main()
