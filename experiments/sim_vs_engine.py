"""Does the simulator predict the engine? Calibrate, then compare both backends on held-back work.

1. Calibrate the fitted cost model on a grid of engine steps (``testbed.calibrate``), unless
   ``--fitted FILE`` is given.
2. For each held-back workload (tree-of-thought and chat by default, never part of the grid), run
   the engine (forced outputs, steps recorded; a first pass warms it up) and the simulator with the
   fitted model, both
   through the same scheduler and cache, and report: per-step MAPE (the fitted model on each step
   the engine ran), and the simulator's errors on makespan, throughput, p50 TTFT and p50 e2e.
3. Offline batch check: on a workload without dependencies (few-shot, all at t=0), timing cannot
   change decisions, so both backends must make identical steps and identical hits.

    python experiments/sim_vs_engine.py [--out DIR] [--fitted cost_model.yaml]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from testbed.backends import build_cache, container  # noqa: E402
from testbed.calibrate import calibrate  # noqa: E402
from testbed.engine import make_engine_executor  # noqa: E402
from testbed.metrics import summarize  # noqa: E402
from testbed.sim.cost_model import RooflineCostModel, StepShape, load_fitted  # noqa: E402
from testbed.sim.executor import SimExecutor  # noqa: E402
from testbed.sim.fit import mape  # noqa: E402
from testbed.sim.simulate import records_of, serve  # noqa: E402
from testbed.sim.specs import hardware_spec, model_spec  # noqa: E402
from testbed.workloads import build_workload  # noqa: E402

BASE = ["model=tiny", "hardware=cpu", "progress=false", "workload.vocab_size=256"]
HELD_BACK = {
    "tree_of_thought": ["workload=tree_of_thought", "workload.num_problems=8"],
    "chat": ["workload=chat", "workload.num_sessions=12"],
}
OFFLINE = ["workload=few_shot", "workload.num_tasks=4", "workload.questions_per_task=8"]
CAPACITY = 6000  # tokens: small enough that eviction happens


def config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose("config", overrides=BASE + overrides)


def both(cfg, fitted) -> dict:
    requests = build_workload(container(cfg.workload), seed=cfg.seed, arrival=container(cfg.arrival))
    engine = make_engine_executor(container(cfg.model), num_slots=CAPACITY, seed=cfg.seed,
                                  forced=True)
    runs = {}
    # The engine serves the workload twice and the second run counts: CPU torch builds its
    # kernels per new shape on first use, a one-time cost the step model does not describe.
    for name, executor, passes in (("engine", engine, 2), ("sim", SimExecutor(fitted), 1)):
        for _ in range(passes):
            scheduler, result = serve(requests, build_cache(cfg, CAPACITY, requests),
                                      container(cfg.scheduler), executor, seed=cfg.seed,
                                      max_in_flight=cfg.workload.get("max_in_flight"),
                                      record_steps=True)
        runs[name] = (result, summarize(records_of(result.reqs), 0.0, 0.0, scheduler.preemptions))
    return runs


def error(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else (a - b) / b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "sim_vs_engine")
    ap.add_argument("--fitted", type=Path, help="a cost_model.yaml (skips calibration)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = config([])
    model, hw = model_spec(container(cfg.model)), hardware_spec(container(cfg.hardware))
    if args.fitted is None:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            cal_cfg = compose("calibrate", overrides=BASE)
        result = calibrate(cal_cfg, args.out / "calibration")
        print(f"calibrated: MAPE on the grid prefill {result['mape']['prefill']:.1%}, "
              f"decode {result['mape']['decode']:.1%}")
        args.fitted = args.out / "calibration" / "cost_model.yaml"
    fitted = load_fitted(args.fitted, floor_model=RooflineCostModel(model, hw))

    report = {"fitted": str(args.fitted), "held_back": {}}
    print(f"\n{'workload':<17}{'steps':>6}{'step MAPE':>10}{'makespan':>10}{'req/s':>8}"
          f"{'TTFT p50':>10}{'e2e p50':>9}   (simulator's error against the engine)")
    for name, overrides in HELD_BACK.items():
        runs = both(config(overrides), fitted)
        (eng, es), (_, ss) = runs["engine"], runs["sim"]
        steps = [(StepShape(s.new, s.context), s.duration_s) for s in eng.steps]
        row = {"steps": len(steps),
               "step_mape": mape([fitted.step_time(s) for s, _ in steps], [t for _, t in steps]),
               "makespan": error(ss["makespan_s"], es["makespan_s"]),
               "throughput": error(ss["throughput_req_s"], es["throughput_req_s"]),
               "ttft_p50": error(ss["ttft_p50_s"], es["ttft_p50_s"]),
               "e2e_p50": error(ss["e2e_p50_s"], es["e2e_p50_s"]),
               "engine_makespan_s": es["makespan_s"], "sim_makespan_s": ss["makespan_s"]}
        report["held_back"][name] = row
        print(f"{name:<17}{row['steps']:>6}{row['step_mape']:>10.1%}{row['makespan']:>+10.1%}"
              f"{row['throughput']:>+8.1%}{row['ttft_p50']:>+10.1%}{row['e2e_p50']:>+9.1%}")

    runs = both(config(OFFLINE), fitted)
    (eng, es), (sim, ss) = runs["engine"], runs["sim"]
    same_steps = [(s.kind, s.ids, s.new, s.context) for s in eng.steps] == \
        [(s.kind, s.ids, s.new, s.context) for s in sim.steps]
    same_hits = [r.cached_tokens for r in eng.reqs] == [r.cached_tokens for r in sim.reqs]
    report["offline_batch"] = {"identical_steps": same_steps, "identical_hits": same_hits,
                               "steps": len(eng.steps)}
    print(f"\noffline batch (few-shot, {len(eng.steps)} steps): identical step compositions "
          f"{same_steps}, identical cached_tokens per request {same_hits}")
    (args.out / "sim_vs_engine.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out / 'sim_vs_engine.json'}")


if __name__ == "__main__":
    main()
