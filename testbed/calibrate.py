"""``python -m testbed.calibrate [overrides]``: measure engine steps, fit the simulator's cost model.

Runs a grid of real engine steps on the configured ``model``/``device``/``dtype``/``attention`` —
prefills (new tokens × cached context × batch size) and decodes (batch size × context; with
``calibrate.decode_ragged`` also batches of mixed contexts, which tell a kernel padded to the
batch's longest KV from one that reads each request's own) — in
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
the token times those ``backend=server`` runs recorded (`testbed.server_steps`; the token budget
per step is ``scheduler=vllm``'s ``max_num_batched_tokens``, else ``scheduler.chunked_prefill_size``,
or ``calibrate.token_budget``), and no engine is built.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import hydra
import matplotlib
import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm import tqdm

from testbed import group_values
from testbed.cli import check_group_choices
from testbed.assembly import assemble
from testbed.errors import BadInput

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from testbed.cache.base import Lease  # noqa: E402
from testbed.scheduler.batch import Batch, BatchEntry  # noqa: E402
from testbed.scheduler.request_state import Req  # noqa: E402
from testbed.server_steps import read_run, recover_steps, usable  # noqa: E402
from testbed.sim.cost_model import FittedCostModel, RooflineCostModel, save_fitted  # noqa: E402
from testbed.sim.fit import COEFFS, fit_coefficients, mape  # noqa: E402
from testbed.sim.step_shape import StepShape  # noqa: E402
from testbed.workloads.request import Request  # noqa: E402


#: the ``calibrate`` lists that span the grid, and the least value each may hold
GRID_KEYS = {"prefill_batch": 1, "prefill_new": 1, "prefill_context": 0, "decode_batch": 1,
             "decode_context": 0}


def grid_values(cfg: Any, key: str) -> list[int]:
    """``calibrate.KEY``: a non-empty list of integers, each at least `GRID_KEYS`'s."""
    values, least = cfg.get(key), GRID_KEYS[key]
    if not isinstance(values, Sequence) or isinstance(values, str) or not values \
            or any(isinstance(v, bool) or not isinstance(v, int) or v < least for v in values):
        raise BadInput(f"calibrate.{key} must be a non-empty list of integers >= {least}, "
                       f"got {values!r}")
    return list(values)


def grid(cfg: Any) -> list[StepShape]:
    """The steps to measure: every prefill and decode shape of the ``calibrate`` config."""
    steps = []
    for batch in grid_values(cfg, "prefill_batch"):
        for new in grid_values(cfg, "prefill_new"):
            for context in grid_values(cfg, "prefill_context"):
                steps.append(StepShape(new=(new,) * batch, context=(context,) * batch))
    contexts = grid_values(cfg, "decode_context")
    for batch in grid_values(cfg, "decode_batch"):
        for context in contexts:
            steps.append(StepShape.decode((context,) * batch))
    if group_values.check_setting("calibrate.decode_ragged", bool, cfg.get("decode_ragged")):
        steps += ragged_decodes(grid_values(cfg, "decode_batch"), contexts)
    if group_values.check_setting("calibrate.decode_shared", bool,
                                  cfg.get("decode_shared", False)):
        steps += shared_decodes(grid_values(cfg, "decode_batch"), contexts,
                                shared_contexts(cfg, contexts))
    return steps


def shared_contexts(cfg: Any, contexts: list[int]) -> list[int]:
    """``calibrate.decode_shared_context`` (null: the ``decode_context`` values): the contexts of
    the shared decode batches, each above the least ``decode_context``."""
    values = cfg.get("decode_shared_context")
    if values is None:
        return contexts
    least = min(contexts)
    if not isinstance(values, Sequence) or isinstance(values, str) or not values \
            or any(isinstance(v, bool) or not isinstance(v, int) or v <= least for v in values):
        raise BadInput(f"calibrate.decode_shared_context must be null or a non-empty list of "
                       f"integers > the least decode_context ({least}), got {values!r}")
    return list(values)


def shared_decodes(batches: list[int], contexts: list[int], shared: Sequence[int]
                   ) -> list[StepShape]:
    """Decode batches whose requests share a prefix: for each batch size of two or more and each
    context of ``shared`` above the least of ``contexts``, every request at that context, all but
    the least's tokens shared (tree-of-thought's siblings, few-shot's questions): what the others
    read again (`StepShape.reread`), from a CPU's caches."""
    least = min(contexts)
    return [StepShape.decode((context,) * batch, reread=(batch - 1) * (context - least))
            for batch in batches if batch >= 2 for context in shared if context > least]


def ragged_decodes(batches: list[int], contexts: list[int]) -> list[StepShape]:
    """Decode batches of mixed contexts: for each batch size of two or more and each context
    above the least, contexts spread evenly from the least up to that one (a served decode batch
    mixes long and short requests; the longest sets a padded kernel's cost, the sum an unpadded
    one's)."""
    least = min(contexts)
    return [StepShape.decode(tuple(int(round(c)) for c in np.linspace(least, context, batch)))
            for batch in batches if batch >= 2 for context in contexts if context > least]


def row_knots(cfg: Any, steps: Sequence[StepShape]) -> dict[str, list[int]]:
    """``calibrate.row_table`` (default true): per step kind, the row counts (``Σnew``: a decode's
    batch size, a prefill's new tokens) of ``steps``, each of which the fit then prices on its
    own (``n<K>``, `testbed.sim.fit`); else none."""
    return {kind: sorted({s.num_new for s in steps if s.kind == kind})
            for kind in ("decode", "prefill")} if row_table_on(cfg) else {}


def row_table_on(cfg: Any) -> bool:
    """``calibrate.row_table``, checked (default true)."""
    return group_values.check_setting("calibrate.row_table", bool, cfg.get("row_table", True))


#: a decode batch size a server fit prices on its own (`server_row_knots`) once this many of its
#: recovered steps are there to fit it
SERVER_KNOT_STEPS = 20


def server_row_knots(cfg: Any, samples: Sequence[tuple[StepShape, float]]
                     ) -> dict[str, list[int]]:
    """``calibrate.row_table`` on a server's recovered steps: the decode batch sizes with at least
    `SERVER_KNOT_STEPS` steps each (a server's rows are what its workload ran, not a grid: a size
    seen a few times would be priced by its noise); prefills keep the linear form (their new
    tokens take hundreds of values)."""
    sizes = [s.batch for s, _ in samples if s.kind == "decode"]
    knots = sorted(k for k in set(sizes) if sizes.count(k) >= SERVER_KNOT_STEPS)
    return {"decode": knots, "prefill": []} if row_table_on(cfg) and knots else {}


#: ``calibrate.slot_layout``: where a synthetic batch's KV sits (see `slot_order`)
SLOT_LAYOUTS = ("interleaved", "contiguous")


def slot_layout(cfg: Any) -> str:
    """``calibrate.slot_layout``, checked (default ``interleaved``)."""
    layout = cfg.get("slot_layout", "interleaved")
    if layout not in SLOT_LAYOUTS:
        raise BadInput(f"calibrate.slot_layout must be one of {', '.join(SLOT_LAYOUTS)}, "
                       f"got {layout!r}")
    return layout


def slot_order(step: StepShape, layout: str) -> list[np.ndarray]:
    """Each request's KV slots (context first, then its new tokens), from 1 up, distinct but for
    a shared prefix.

    ``contiguous``: one run of slots per request. ``interleaved``: the contexts alternate token by
    token across the batch's requests (token t of every request holding more than t, then token
    t+1, ...), then each request's new tokens in one run. A served decode batch holds its KV so:
    the pool hands each step's new tokens out in turn, one slot per request, so what requests
    decoded together sits interleaved. Reading it gathers rows a batch apart: on the 2-core
    development CPU, SmolLM2-135M's decode steps of 4, 8 and 16 requests at 512 tokens each took
    1%, 7% and 9% longer interleaved than contiguous (side by side, medians of 12), so a grid of
    contiguous batches fits served steps short. A decode step with ``reread`` tokens (the grid's
    shared batches, `grid`) has every request begin with the same ``reread / (batch − 1)`` slots,
    one run, as one prefill wrote them; the layout applies to the rest.
    """
    shared = step.reread // (step.batch - 1) if step.reread else 0
    prefix = list(range(1, shared + 1))
    contexts = np.asarray(step.context) - shared
    if layout == "contiguous":
        lengths = contexts + np.asarray(step.new)
        ends = shared + np.cumsum(lengths)
        return [np.asarray(prefix + list(range(end - n + 1, end + 1)), dtype=np.int32)
                for n, end in zip(lengths, ends)]
    # the (token, request) pairs of every context, ordered by token then request
    token, request = np.nonzero(np.arange(contexts.max(initial=0))[:, None] < contexts[None, :])
    slots = [prefix + list(1 + shared + np.flatnonzero(request == i))
             for i in range(len(contexts))]
    start = 1 + shared + len(token)
    for i, new in enumerate(step.new):
        slots[i] += range(start, start + new)
        start += new
    return [np.asarray(s, dtype=np.int32) for s in slots]


def synthetic_batch(step: StepShape, vocab: int, rng: np.random.Generator,
                    layout: str = "interleaved") -> Batch:
    """A batch of the given shape over fresh requests holding distinct KV slots, laid out as
    ``layout`` says (`slot_order`)."""
    return batch_on_slots(step, slot_order(step, layout), vocab, rng)


def batch_on_slots(step: StepShape, slots: Sequence[np.ndarray], vocab: int,
                   rng: np.random.Generator, cached: bool = False) -> Batch:
    """A batch of the given shape over fresh requests (random tokens) reading and writing the
    given KV slots, each request's context first, then its new tokens; ``cached``: each
    request's context counts as its cached prefix (its lease's hit), else nothing does."""
    entries = []
    for i, (new, context, own) in enumerate(zip(step.new, step.context, slots)):
        request = Request(f"cal{i}", rng.integers(0, vocab, new + context, dtype=np.int32),
                          np.zeros(1, dtype=np.int32))
        req = Req(request=request, prompt=request.prompt, submitted_s=0.0, seq=i)
        req.lease = Lease(hit=context if cached else 0, slots=np.asarray(own, dtype=np.int32))
        entries.append(BatchEntry(req, context, new, produces_token=True))
    return Batch("decode" if step.is_decode else "prefill", entries)


def timed_pass(executor: Any, batches: list[Batch], rng: np.random.Generator) -> list[float]:
    """Run every batch once, in a random order, and return the step times in the batches' order.

    A served workload never repeats the step before it, so timing a shape back to back (caches,
    allocator and kernel choice all hot) would measure it faster than the engine ever runs it.
    A step's time is the device's (``gpu_s``: CUDA events; on the CPU, launch's work), where the
    executor splits it: the host's work is priced apart (`testbed.sim.overlap`).
    """
    times = [0.0] * len(batches)
    for i in rng.permutation(len(batches)):
        outcome = executor.execute(batches[i])
        gpu = getattr(outcome, "gpu_s", None)
        times[i] = outcome.duration_s if gpu is None else gpu
    return times


def measure(executor: Any, steps: list[StepShape], repeats: int, vocab: int,
            seed: int = 0, progress: bool = False,
            layout: str = "interleaved") -> list[tuple[StepShape, float]]:
    """The median of ``repeats`` timed passes over the steps, after one warm-up pass
    (allocator, kernels)."""
    rng = np.random.default_rng(seed)
    batches = [synthetic_batch(step, vocab, rng, layout) for step in steps]
    timed_pass(executor, batches, rng)
    passes = [timed_pass(executor, batches, rng)
              for _ in tqdm(range(repeats), desc="calibrate", unit="pass",
                            disable=None if progress else True)]
    return median_times(steps, passes)


def median_times(steps: list[StepShape],
                 passes: list[list[float]]) -> list[tuple[StepShape, float]]:
    """Each step with the median of its times over ``passes`` (each from `timed_pass`)."""
    return [(step, float(np.median(t))) for step, t in zip(steps, zip(*passes))]


def plot(samples: list[tuple[StepShape, float]], model: FittedCostModel, path: Path,
         title: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 5))
    for kind, marker in (("prefill", "o"), ("decode", "s")):
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


def grid_slots(steps: list[StepShape]) -> int:
    """KV slots the largest synthetic batch of ``steps`` needs (0 for no steps)."""
    return max((sum(n + ctx for n, ctx in zip(s.new, s.context)) for s in steps), default=0)


def engine_meta(executor: Any, model: Any, hw: Any) -> dict[str, Any]:
    """What a calibration was measured on (saved with the coefficients)."""
    return {"model": model.name, "device": str(executor.runner.device), "hardware": hw.name,
            "dtype": str(next(executor.runner.model.parameters()).dtype).replace("torch.", ""),
            "attention": type(executor.runner.attention).__name__}


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
    meta = meta | {"steps_measured": len(samples), **floor_check(samples, floor)}
    run_dir.mkdir(parents=True, exist_ok=True)
    save_fitted(run_dir / "cost_model.yaml", coeffs, meta)
    errors = {kind: mape([fitted.step_time(s) for s, _ in samples if s.kind == kind],
                         [t for s, t in samples if s.kind == kind]) for kind in ("prefill", "decode")}
    result = {"meta": meta | {"date": dt.date.today().isoformat()}, "coefficients": coeffs,
              "mape": errors, "samples": [
                  {"kind": s.kind, "new": list(s.new), "context": list(s.context),
                   "reread": s.reread, "measured_s": t, "predicted_s": fitted.step_time(s)}
                  for s, t in samples]}
    (run_dir / "calibration.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(samples, fitted, run_dir / "calibration.png",
         f"Fitted step time: {meta['model']} on {meta['device']}\n"
         f"MAPE prefill {errors['prefill']:.1%}, decode {errors['decode']:.1%}")
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
    try:
        result = calibrate(cfg, run_dir)
    except BadInput as e:  # anything else is a defect: its traceback, exit 1
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
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
    check_group_choices(sys.argv[1:])
    main()
