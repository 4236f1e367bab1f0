"""Beam search: where token-level radix sharing beats 16-token blocks (docs/results/beam_search.md).

Beams fork one token apart: each beam request's prompt is its parent's plus one token
(`testbed.scheduler.beam`), so a radix tree of page 1 hits all but that token, while pages and
blocks of 16 recompute what follows their last whole page, and no cache recomputes everything.
For beam widths W = 2, 4, 8 and the caches none, radix page 1, radix page 16 and block_hash 16:

- **simulator**: ``workload=beam_search`` (8 prompts of 256 tokens, 64 tokens deep) on
  Llama-3-8B / H100 (``model=llama3_8b hardware=h100``), and the same in replay;
- **engine**: real beam calls (``"beam_width"`` in a token trace) on SmolLM2-135M-Instruct on
  the CPU, one torch thread, chat prompts through the model's template; steps timed by this
  process's CPU time (``--clock cpu``); each configuration ``--repeats`` times, interleaved, the
  fastest kept (the machine is shared); a KV pool with room for every beam tree in whole pages
  (``--engine-capacity``), so that no cache evicts. The engine's beam
  tree of each W is saved (``beam_trace.jsonl``) and replayed through every cache too.

Per run: hit rate, prefill tokens (computed by prefill steps, from ``steps.jsonl``), makespan and
throughput (the best sequences' tokens per second), and its ratio to ``cache=none``. Writes
``results.csv`` and ``beam_search.png`` to ``--out`` (the runs' directories go to ``--work``).

    python -m experiments.studies.beam_search --out docs/results/beam_search
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import time
from pathlib import Path

import torch

from testbed.config.assembly import compose_config
from testbed.data import resolve_model
from testbed.execute import execute

WIDTHS = (2, 4, 8)
CACHES = {"none": ["cache=none"], "radix p1": ["cache=radix", "cache.page_size=1"],
          "radix p16": ["cache=radix", "cache.page_size=16"],
          "block_hash 16": ["cache=block_hash", "cache.block_size=16"]}
SIM = ["model=llama3_8b", "hardware=h100", "workload=beam_search"]
SYSTEM = "You are a careful assistant. Answer in two or three plain sentences."
QUESTIONS = ["Why does the sky look blue during the day but red at sunset?",
             "How does a refrigerator keep food cold?",
             "What causes the seasons on Earth?",
             "Why do bicycles stay upright when they move?"]


def run_dir(work: Path, *parts: str) -> Path:
    return work / "_".join(p.replace(" ", "") for p in parts)


def measured(summary: dict, path: Path) -> dict:
    """The figures of one run: hit rate, prefill tokens, makespan, and the best sequences'
    tokens (beams.jsonl on the engine; prompts × depth for the generated workload)."""
    steps = path / "steps.jsonl"
    prefill = summary["prompt_tokens"] - summary["cached_tokens"]  # replay: what it computes
    if steps.exists():
        rows = [json.loads(x) for x in steps.read_text().splitlines()]
        prefill = sum(r["new_tokens"] for r in rows if r["kind"] == "prefill")
    beams = path / "beams.jsonl"
    tokens = None
    if beams.exists():
        tokens = sum(len(json.loads(x)["sequences"][0]) for x in beams.read_text().splitlines())
    return {"hit_rate": summary["hit_rate"], "prompt_tokens": summary["prompt_tokens"],
            "cached_tokens": summary["cached_tokens"], "prefill_tokens": prefill,
            "makespan_s": summary.get("makespan_s"), "tokens": tokens,
            "requests": summary["num_requests"]}


def run(work: Path, name: str, overrides: list[str]) -> dict:
    path = run_dir(work, name)
    summary = execute(compose_config(["progress=false", *overrides]), path)
    return measured(summary, path)


def simulate(work: Path, prompts: int, depth: int) -> list[dict]:
    rows = []
    for w in WIDTHS:
        for label, cache in CACHES.items():
            shape = [f"workload.beam_width={w}", f"workload.num_prompts={prompts}",
                     f"workload.depth={depth}"]
            for backend in ("replay", "sim"):
                got = run(work, f"{backend}_w{w}_{label}", [f"backend={backend}", *SIM, *shape,
                                                           *cache])
                got["tokens"] = prompts * depth
                rows.append({"backend": backend, "width": w, "cache": label, **got})
    return rows


def chat_prompts(n: int) -> list[list[int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(resolve_model("data:smollm2_135m_instruct")))
    prompts = []
    for q in QUESTIONS[:n]:
        ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def time_by_cpu() -> None:
    """Engine steps timed by this process's CPU seconds (``EngineExecutor.clock``, as
    experiments/validation/sim_vs_engine.py ``--clock cpu``): on a shared machine other jobs'
    time slices then do not inflate them. Needs one torch thread (CPU time sums threads)."""
    import testbed.engine.executor as executor

    build = executor.make_engine_executor

    @functools.wraps(build)  # the registry reads the parameters it may pass from the signature
    def timed_by_cpu(*args, **kwargs):
        engine = build(*args, **kwargs)
        engine.clock = time.thread_time
        return engine

    executor.make_engine_executor = timed_by_cpu


def engine(work: Path, prompts: list[list[int]], depth: int, repeats: int,
           capacity: int) -> list[dict]:
    rows, best = [], {}
    for w in WIDTHS:
        trace = work / f"beam_calls_w{w}.jsonl"
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p, "max_new_tokens": depth,
                                             "beam_width": w}) + "\n"
                                 for i, p in enumerate(prompts)))
        for r in range(repeats):  # interleaved: a slow spell of the machine hits every cache
            for label, cache in CACHES.items():
                got = run(work, f"engine_w{w}_{label}_{r}",
                          ["backend=engine", "model=smollm2_135m", "engine.device=cpu",
                           "workload=trace", f"workload.path={trace}",
                           f"cache.capacity_tokens={capacity}", *cache])
                key = (w, label)
                if key not in best or got["makespan_s"] < best[key]["makespan_s"]:
                    best[key] = got
        for label in CACHES:
            rows.append({"backend": "engine", "width": w, "cache": label, **best[(w, label)]})
        tree = run_dir(work, f"engine_w{w}_radix p1_0") / "beam_trace.jsonl"
        for label, cache in CACHES.items():  # the tree the engine ran, through every cache
            got = run(work, f"engine_tree_w{w}_{label}",
                      ["backend=replay", "workload=trace", f"workload.path={tree}", *cache])
            rows.append({"backend": "replay (engine's tree)", "width": w, "cache": label, **got})
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """Throughput (tokens / makespan) and each run's ratio to cache=none of its backend and W."""
    none = {(r["backend"], r["width"]): r for r in rows if r["cache"] == "none"}
    for r in rows:
        base = none[(r["backend"], r["width"])]
        r["tok_s"] = r["tokens"] / r["makespan_s"] if r["makespan_s"] else None
        r["speedup_vs_none"] = (base["makespan_s"] / r["makespan_s"]) if r["makespan_s"] \
            else None
        r["prefill_vs_none"] = (r["prefill_tokens"] / base["prefill_tokens"]) \
            if r["prefill_tokens"] is not None else None
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("sim", "hit_rate", "hit rate (sim, Llama-3-8B/H100)"),
              ("sim", "speedup_vs_none", "throughput / none (sim)"),
              ("engine", "hit_rate", "hit rate (engine, SmolLM2 CPU)"),
              ("engine", "speedup_vs_none", "throughput / none (engine)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    for ax, (backend, key, title) in zip(axes, panels):
        for i, label in enumerate(CACHES):
            values = [next((r[key] for r in rows if r["backend"] == backend
                            and int(r["width"]) == w
                            and r["cache"] == label), None) for w in WIDTHS]
            ax.bar([j + 0.2 * (i - 1.5) for j in range(len(WIDTHS))],
                   [float(v or 0) for v in values], width=0.2, label=label)
        ax.set_xticks(range(len(WIDTHS)), [f"W={w}" for w in WIDTHS])
        ax.set_title(title, fontsize=9)
        if key == "speedup_vs_none":
            ax.set_yscale("log")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", ncol=len(CACHES),
               fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/results/beam_search"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/beam_search_runs"),
                    help="where the runs' directories go (not kept with the results)")
    ap.add_argument("--prompts", type=int, default=8, help="simulated prompts")
    ap.add_argument("--depth", type=int, default=64, help="simulated tokens per beam")
    ap.add_argument("--engine-prompts", type=int, default=2)
    ap.add_argument("--engine-depth", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="engine runs per configuration")
    ap.add_argument("--engine-capacity", type=int, default=4096,
                    help="the engine's KV pool (tokens): room for every beam tree in whole pages, "
                         "so no cache evicts")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="engine step times: this process's CPU seconds, or wall time")
    ap.add_argument("--replot", action="store_true",
                    help="only redraw the figure from --out's results.csv")
    args = ap.parse_args()
    if args.replot:
        with (args.out / "results.csv").open() as f:
            plot(list(csv.DictReader(f)), args.out / "beam_search.png")
        return
    torch.set_num_threads(1)
    if args.clock == "cpu":
        time_by_cpu()
    started = time.perf_counter()
    rows = simulate(args.work, args.prompts, args.depth)
    if not args.no_engine:
        rows += engine(args.work, chat_prompts(args.engine_prompts), args.engine_depth,
                       args.repeats, args.engine_capacity)
    rows = with_ratios(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / "beam_search.png")
    for r in rows:
        print(f"{r['backend']:>22} W={r['width']} {r['cache']:>13}  hit {r['hit_rate']:.4f}  "
              f"prefill {r['prefill_tokens']}  tok/s {r['tok_s'] or 0:.1f}  "
              f"x{r['speedup_vs_none'] or 0:.2f}")
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    from experiments import entry
    entry(main)
