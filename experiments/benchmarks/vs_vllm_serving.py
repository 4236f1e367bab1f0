"""Serving throughput side by side: ``testbed.serve`` (radix+LPM, and block-hash with vLLM's
scheduler) against vLLM 0.32, same client, model, KV pool and machine.

One server at a time (an idle vLLM's worker polls and keeps a core busy, so nothing else may run
beside it: with ``--vllm-url`` stop that vLLM while the testbed's servers run, or leave vLLM out
of ``--servers`` and run it separately), repeat after repeat, each workload in a closed loop
(``backend=server arrival.max_in_flight=N``, forced output lengths, an empty cache per run:
``POST /reset_prefix_cache``); the fastest of ``--repeats`` counts (the machine is shared). Reported per server and workload: requests/s
and output tokens/s over the makespan, TTFT p50, TPOT p50 and the hit rate the server reported.
Where the time goes: every run's steps are recovered from its token times
(`testbed.calibration.server_steps`), and the median decode step at each batch size and the prefill
throughput are put side by side (``steps.csv``); a testbed server's runs also keep the steps as
the server timed them (``server_steps.jsonl``, ``GET /debug/steps``), whose median decode step
stands beside the recovered one (``own_decode_b*_ms``).

    python -m experiments.benchmarks.vs_vllm_serving [--vllm-url URL] [--loop 16] [--repeats 3]
        [--servers radix_lpm radix_lpm_hold block_hash_vllm vllm] [--pool page|default] [--out DIR]

Both testbed servers run torch on one thread, as vLLM's CPU backend does here (its log: "Reducing
Torch threads from 2 to 1 for serving"). Writes ``serving.csv``, ``steps.csv`` and
``serving.png``; results: docs/results/vs_vllm_serving.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

from experiments.validation.vllm import caching, live
from experiments.validation.vllm.latency import HELD_OUT, TRAIN
from experiments.benchmarks.served_step import near, own_decode_ms, steps_recorded, steps_since
from testbed.calibration.server_steps import read_run, recover_steps, usable

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

WORKLOADS = {**HELD_OUT, **TRAIN}
BLOCK_SIZE, BLOCKS = 32, 512  # vLLM's CPU attention takes multiples of 32
CAPACITY = (BLOCKS - 1) * BLOCK_SIZE  # vLLM's pool less its null block
# --pool default: each server's own default pool, testbed.serve's engine.cpu_kv_cache_gib (2) and
# vLLM's VLLM_CPU_KVCACHE_SPACE of the same 2 GiB, whose blocks vLLM counts itself (its log's
# "num_gpu_blocks=M", checked)
DEFAULT_BLOCKS = (2 << 30) // (BLOCK_SIZE * live.KV_BYTES_PER_TOKEN)
POOL_BLOCKS = {"page": BLOCKS, "default": DEFAULT_BLOCKS}  # vLLM's blocks, by --pool
TESTBED = {
    "radix_lpm": ["cache=radix", "scheduler=lpm"],
    # beyond SGLang: a waiting request whose prefix another request of the step computes waits
    # for the next step and hits it (SGLang's in-batch rule only sorts it last; docs/design.md §4)
    "radix_lpm_hold": ["cache=radix", "scheduler=lpm", "scheduler.in_batch_hold=true"],
    "block_hash_vllm": ["cache=block_hash", f"cache.block_size={BLOCK_SIZE}", "scheduler=vllm"],
}
SERVER_STEPS = "server_steps.jsonl"  # a testbed server's own step log of a run (/debug/steps)
SHOWN = ["requests_per_s", "output_tok_per_s", "ttft_p50_s", "tpot_p50_s", "hit_rate"]


@contextlib.contextmanager
def testbed_server(name: str, pool: str = "page"):
    """``name``'s server, its pool vLLM's of this page (``page``) or its own default."""
    from testbed.api.server import start_server
    sized = [f"cache.capacity_tokens={CAPACITY}"] if pool == "page" else []
    handle = start_server(["model=smollm2_135m", "engine.device=cpu", *sized,
                           "serve.model_name=" + live.SERVED_NAME, *TESTBED[name]],
                          in_process=False, timeout_s=600)
    try:
        yield live.Served(handle.url, BLOCK_SIZE, POOL_BLOCKS[pool], None)
    finally:
        handle.stop()


def drive(served: live.Served, words: list[str], loop: int, out: Path) -> dict:
    """One closed-loop run from an empty cache (``POST /reset_prefix_cache``, served by both)."""
    from testbed.config.assembly import compose_config
    from testbed.execute import execute
    if not (out / "summary.json").exists():  # a run already there is kept
        live.reset_cache(served.url)
        first = steps_recorded(served.url)
        execute(compose_config(live.server_overrides(words, served,
                                                        [f"arrival.max_in_flight={loop}"])), out)
        if first is not None:  # testbed.serve: the steps as it timed them
            (out / SERVER_STEPS).write_text("".join(
                json.dumps(s) + "\n" for s in steps_since(served.url, first)))
    s = json.loads((out / "summary.json").read_text())
    rows = live.records(out)
    return {"requests_per_s": s["throughput_req_s"],
            "output_tok_per_s": rows["output_tokens"].sum() / s["makespan_s"],
            "ttft_p50_s": s["ttft_p50_s"], "tpot_p50_s": s["tpot_p50_s"],
            "hit_rate": caching.hit_rate(rows), "makespan_s": s["makespan_s"],
            "failed": int(rows["failed"].sum())}


def step_profile(run: Path, budget: int | None) -> dict:
    """Median decode step time at batch 1, 4 and 16 (nearest batch sizes seen) and prefill
    tokens per second of the run's recovered steps; for ``testbed.serve`` also the median
    decode step as the server timed it (``own_decode_b*_ms``, from ``server_steps.jsonl``)."""
    steps = usable(recover_steps(read_run(run), budget))
    decode = pd.DataFrame([(len(s.new), s.duration_s) for s in steps if max(s.new) == 1],
                          columns=["batch", "s"])
    prefill = [(sum(s.new), s.duration_s) for s in steps if max(s.new) > 1]
    profile = {"steps": len(steps)}
    own = run / SERVER_STEPS
    records = [json.loads(line) for line in own.read_text().splitlines()] \
        if own.exists() else None
    for b in (1, 4, 16):
        low, high = near(b)
        seen = decode[decode.batch.between(low, high)]
        profile[f"decode_b{b}_ms"] = 1e3 * seen.s.median() if len(seen) else None
        if records is not None:
            profile[f"own_decode_b{b}_ms"] = own_decode_ms(records, b)
    if prefill:
        new, secs = np.array(prefill).T
        profile["prefill_tok_per_s"] = new.sum() / secs.sum()
    return profile


def plot(table: pd.DataFrame, path: Path) -> None:
    metrics = ["requests_per_s", "ttft_p50_s", "tpot_p50_s"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4))
    pivot = {m: table.pivot(index="workload", columns="server", values=m) for m in metrics}
    for ax, m in zip(axes, metrics):
        pivot[m].plot.bar(ax=ax, rot=0)
        ax.set_title(m.replace("_", " "))
        ax.set_xlabel("")
    fig.suptitle("SmolLM2-135M on this CPU, closed loop: testbed.serve against vLLM 0.32")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.benchmarks.vs_vllm_serving",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--servers", nargs="+", default=[*TESTBED, "vllm"],
                    choices=[*TESTBED, "vllm"])
    ap.add_argument("--workload", nargs="+", choices=list(WORKLOADS),
                    default=["tree_of_thought", "few_shot_text", "sharegpt_chat"])
    ap.add_argument("--loop", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm-url", default=None, help=f"a vLLM already served (`experiments.validation.vllm.caching serve`, "
                    f"{BLOCKS} blocks of {BLOCK_SIZE}); else one is started")
    ap.add_argument("--pool", choices=list(POOL_BLOCKS), default="page",
                    help=f"page: both servers given {CAPACITY:,} tokens ({BLOCKS} of vLLM's blocks); "
                         f"default: each its own 2 GiB default")
    ap.add_argument("--cache-dir", type=Path, default=live.DEFAULT_CACHE)
    ap.add_argument("--out", type=Path, default=None, help="runs already there are kept")
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="vs_vllm_serving_"))
    runs: dict[tuple[str, str], list[tuple[dict, Path]]] = {}
    try:
        for server in args.servers:  # one at a time: an idle vLLM's worker keeps a core busy
            print(f"starting {server}", file=sys.stderr, flush=True)
            context = testbed_server(server, args.pool) if server != "vllm" else \
                live.vllm_server(args.vllm_url, BLOCK_SIZE, POOL_BLOCKS[args.pool],
                                 args.cache_dir, out / "vllm.log")
            with context as served:
                for r in range(args.repeats):
                    for name in args.workload:
                        d = out / server / name / f"r{r}"
                        print(f"{server}: {name}, repeat {r + 1}", file=sys.stderr, flush=True)
                        runs.setdefault((server, name), []).append(
                            (drive(served, WORKLOADS[name], args.loop, d), d))
    except live.Fail as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows, profiles = [], []
    for (server, name), tried in runs.items():
        best, d = max(tried, key=lambda x: x[0]["requests_per_s"])
        rows.append({"server": server, "workload": name, "repeats": len(tried), **best})
        budget = 8192 if server.startswith("radix") else 2048  # SGLang's chunk, vLLM's budget
        profiles.append({"server": server, "workload": name, **step_profile(d, budget)})
    table = pd.DataFrame(rows)
    table.to_csv(out / "serving.csv", index=False)
    steps = pd.DataFrame(profiles)
    steps.to_csv(out / "steps.csv", index=False)
    plot(table, out / "serving.png")
    from testbed.report.markdown import markdown_table
    print(markdown_table(table.round(4), ["server", "workload", *SHOWN, "failed"]))
    print(markdown_table(steps.round(2), list(steps.columns)))
    log = out / "vllm.log"
    if args.pool == "default" and log.exists():  # vLLM's own count for its 2 GiB, as told
        own = live.kv_blocks(log.read_text(errors="replace"), own=True)
        print(f"vLLM's own count for its 2 GiB: {own if own is not None else '?'} blocks "
              f"(told {DEFAULT_BLOCKS})")
    print(f"runs in {out}")
    return 0


if __name__ == "__main__":
    from experiments import entry
    entry(main)
