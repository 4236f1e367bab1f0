"""The routing study live: N ``testbed.serve`` replicas of SmolLM2 on this CPU behind every router
policy (``python -m testbed.route``: the simulator's policy objects) and behind SGLang's own
gateway (``smg``, installed into its own virtual environment), on the same workload, beside the
simulator's ``replicas=N router=...`` run of the same calls.

For each workload and front end, from empty caches (``POST /reset_prefix_cache`` on every
replica): the front end starts as its own process in front of the running replicas, the
workload is driven through it by ``backend=server`` with text prompts
(``server.prompt_format=text``: smg takes no token ids; the same texts for every front end),
forced output lengths, as a closed loop; then it stops. Reported per run: each replica's hit
rate and the total, from the replicas' own counts (their ``/metrics`` counters before and after),
requests per second and TTFT p50/p99 (the client's), imbalance (max/mean of the requests each
replica served), failed calls, the front end's own CPU seconds during the workload
(``front_cpu_s``: its processes' share of the cores the replicas run on), and the replicas'
steps as they timed them (``/debug/steps``:
the engine's own CPU-clocked cost, which the fitted model predicts, against the wall time the
loops took and the time they waited for a core on this shared 2-core machine); and the simulator's run of the calls as they ran (the prompts
the replicas tokenized, the outputs they returned, the workload's programs and closed loop, the
replicas' load seen as the live router sees it, ``router.load_seen=stream``:
`experiments.validation.vllm.caching.as_ran_trace`; behind testbed.route, the first wave at the
times and in the order the router received it, ``/debug/state`` ``routing``, since calls sent a
millisecond apart may reach it in another order; behind smg, at the client's send times) with the same policy (smg's: ``cache_aware`` at
smg's defaults), the same KV pool and the fitted SmolLM2 CPU cost model
(conf/calibration/smollm2_135m_cpu.yaml, or ``--fitted``: a fit made beside the study, which a
throughput comparison needs, since this machine's speed moves between days). Behind
testbed.route, ``sim_same_replica`` is the share of calls the twin sent to the replica that
served them live, under the naming of the replicas that agrees most (``/debug/state``
``routing``, saved as ``routing.json`` in the run's folder). ``--twin-runs N`` simulates each
testbed front's calls N - 1 more times with the first wave's arrivals jittered by
``± --twin-jitter-ms`` and reports the range of the hit rate and throughput
(`experiments.studies.routing_twin`: how far milliseconds move a timing-bound policy).
``--served-fit FRONT ...`` prices the twins by the replicas' own served steps instead (wall clock,
the serving path included), fitted on the named fronts' runs and checked on the others
(`experiments.studies.routing_served_fit`; the table's ``sim_priced_by``).

``--repeats N`` runs the whole study N times over the same replicas, each run's row numbered
(``repeat``) and each repeat taking the fronts in an order turned by one (the first repeat's first
front runs last in the next), so that no front always meets the machine's drift at the same
point. With more than one run a comparison with smg is of the fronts' medians, beside how many
repeats each front led in, and throughput's is paired (`experiments.studies.routing_checks`: not
below smg's when the repeats' 95% interval rules out a deficit of ``--margin``); each run keeps
its own simulator twin, checked against its own run. ``routing_live_summary.csv`` holds each
front's median, least and most over the runs. ``--pooled STUDY ...`` starts nothing: it checks
earlier studies' runs as one study.

``--replica-kind vllm``: the replicas are vLLM 0.32's CPU server (the venv
`experiments.validation.vllm.caching` installs), each bound to a core of its own, with the same
KV pool in blocks of 32 (what its CPU attention takes); the fronts ``round_robin``,
``cache_aware`` (at both thresholds) and smg's, hit rates from vLLM's own ``/metrics``; no
simulator twin (the fitted model prices the testbed's engine, not vLLM's) and no ``kv_events``
(vLLM publishes no cache events over HTTP).

Fronts beyond the default list (`experiments.studies.routing_fronts.FRONT_ROUTERS`):
``cache_aware_at_routing`` (our cache_aware inserting a prompt only when it routes it, as
smg), ``cache_aware_smallest_tree`` (a prompt matched below the threshold sent to the replica with
the smallest tree, sgl-router's rule, rather than the least loaded, smg's), and
``cache_aware_fewest_sent`` and ``kv_events_fewest_sent`` (a tie of loads broken towards the
replica sent the fewest requests, ``router.tie_break=fewest_sent``, rather than the lowest index).

Workloads: ``chat``: multi-tenant chat (``workload=chat_tenants`` scaled to this CPU: 8 tenants
with 384-token system prompts, 16 sessions of 3 turns, 6 sessions at once); ``mooncake``: the
first requests of the Mooncake conversation trace (prompts cut to 1,024 tokens, outputs to 16,
ids remapped into SmolLM2's vocabulary as `experiments.validation.vllm.caching` does), 4 at once.

    python -m experiments.studies.routing_live [--replicas 2] [--workloads chat mooncake]
        [--fronts round_robin random least_load cache_aware kv_events smg_cache_aware]
        [--fitted DIR/calibration/cost_model.yaml] [--replica-kind testbed|vllm]
        [--twin-runs 1] [--twin-jitter-ms 3] [--served-fit FRONT ...] [--repeats 1] [--out DIR]
        [--margin 0.02]
    python -m experiments.studies.routing_live --pooled STUDY [STUDY ...] [--margin 0.02]

Writes ``routing_live.csv`` (a row a run) and ``routing_live_summary.csv`` (a row a workload and
front) into ``--out`` and prints both and the acceptance checks (docs/results/routing_live.md).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pandas as pd

from experiments import REPO, entry
from experiments.benchmarks.served_step import steps_recorded, steps_since
from experiments.studies.routing_fronts import (CAPACITY, MODEL, counters, front_end,
                                                replicas, reset, router_of)
from experiments.studies.routing_checks import MARGIN, read_studies, report, summary
from experiments.studies.routing_served_fit import fit_served
from experiments.studies.routing_twin import ROUTING, twin
from experiments.validation.vllm import caching
from experiments.validation.vllm import live as vllm_live
from testbed.errors import BadInput

SIM = ["backend=sim", f"model={MODEL}", "hardware=cpu"]
SHIPPED_FIT = "cost_model=fitted_smollm2_cpu"
WORKLOADS = {
    "chat": (["workload=chat_tenants", "workload.num_tenants=8", "workload.num_sessions=16",
              "workload.turns=3", "workload.system_prompt_len=384",
              "workload.min_question_len=32", "workload.max_question_len=96",
              "workload.min_output_len=16", "workload.max_output_len=32",
              "workload.think_time_s=0.0"], ["arrival.max_in_flight=6"]),
    "mooncake": (None, ["arrival.max_in_flight=4"]),
}
MOONCAKE_REQUESTS = 32
FRONTS = ["round_robin", "random", "least_load", "cache_aware", "cache_aware_router_0_1",
          "kv_events", "smg_cache_aware"]
VLLM_FRONTS = ["round_robin", "cache_aware", "cache_aware_router_0_1", "smg_cache_aware"]
REPLICA_KINDS = ("testbed", "vllm")


# ---------------------------------------------------------------- one run
def workload_words(name: str, out: Path) -> list[str]:
    words, _ = WORKLOADS[name]
    if words is not None:
        return words
    from testbed.data import resolve_trace
    path, _ = resolve_trace(caching.MOONCAKE)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "mooncake_tokens.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in caching.mooncake_trace(
        path, requests=MOONCAKE_REQUESTS, prompt=1024, output=16)))
    return ["workload=trace", f"workload.path={trace}", "workload.format=tokens"]


def live(front: str, words: list[str], arrival: list[str], urls: list[str], out: Path,
         cache: Path, kind: str = "testbed") -> dict:
    """One front end in front of the running replicas (``kind``: testbed.serve or vLLM, whose
    steps are not recorded) on the workload, from empty caches: the run's row."""
    from testbed.config.assembly import compose_config
    from testbed.execute import execute

    reset(urls)
    (out / ROUTING).unlink(missing_ok=True)  # (an earlier run's, which this one replaces)
    before = counters(urls)
    first = [steps_recorded(u) for u in urls] if kind == "testbed" else None
    served_name = MODEL if kind == "testbed" else vllm_live.SERVED_NAME
    with front_end(front, urls, cache, out / "front.log") as (url, front_cpu_s):
        ready_cpu_s = front_cpu_s()
        execute(compose_config([*words, *arrival, "backend=server", f"server.url={url}",
                                f"server.model={served_name}", "server.prompt_format=text",
                                f"model={MODEL}", "engine.forced=true", "save_token_ids=true",
                                "progress=false"]), out / "client")
        front_cpu = front_cpu_s() - ready_cpu_s  # the workload's share, start-up left out
        state = httpx.get(url + "/debug/state", timeout=30).json() \
            if not front.startswith("smg_") else None
    after = counters(urls)
    s = json.loads((out / "client" / "summary.json").read_text())
    per = [(a["prefix_cache_hits"] - b["prefix_cache_hits"],
            a["prefix_cache_queries"] - b["prefix_cache_queries"]) for a, b in zip(after, before)]
    served = [sum(a["request_success"].values()) - sum(b["request_success"].values())
              for a, b in zip(after, before)]
    row = {"hit_rate": sum(h for h, _ in per) / max(1, sum(q for _, q in per)),
           "replica_hit_rates": " ".join(f"{h / q:.3f}" if q else "-" for h, q in per),
           "requests_per_s": s["throughput_req_s"], "ttft_p50_s": s["ttft_p50_s"],
           "ttft_p99_s": s["ttft_p99_s"], "imbalance": max(served) / np.mean(served),
           "served": " ".join(map(str, served)), "failed": s.get("failed_requests", 0),
           "client_hit_rate": s["hit_rate"], "front_cpu_s": front_cpu}
    if first is not None:
        steps = [steps_since(u, n) for u, n in zip(urls, first)]
        # the replicas' steps as they timed them: the engine's own cost (what the fitted model
        # predicts: CPU-clocked) against the wall time its loop took around them
        row |= {"engine_busy_s": sum(x["gpu_s"] + x["host_s"] for st in steps for x in st),
                "wall_busy_s": sum(x["turn_s"] for st in steps for x in st),
                "waited_for_core_s": sum(x["runqueue_s"] or 0.0 for st in steps for x in st)}
    if state is not None:
        row["decisions"] = " ".join(f"{k}={v}" for k, v in state["decisions"].items())
        (out / ROUTING).write_text(json.dumps(state["routing"]))
    return row


def simulated(front: str, words: list[str], arrival: list[str], replicas: int, out: Path,
              fitted: Path | None = None, runs: int = 1, jitter_ms: float = 0.0) -> dict:
    """The simulator's twin of the run in ``out`` (`experiments.studies.routing_twin.twin`) with
    the same policy, priced by the shipped SmolLM2 CPU fit or by the cost_model.yaml ``fitted``;
    ``runs - 1`` more with the first wave jittered by ``± jitter_ms``."""
    from testbed.config.assembly import assemble, compose_config

    requests = assemble(compose_config([*words, "backend=replay"])).requests()
    cost = ["cost_model=fitted", f"cost_model.path={fitted}"] if fitted else [SHIPPED_FIT]
    # the router sees a replica's load as a router in front of servers does: a prompt counts
    # until its request ends (router.load_seen=stream; testbed.route's view, and smg's)
    return twin([*SIM, *cost, *router_of(front), "router.load_seen=stream",
                 f"replicas={replicas}", f"cache.capacity_tokens={CAPACITY}", *arrival,
                 "engine.forced=true"],
                requests, out, replicas, runs, jitter_ms)


# ---------------------------------------------------------------- the study
def front_order(fronts: list[str], repeat: int) -> list[str]:
    """The fronts in the order repeat ``repeat`` (from 1) runs them: turned by one a repeat."""
    k = (repeat - 1) % len(fronts)
    return fronts[k:] + fronts[:k]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.studies.routing_live",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--fronts", nargs="+", default=None,
                    help=f"default: {' '.join(FRONTS)}; with vLLM replicas "
                         f"{' '.join(VLLM_FRONTS)}")
    ap.add_argument("--replica-kind", choices=REPLICA_KINDS, default="testbed",
                    help="testbed.serve replicas (default), or vLLM 0.32's CPU server (in the "
                         "venv `experiments.validation.vllm.caching` installs), each bound to a "
                         "core of its own; no simulator twin and no kv_events for vLLM")
    ap.add_argument("--cache-dir", type=Path, default=vllm_live.DEFAULT_CACHE)
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "routing_live")
    ap.add_argument("--twin-runs", type=int, default=1,
                    help="simulator runs of each testbed front's calls: the exact one, and "
                         "RUNS - 1 with the first wave's arrivals jittered (default 1: none)")
    ap.add_argument("--twin-jitter-ms", type=float, default=3.0,
                    help="how far the jittered runs move each first-wave arrival, +- ms "
                         "(default 3: the router received the chat's first calls 3-4 ms apart)")
    ap.add_argument("--fitted", type=Path, default=None,
                    help="a cost_model.yaml to price the simulator's runs (default: the shipped "
                         "fitted_smollm2_cpu); fit one beside the study with `python -m "
                         "experiments.validation.sim_vs_engine --real --out DIR`")
    ap.add_argument("--served-fit", nargs="+", default=None, metavar="FRONT",
                    help="price the twins by a cost model fitted to the replicas' steps in these "
                         "testbed.route fronts' runs, every workload's (e.g. round_robin random; "
                         "`experiments.studies.routing_served_fit`): their rows are the fit's "
                         "training data, the other fronts' held out")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the whole study this many times, each repeat's fronts in an order "
                         "turned by one; smg is compared by medians (default 1)")
    ap.add_argument("--margin", type=float, default=MARGIN,
                    help="with repeats, a front's throughput counts as not below smg's when the "
                         "paired 95%% interval rules out a deficit this large (a share of smg's; "
                         f"default {MARGIN})")
    ap.add_argument("--pooled", nargs="+", type=Path, default=None, metavar="STUDY",
                    help="start nothing: print the summary and checks of earlier studies' runs "
                         "pooled (each a routing_live.csv or the --out folder holding one; their "
                         "repeats numbered one after the other)")
    args = ap.parse_args(argv)
    if not 0 <= args.margin < 1:
        raise BadInput(f"--margin must be in [0, 1), got {args.margin}")
    if args.pooled is not None:
        report(read_studies(args.pooled), args.margin)
        return 0
    if args.served_fit is not None:
        if args.fitted is not None or args.replica_kind == "vllm":
            raise BadInput("--served-fit prices testbed replicas' twins by their served steps: "
                           "give it without --fitted and --replica-kind vllm")
        bad = [f for f in args.served_fit
               if f.startswith("smg_") or f not in (args.fronts or FRONTS)]
        if bad:
            raise BadInput(f"--served-fit: {' '.join(bad)}: each must be a testbed.route front "
                           f"the study runs (smg logs no routing decisions); the fronts: "
                           f"{' '.join(f for f in args.fronts or FRONTS if not f.startswith('smg_'))}")
    if args.fitted is not None and not args.fitted.is_file():
        raise BadInput(f"--fitted: no file {args.fitted}")
    if args.repeats < 1:
        raise BadInput(f"--repeats must be >= 1, got {args.repeats}")
    if args.twin_runs < 1 or args.twin_jitter_ms < 0:
        raise BadInput(f"--twin-runs must be >= 1 and --twin-jitter-ms >= 0, got "
                       f"{args.twin_runs} and {args.twin_jitter_ms}")
    vllm = args.replica_kind == "vllm"
    fronts = args.fronts or (VLLM_FRONTS if vllm else FRONTS)
    if vllm and "kv_events" in fronts:
        raise BadInput("--fronts: kv_events needs the cache events of testbed.serve replicas, "
                       "not vLLM's")
    rows = []
    with replicas(args.replica_kind, args.replicas, args.cache_dir, args.out) as urls:
        print(f"{args.replicas} {args.replica_kind} replicas of {MODEL}: {' '.join(urls)}",
              file=sys.stderr, flush=True)
        try:
            study(args, fronts, urls, rows)
        finally:
            if rows:  # (a study cut short keeps the runs it made)
                args.out.mkdir(parents=True, exist_ok=True)
                pd.DataFrame(rows).to_csv(args.out / "routing_live.csv", index=False)
                summary(pd.DataFrame(rows)).to_csv(args.out / "routing_live_summary.csv",
                                                   index=False)
    report(pd.DataFrame(rows), args.margin)
    return 0


def study(args: argparse.Namespace, fronts: list[str], urls: list[str], rows: list[dict]
          ) -> None:
    """Every workload through every front end, a row each into ``rows`` as it is done."""
    vllm = args.replica_kind == "vllm"

    def done(row: dict, words: list[str], arrival: list[str], out: Path,
             fit: Path | None = None, priced: str | None = None) -> None:
        """The row into ``rows``, with its simulator twin (none behind vLLM) priced by ``fit``."""
        if priced is not None:
            row |= simulated(row["front"], words, arrival, args.replicas, out, fit,
                             args.twin_runs, args.twin_jitter_ms)
            row["sim_priced_by"] = priced
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    later = []  # with --served-fit the twins wait for the fit, made once every run is live
    trained: list[Path] = []  # the runs the served fit learns from
    words_of = {w: workload_words(w, args.out / w) for w in args.workloads}
    for repeat in range(1, args.repeats + 1):
        for w in args.workloads:
            words, (_, arrival) = words_of[w], WORKLOADS[w]
            for front in front_order(fronts, repeat):
                out = args.out / w / front
                if args.repeats > 1:
                    out = out / f"run_{repeat}"
                started = time.perf_counter()
                row = {"workload": w, "front": front, "repeat": repeat,
                       "replicas": args.replica_kind,
                       **live(front, words, arrival, urls, out, args.cache_dir,
                              args.replica_kind)}
                row["wall_s"] = time.perf_counter() - started
                if args.served_fit:  # (never behind vLLM: main refuses the two together)
                    later.append((row, words, arrival, out))
                    if front in args.served_fit:
                        trained.append(out)
                    print(f"{w} {front} (run {repeat}): live {row['requests_per_s']:.2f} req/s, "
                          f"hit rate {row['hit_rate']:.3f}; its twin after the served fit",
                          file=sys.stderr, flush=True)
                else:
                    done(row, words, arrival, out, args.fitted, None if vllm else "engine fit")
    if later:
        fit = fit_served(trained, args.out / "served_fit", MODEL, args.out)
        for row, words, arrival, out in later:
            done(row, words, arrival, out, fit, "served fit (trained here)"
                 if row["front"] in args.served_fit else "served fit (held out)")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    entry(main)
