"""Does the simulator predict the engine? Calibrate, then compare both backends on held-back work.

On one engine (forced outputs, the same scheduler and cache as the simulator), ``--rounds`` times
in turn: one pass over the calibration grid of ``conf/calibrate.yaml`` (each shape once, random
order) and one run of each held-back workload (tree-of-thought and chat by default, never part of
the grid). The cost model is fitted to the grid's median step times (``testbed.calibrate``; or
``--fitted FILE`` is used and the grid skipped), the simulator runs each workload with it, and the
simulator's errors are reported against the engine's median over rounds: makespan, throughput,
TTFT p50 and p99, TPOT p50 and e2e p50, plus the per-step MAPE over every engine step (each step,
measured and predicted, in ``steps_<workload>.csv``) and the engine's own spread over rounds
(max − min over the median) of each. Interleaving matters on a shared
machine whose speed drifts by 10-30% over seconds: calibration and validation then see the same
drift, and the engine's own spread over rounds (printed) is the noise floor of every figure.

The engine's timeline is its serving loop's (`testbed.serving.step_cycle`): each step's device
time (``gpu_s``; on the CPU, launch's work: forward and sampling) plus the host's work around it
(``host_s``: forming the batch, preparing nothing the device sees, reading the tokens back,
applying them). The cost model is fitted to the device's time on the grid; the host's is priced
apart (`testbed.sim.overlap.HostCost`), fitted each round on a served workload held apart from
both the grid and the held-back ones (`HOST`, a random tree of continuations); the CPU engine is
synchronous, so it hides nothing of it even under ``scheduler.overlap=true`` (``--overlap``
runs both sides so).

Offline batch check: on a workload without dependencies (few-shot, all at t=0), timing cannot
change decisions, so both backends must make identical steps and identical hits.

``--real``: the real model (``model=smollm2_135m``, fp32 on the CPU) on four held-back text
workloads — ShareGPT chat, tree-of-thought, few-shot in text and a closed loop of 8 over ShareGPT
prompts — sized so one round of all four takes 1–2 minutes on a 2-core machine, with a reduced grid
that covers their shapes (`REAL`); 4 rounds by default, and the engine's steps clocked in CPU
seconds (``--clock cpu``, below).

``--clock cpu`` (a CPU engine only) reads each engine step's duration, in the grid and in the
served runs alike, as the stepping thread's CPU time (``time.thread_time``) instead of wall time: on a
machine shared with other jobs, their time slices stretch a step's wall time by up to 2x from one
minute to the next, which no step-time model can predict, while the CPU time the step itself
takes moves far less (memory bandwidth and caches are still shared). With one torch thread, on an
idle machine, the two coincide; the report gives each workload's wall time over CPU time.

    python -m experiments.validation.sim_vs_engine [--real] [--overlap] [--few-shot] [--out DIR] \
        [--rounds 7] [--fitted cost_model.yaml] [overrides, e.g. model=llama2_7b hardware=h200
        device=cuda dtype=bfloat16 attention=triton]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from experiments import REPO, entry

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from testbed.config.assembly import assemble, compose_config
from testbed.calibrate import (engine_meta, fit_and_write, grid, row_knots,
                               grid_slots, median_times, slot_layout, synthetic_batch, timed_pass)
from testbed.results.metrics import summarize
from testbed.sim.cost_model import FittedCostModel, RooflineCostModel, StepShape
from testbed.sim.executor import SimExecutor
from testbed.sim.fit import fit_coefficients, mape
from testbed.sim.overlap import HostCost, fit_host_cost
from testbed.serving.serve import records_of, serve

# plain decode on both sides: the simulator here is built with SimExecutor(fitted) (no cascade
# groups), while the CPU engine's default attention decodes in cascade
BASE = ["model=tiny", "hardware=cpu", "progress=false", "workload.vocab_size=256",
        "engine.attention=torch"]
EXTRA: list[str] = []  # the command line's overrides, applied after BASE (e.g. a GPU model)
HELD_BACK = {
    "tree_of_thought": ["workload=tree_of_thought", "workload.num_problems=8"],
    "chat": ["workload=chat", "workload.num_sessions=12"],
}
OFFLINE = ["workload=few_shot", "workload.num_tasks=4", "workload.questions_per_task=8"]
#: --few-shot: few-shot held back too (its first step one batch of every question over the
#: cached examples, then decode steps of 16-token answers)
FEW_SHOT = ["workload=few_shot", "workload.num_tasks=4", "workload.questions_per_task=8",
            "workload.output_len=16"]
#: the served workload the host's time per step is fitted on, each round (held apart from the
#: grid and from the held-back workloads): prefills over cached prefixes, decode batches of
#: every size
HOST = ["workload=random_tree", "workload.num_requests=48", "workload.root_len=128",
        "workload.segment_len=16", "workload.output_len=16"]
GRID: list[str] = []  # overrides of conf/calibrate.yaml's grid (none: its own)
CAPACITY = 6000  # tokens: small enough that eviction happens
#: --real: the real model on four text workloads, each held back from the grid; the grid reduced to
#: the shapes they make (prefills of up to ~1k tokens over up to ~1k cached, batches of up to 16
#: fresh prompts: few-shot's first step; decode batches of 1-16 at up to ~1.5k tokens, mixed
#: lengths included, each size measured, since this CPU's BLAS costs move in steps with the rows
#: and the fit prices each row count on its own: `calibrate.row_table`)
REAL = {
    "base": ["model=smollm2_135m", "hardware=cpu", "progress=false", "engine.attention=torch"],
    "held_back": {
        "sharegpt_chat": ["workload=sharegpt_chat", "workload.num_conversations=4",
                          "workload.max_turns=3", "workload.max_total_len=1024"],
        "tree_of_thought": ["workload=tree_of_thought", "workload.num_problems=2",
                            "workload.vocab_size=49152", "workload.thought_len=32"],
        "few_shot_text": ["workload=few_shot_text", "workload.num_tasks=2",
                          "workload.questions_per_task=8"],
        "closed_loop_8": ["workload=sharegpt", "workload.num_prompts=12",
                          "workload.max_total_len=256", "arrival.max_in_flight=8"],
    },
    "offline": ["workload=few_shot_text", "workload.num_tasks=2", "workload.questions_per_task=4"],
    "host": ["workload=random_tree", "workload.num_requests=24", "workload.root_len=128",
             "workload.segment_len=16", "workload.output_len=16", "workload.vocab_size=49152"],
    # prefills of 128 new tokens too: this CPU's cost per row is not linear between 256 and 1,024
    # rows (prefill_rows: a 477-token prefill ran at 1.50 ms a token, 256 at 1.45 and 4 x 256 at
    # 1.32), and chat's first step (4 prompts, 891 tokens) sits there
    "grid": ["calibrate.prefill_batch=[1,4,16]", "calibrate.prefill_new=[16,64,128,256]",
             "calibrate.prefill_context=[0,384,1024]",
             f"calibrate.decode_batch=[{','.join(map(str, range(1, 17)))}]",
             "calibrate.decode_context=[64,512,1536]", "calibrate.decode_ragged=true",
             # shared batches shaped as the workloads' (tree-of-thought's batches of 16 at ~400
             # tokens, 80% shared): re-read KV costs what the cache it sits in costs, and a
             # batch whose KV outgrows the CPU's L2 (16 x 512 with 448 shared: 2.3 MB a layer)
             # re-reads from a slower one, which one h cannot price beside these
             "calibrate.decode_shared=true", "calibrate.decode_shared_context=[256,384]",
             # speculative verification steps (k = 1, 2, 3, 4, 8 drafts a request, batches of up
             # to 4, at the decode contexts): a copy_text run's n-gram k=4 steps, 2-5 queries
             # with every query's logits, priced as 16-row prefills without them (+18%)
             "calibrate.verify_new=[2,3,4,5,9]", "calibrate.verify_batch=[1,2,4]"],
    "rounds": 4,
    "warm_workloads": False,  # steps of 0.1-10 s: the warm-up grid pass is enough (a served
    #                           warm-up round would cost as much as a round)
}
METRICS = ("makespan_s", "throughput_req_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
           "e2e_p50_s")
NOISE_LIMIT = 0.25  # the engine's own makespan spread (max/min - 1) beyond which a run is flagged


def config(overrides: list[str], name: str = "config"):
    return compose_config(BASE + overrides + EXTRA, name)


def fitted_model(path: Path | str | None = None):
    """The fitted cost model in ``path``, or the shipped one (``cost_model=fitted_smollm2_cpu``,
    with ``--real``'s base), over the run's roofline floor."""
    group = ["cost_model=fitted", f"cost_model.path={path}"] if path else \
        ["cost_model=fitted_smollm2_cpu"]
    return assemble(config(group)).build_cost_model()


class Workload:
    """One held-back workload: its config and requests, served on any executor."""

    def __init__(self, overrides: list[str]) -> None:
        self.run = assemble(config(overrides))
        self.requests = self.run.requests()

    def serve(self, executor):
        """(driver result, summary) of one run."""
        run = self.run
        scheduler, result = serve(self.requests, run.build_cache(CAPACITY, self.requests),
                                  run.scheduler, executor, seed=run.seed,
                                  max_in_flight=run.max_in_flight, record_steps=True)
        return result, summarize(records_of(result.reqs), 0.0, 0.0, scheduler.preemptions)


def error(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else (a - b) / b


def spread(values: list[float]) -> float | None:
    """The engine's own noise on one figure: (max − min) / median over the rounds."""
    values = [v for v in values if v is not None]
    return (max(values) - min(values)) / float(np.median(values)) \
        if values and np.median(values) else None


def held_back_row(workload: Workload, engine_runs: list, fitted, paired: list[float],
                  host: HostCost) -> dict:
    """The simulator (``fitted`` for the device, ``host`` for the host) against the engine's
    runs of one workload; the per-step figures are the device's time against ``fitted``."""
    _, sim = workload.serve(SimExecutor(fitted, host_cost=host))
    median = {m: float(np.median([s[m] for _, s in engine_runs])) for m in METRICS}
    steps_run = [(shape(s), s.gpu_s)
                 for result, _ in engine_runs for s in result.steps]
    host_steps = [s for result, _ in engine_runs for s in result.steps]
    host_measured = sum(s.host_s for s in host_steps)
    host_priced = sum(host.price(s.kind, len(s.new), sum(s.new)) for s in host_steps)
    by_kind = {kind: error(sum(fitted.step_time(s) for s, _ in steps_run if s.kind == kind),
                           sum(t for s, t in steps_run if s.kind == kind))
               for kind in ("prefill", "decode")}  # the fitted model's error on each kind's total
    return {"steps": len(engine_runs[0][0].steps),
            "step_mape": mape([fitted.step_time(s) for s, _ in steps_run],
                              [t for _, t in steps_run]),
            "prefill_time": by_kind["prefill"], "decode_time": by_kind["decode"],
            "host_share": host_measured / sum(s.duration_s for s in host_steps),
            "host_time": error(host_priced, host_measured),
            **{m.removesuffix("_s"): error(sim[m], median[m]) for m in METRICS},
            "paired_makespan": float(np.median(paired)) if paired else None,
            "paired_makespans": paired,
            "engine_makespan_s": median["makespan_s"], "sim_makespan_s": sim["makespan_s"],
            "engine_makespans_s": [s["makespan_s"] for _, s in engine_runs],
            "engine": median, "sim": {m: sim[m] for m in METRICS},
            "engine_spread": {m.removesuffix("_s"): spread([s[m] for _, s in engine_runs])
                              for m in METRICS}}


def shape(record) -> StepShape:
    """A recorded engine step as the fitted model prices it (re-read KV included)."""
    return StepShape(record.new, record.context, reread=record.reread)


def write_steps(engine_runs: list, fitted, path: Path) -> None:
    """Every engine step of every round, measured and predicted, as CSV."""
    pd.DataFrame([{"round": i, "kind": s.kind, "batch": len(s.new), "new": sum(s.new),
                   "context": sum(s.context), "max_kv": max(np.add(s.new, s.context)),
                   "measured_s": s.gpu_s, "host_s": s.host_s, "timeline_s": s.duration_s,
                   "reread": s.reread, "predicted_s": fitted.step_time(shape(s))}
                  for i, (result, _) in enumerate(engine_runs) for s in result.steps]
                 ).to_csv(path, index=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "sim_vs_engine")
    ap.add_argument("--rounds", type=int, default=None,
                    help="grid passes and engine runs, in turn (default 7; --real: 4)")
    ap.add_argument("--fitted", type=Path, help="a cost_model.yaml (skips calibration)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--clock", choices=("wall", "cpu"), default=None,
                    help="the engine's step clock: wall time, or this process's CPU time (a CPU "
                    "machine shared with other jobs); default wall, --real: cpu")
    ap.add_argument("--overlap", action="store_true", help="scheduler.overlap=true on both "
                    "sides (the engine's loop launches each step before reading the last one)")
    ap.add_argument("--real", action="store_true", help="the real model (smollm2_135m) on four "
                    "held-back text workloads, with a reduced grid (REAL); 4 rounds by default")
    ap.add_argument("--few-shot", action="store_true", help="hold back few-shot too (FEW_SHOT), "
                    "beside tree-of-thought and chat")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. "
                    "model=llama2_7b hardware=h200 engine.device=cuda engine.dtype=bfloat16 engine.attention=triton")
    args = ap.parse_args()
    if args.real:
        BASE[:] = REAL["base"]
        HELD_BACK.clear()
        HELD_BACK.update(REAL["held_back"])
        OFFLINE[:] = REAL["offline"]
        HOST[:] = REAL["host"]
        GRID[:] = REAL["grid"]
        if args.rounds is None:
            args.rounds = REAL["rounds"]
    if args.few_shot:
        HELD_BACK["few_shot"] = FEW_SHOT
    args.rounds = 7 if args.rounds is None else args.rounds
    args.clock = args.clock or ("cpu" if args.real else "wall")
    EXTRA.extend((["scheduler.overlap=true"] if args.overlap else []) + args.overrides)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    cal = config(["engine.forced=true"] + GRID, "calibrate")  # the run config with backend=engine
    run = assemble(cal)
    model, hw = run.model_shape, run.hardware
    floor = RooflineCostModel(model, hw)  # the fitted model's floor, as testbed.calibrate's
    workloads = {name: Workload(overrides) for name, overrides in HELD_BACK.items()}
    host_workload = Workload(HOST)
    steps = [] if args.fitted else grid(cal.calibrate)
    engine = run.build_executor(max(CAPACITY, grid_slots(steps)))
    torch.set_num_threads(args.threads)  # this script's flags, over the run keys' defaults
    engine.clock = None  # wall time, unless --clock cpu
    if args.clock == "cpu":
        if engine.device.type != "cpu":
            ap.error(f"--clock cpu times a CPU engine, not {engine.device}")
        if args.threads != 1:  # process time sums every thread's: no step duration then
            ap.error(f"--clock cpu needs --threads 1, got {args.threads}")
        engine.clock = time.thread_time
    wall_over_clock = {name: [] for name in workloads}
    rng = np.random.default_rng(run.seed)
    layout = slot_layout(cal.calibrate)
    knots = row_knots(cal.calibrate, steps)
    batches = [synthetic_batch(step, model.vocab_size, rng, layout) for step in steps]

    timed_pass(engine, batches, rng)  # warm-up: CPU torch builds kernels per new shape
    for w in workloads.values() if not args.real or REAL["warm_workloads"] else ():
        w.serve(engine)
    grid_times, runs, host_runs = [], {name: [] for name in workloads}, []
    for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
        if batches:
            grid_times.append(timed_pass(engine, batches, rng))
        host_runs.append(host_workload.serve(engine)[0].steps)
        for name, w in workloads.items():
            busy, wall = engine.busy_s, engine.wall_s
            runs[name].append(w.serve(engine))
            wall_over_clock[name].append((engine.wall_s - wall) / (engine.busy_s - busy))
    if steps:
        meta = {**engine_meta(engine, model, hw), "slot_layout": layout}
        cal = fit_and_write(median_times(steps, grid_times), meta, floor, args.out / "calibration",
                            row_knots=knots)
        print("calibrated: MAPE on the grid " + ", ".join(
            f"{kind} {e:.1%}" for kind, e in cal["mape"].items()))
        args.fitted = args.out / "calibration" / "cost_model.yaml"
    fitted = fitted_model(args.fitted.resolve())
    # the host's time per step, fitted on every round's run of HOST; a CPU engine is synchronous
    host = fit_host_cost([s for steps_ in host_runs for s in steps_],
                         concurrent=engine.asynchronous)
    host_steps = [s for steps_ in host_runs for s in steps_]
    print(f"host per step (fitted on {len(host_steps)} steps of {HOST[0]}): prefill "
          f"{host.prefill_s * 1e3:.3f} ms + {host.prefill_request_s * 1e6:.1f} us a request + "
          f"{host.prefill_token_s * 1e6:.2f} us a new token, decode {host.decode_s * 1e3:.3f} "
          f"ms + {host.decode_request_s * 1e6:.1f} us a request; concurrent {host.concurrent}; "
          f"{sum(s.host_s for s in host_steps) / sum(s.duration_s for s in host_steps):.1%} "
          "of that run's timeline")

    # Paired rounds: each round's grid pass fitted on its own and judged against that round's
    # engine runs, seconds apart, so the machine's slower drift cancels out of the comparison
    # (those per-round models are this study's own fits, built here rather than from a config).
    paired = {name: [] for name in workloads}
    for r, times in enumerate(grid_times):
        fitted_r = FittedCostModel(fit_coefficients(list(zip(steps, times)),
                                                    row_knots=knots), floor_model=floor)
        for name, w in workloads.items():
            host_r = fit_host_cost(host_runs[r], concurrent=engine.asynchronous)
            paired[name].append(error(
                w.serve(SimExecutor(fitted_r, host_cost=host_r))[1]["makespan_s"],
                runs[name][r][1]["makespan_s"]))

    report = {"fitted": str(args.fitted), "rounds": args.rounds, "clock": args.clock,
              "overlap": args.overlap, "host": host.to_config(),
              "held_back": {},
              "grid": [{"new": list(s.new), "context": list(s.context), "reread": s.reread,
                        **({"verify": True} if s.verify else {}), "times_s": list(t)}
                       for s, t in zip(steps, zip(*grid_times))] if grid_times else []}
    print(f"\n{'workload':<17}{'steps':>6}{'step MAPE':>10}{'makespan':>10}{'paired':>9}"
          f"{'req/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'e2e p50':>9}")
    notes = []
    for name, w in workloads.items():
        row = held_back_row(w, runs[name], fitted, paired[name], host)
        row["wall_over_clock"] = wall_over_clock[name]
        report["held_back"][name] = row
        write_steps(runs[name], fitted, args.out / f"steps_{name}.csv")
        paired_col = "" if row["paired_makespan"] is None else f"{row['paired_makespan']:+.1%}"
        print(f"{name:<17}{row['steps']:>6}{row['step_mape']:>10.1%}{row['makespan']:>+10.1%}"
              f"{paired_col:>9}{row['throughput_req']:>+8.1%}{row['ttft_p50']:>+10.1%}"
              f"{row['ttft_p99']:>+10.1%}{row['tpot_p50']:>+10.1%}{row['e2e_p50']:>+9.1%}")
        makespans, median = row["engine_makespans_s"], row["engine_makespan_s"]
        notes.append(f"  {name}: engine makespan {median:.3f} s ({min(makespans) / median - 1:+.0%}"
                     f"..{max(makespans) / median - 1:+.0%} over rounds)"
                     + (f"; paired errors {min(paired[name]):+.1%}..{max(paired[name]):+.1%}"
                        if paired[name] else "")
                     + f"; fitted model on the engine's steps: prefill time "
                     f"{row['prefill_time']:+.1%}, decode time {row['decode_time']:+.1%}; "
                     f"host {row['host_share']:.1%} of the timeline, priced "
                     f"{row['host_time']:+.1%}"
                     + (f"\n    steps' wall time / CPU time over rounds: "
                        + " ".join(f"{x:.2f}" for x in wall_over_clock[name])
                        if args.clock == "cpu" else "")
                     + "\n    engine spread over rounds (max - min) / median: "
                     + ", ".join(f"{m} {x:.1%}" for m, x in row["engine_spread"].items()
                                 if x is not None))
    print("(the simulator's errors against the engine's median over rounds; paired: the median "
          "of each round's own fit against that round's run)")
    print("\n".join(notes))
    noisy = {name: max(r["engine_makespans_s"]) / min(r["engine_makespans_s"]) - 1
             for name, r in report["held_back"].items()}
    report["noisy_rounds"] = {name: x for name, x in noisy.items() if x > NOISE_LIMIT}
    for name, x in report["noisy_rounds"].items():
        print(f"warning: the engine's own makespan on {name} varied by {x:.0%} over the rounds "
              f"(> {NOISE_LIMIT:.0%}): the machine's speed changed during this run, so its errors "
              f"say more about that than about the simulator; run it again")

    offline = Workload(OFFLINE)
    (eng, _), (sim, _) = offline.serve(engine), offline.serve(SimExecutor(fitted,
                                                                          host_cost=host))
    same_steps = [(s.kind, s.ids, s.new, s.context) for s in eng.steps] == \
        [(s.kind, s.ids, s.new, s.context) for s in sim.steps]
    same_hits = [r.cached_tokens for r in eng.reqs] == [r.cached_tokens for r in sim.reqs]
    report["offline_batch"] = {"identical_steps": same_steps, "identical_hits": same_hits,
                               "steps": len(eng.steps)}
    print(f"\noffline batch ({offline.run.config['workload']['name']}, {len(eng.steps)} steps): "
          f"identical step compositions {same_steps}, identical cached_tokens per request "
          f"{same_hits}")
    (args.out / "sim_vs_engine.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out / 'sim_vs_engine.json'}")


if __name__ == "__main__":
    entry(main)
