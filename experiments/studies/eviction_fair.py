"""The fair eviction study (issue 48): every policy on five workloads at three capacities each,
hit rate under SGLang 0.5.23's rules and 0.4.10's, and the simulated TTFT and throughput under
0.5.23's, against LRU and Belady's oracle; the learned policy also with a model trained on one
trace and judged, frozen, on the others.

Workloads (`WORKLOADS`): the Mooncake conversation and synthetic traces, multi-turn ShareGPT
(``sharegpt_chat``: real conversations through SmolLM2's tokenizer, each turn's prompt the
previous turn's prompt and answer), and two agent-like programs of the testbed, tree-of-thought
and ``chat_tenants`` (many tenants' system prompts under multi-turn chats).

- *Hit rate* (`replay`): the whole workload through the replay backend, per policy, capacity
  and release (``scheduler.sglang``). Belady's farthest-next-use oracle sees the same request
  order, so it is the bound the study checks: a cell where a policy beats it is printed and
  makes the exit code 1 (not a proof with variable-size entries: a measured fact).
- *Time* (`simulate`): the simulator (``backend=sim``, LPM, roofline cost model, Llama-3-8B on
  an H100: the Mooncake traces' long prompts need it) under 0.5.23's rules; a trace's first
  ``--sim-requests`` requests at their recorded arrival times, the generated workloads whole
  (all programs at once: throughput at saturation, as SGLang PR 30300 measured it). TTFT p50
  and p99 and output-and-prompt tokens per second.
- *Learned, transferred* (``learned@conversation``): the model the learned policy holds at the
  end of the Mooncake conversation trace at 3M tokens under 0.5.23 (``TreeModel.save``), used
  from the first request and never refit (``eviction.model``, ``eviction.refit=false``). The
  online ``learned`` refits on the workload it runs on (from its past only); its settings were
  chosen on the conversation trace.

Writes ``eviction_fair.csv`` (one row per workload, capacity, release, policy and measure),
``report.md`` (the tables) and figures into ``--out`` (default docs/results/eviction/fair).

    python -m experiments.studies.eviction_fair [--quick] [--out DIR] [--workloads a,b]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from experiments import REPO, entry
from experiments.studies.eviction_fair_report import plot, write_report
from testbed.config.assembly import assemble, compose_config
from testbed.backends.dispatch import run_backend
from testbed.results.metrics import summarize
from testbed.backends.replay import replay

OUT = REPO / "docs" / "results" / "eviction" / "fair"
POLICIES = ("lru", "fifo", "lfu", "slru", "tlru", "size_aware", "wlfu", "gdsf", "workload_aware",
            "learned", "learned@conversation", "oracle")
SIM_POLICIES = ("lru", "slru", "size_aware", "wlfu", "learned", "learned@conversation", "oracle")
RELEASES = ("0.5.23", "0.4.10")
SIM = ["hardware=h100", "model=llama3_8b"]
# name -> (workload overrides, three capacities, whether the sim takes a trace's first requests)
WORKLOADS = {
    "mooncake_conversation": (["workload=trace", "workload.format=mooncake",
                               "workload.path=data:mooncake_conversation"],
                              (1_000_000, 3_000_000, 10_000_000), True),
    "mooncake_synthetic": (["workload=trace", "workload.format=mooncake",
                            "workload.path=data:mooncake_synthetic"],
                           (1_000_000, 3_000_000, 10_000_000), True),
    "sharegpt_chat": (["workload=sharegpt_chat", "workload.num_conversations=400"],
                      (50_000, 150_000, 400_000), False),
    "tree_of_thought": (["workload=tree_of_thought", "workload.num_problems=256"],
                        (800, 3_000, 6_000), False),
    "chat_tenants": (["workload=chat_tenants"], (20_000, 60_000, 150_000), False),
}
TRAINED_ON = ("mooncake_conversation", 3_000_000)


def policy_overrides(policy: str, model: Path) -> list[str]:
    if policy == "learned@conversation":
        return ["eviction=learned", f"eviction.model={model}", "eviction.refit=false"]
    return [f"eviction={policy}"]


def train_transfer(out: Path) -> Path:
    """The learned policy's model at the end of the Mooncake conversation trace at 3M tokens
    (0.5.23), saved to ``out/learned_conversation.json``."""
    path = out / "learned_conversation.json"
    run = assemble(compose_config([*WORKLOADS[TRAINED_ON[0]][0], "backend=replay",
                                   "eviction=learned"]))
    requests = run.requests()
    cache = run.build_cache(TRAINED_ON[1], requests)
    replay(requests, cache)
    cache.policy.model.save(path)
    print(f"trained on {TRAINED_ON[0]} at {TRAINED_ON[1]:,}: {cache.policy.fits} fits -> {path}")
    return path


def replay_rows(name: str, overrides: list[str], capacities, policies, model: Path) -> list[dict]:
    """Hit rate of every policy x capacity x release through the replay backend."""
    rows, requests = [], None
    for release in RELEASES:
        for policy in policies:
            run = assemble(compose_config([*overrides, "backend=replay", f"scheduler.sglang={release}",
                                           *policy_overrides(policy, model)]))
            requests = requests if requests is not None else run.requests()
            prompt = sum(len(r.prompt) for r in requests)
            for capacity in capacities:
                started = time.perf_counter()
                records = replay(requests, run.build_cache(capacity, requests))
                rows.append({"workload": name, "release": release, "eviction": policy,
                             "capacity_tokens": capacity, "measure": "replay",
                             "hit_rate": sum(r.cached_tokens for r in records) / prompt,
                             "seconds": time.perf_counter() - started})
    return rows


def simulate_rows(name: str, overrides: list[str], capacities, policies, model: Path,
                  head: int | None) -> list[dict]:
    """Hit rate, TTFT p50/p99 and throughput of each policy x capacity in the simulator (0.5.23)."""
    rows, requests = [], None
    for policy in policies:
        for capacity in capacities:
            run = assemble(compose_config([*overrides, "backend=sim", *SIM, "progress=false",
                                           f"cache.capacity_tokens={capacity}",
                                           *policy_overrides(policy, model)]))
            if requests is None:
                requests = run.requests()
                requests = requests[:head] if head else requests
            started = time.perf_counter()
            result = run_backend(run, requests)
            s = summarize(result.records, ideal=0.0, wall_s=0.0, preemptions=result.preemptions)
            rows.append({"workload": name, "release": "0.5.23", "eviction": policy,
                         "capacity_tokens": capacity, "measure": "sim", "hit_rate": s["hit_rate"],
                         "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
                         "throughput_tok_s": s["throughput_tok_s"],
                         "aborted": s["aborted_requests"], "requests": len(requests),
                         "seconds": time.perf_counter() - started})
            print(f"  sim {name} {policy} {capacity:,}: hit {s['hit_rate']:.4f} "
                  f"tok/s {s['throughput_tok_s']:.0f} ({rows[-1]['seconds']:.0f} s)", flush=True)
    return rows


def above_oracle(df: pd.DataFrame) -> pd.DataFrame:
    """Replay cells where a policy's hit rate is above the oracle's (same workload, release,
    capacity); the bound's check."""
    rep = df[df["measure"] == "replay"]
    key = ["workload", "release", "capacity_tokens"]
    oracle = rep[rep["eviction"] == "oracle"].set_index(key)["hit_rate"]
    bound = rep.set_index(key).index.map(oracle)
    return rep[(rep["hit_rate"].to_numpy() > bound.to_numpy() + 1e-12)
               & (rep["eviction"] != "oracle").to_numpy()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    ap.add_argument("--sim-requests", type=int, default=2000,
                    help="a trace's first requests in the simulator (default %(default)s)")
    ap.add_argument("--no-sim", action="store_true", help="hit rates only")
    ap.add_argument("--report-only", action="store_true", help="tables and figures from the CSV")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    csv = args.out / "eviction_fair.csv"
    if not args.report_only:
        started = time.perf_counter()
        model = train_transfer(args.out)
        rows: list[dict] = []
        for name in args.workloads:
            overrides, capacities, traced = WORKLOADS[name]
            t = time.perf_counter()
            rows += replay_rows(name, overrides, capacities, POLICIES, model)
            print(f"{name}: replays {time.perf_counter() - t:.0f} s", flush=True)
            if not args.no_sim:
                rows += simulate_rows(name, overrides, capacities, SIM_POLICIES, model,
                                      args.sim_requests if traced else None)
            pd.DataFrame(rows).to_csv(csv, index=False)  # kept as it grows
        print(f"study: {time.perf_counter() - started:.0f} s")
    df = pd.read_csv(csv)
    bad = above_oracle(df)
    print(f"Belady bound: {len(df[df['measure'] == 'replay'])} replay cells, a policy above the "
          f"oracle in {len(bad)}")
    if len(bad):
        print(bad.to_string(index=False))
    write_report(df, args.out / "report.md", TRAINED_ON)
    plot(df, args.out)
    print(f"wrote {csv}, {args.out / 'report.md'} and figures")
    return 1 if len(bad) else 0


if __name__ == "__main__":
    entry(main)
