"""Whole offline batches step by step, (b) of the SGLang check: the small workloads and settings
of the grid, our scheduler's steps for one case (`run_ours`, ``scheduler.sglang`` the release's),
SGLang's through the release's loop around its own classes (`run_sglang`, `release_loops.LOOPS`),
the comparison over the grid (`check_batches`) and over random cases (`random_batches`).

Requests are submitted at once, dependencies ignored, outputs forced (each request produces its
predetermined tokens and stops after the last). Compared per case: each request's cache hit at
its first admission, and the list of (kind, request ids) per step; retractions are counted.
Capacities keep every request under SGLang's ``max_req_len`` so that its ``max_new_tokens``
clipping never applies.
"""

from __future__ import annotations

import random
from collections import Counter

from experiments.validation.sglang.cases import assembled
from experiments.validation.sglang.release_loops import LOOPS
from experiments.validation.sglang.stand_ins import REQS
from testbed.scheduler.scheduler import Scheduler
from testbed.workloads import generate
from testbed.workloads.request import Request

SGL_NAME = {"lpm": "lpm", "dfs_weight": "dfs-weight", "fcfs": "fcfs", "hrrn": "hrrn"}
# Small instances of the project's generators (names and parameters as in conf/workload/).
WORKLOADS = {
    "few_shot": dict(num_tasks=3, questions_per_task=6, num_shots=2, example_len=48,
                     question_len=24, output_len=4),
    "tree_of_thought": dict(num_problems=2, depth=3, branching=2, instruction_len=32,
                            problem_len=48, step_prompt_len=16, thought_len=24),
    "chat": dict(num_sessions=6, turns=3, system_prompt_len=32, min_question_len=40,
                 max_question_len=80, min_output_len=4, max_output_len=8),
    "shared_prefix": dict(num_groups=4, prompts_per_group=6, system_prompt_len=256,
                          question_len=32, output_len=24),
    "chat_long": dict(num_sessions=4, turns=2, system_prompt_len=32, min_question_len=64,
                      max_question_len=128, min_output_len=256, max_output_len=512),
}
# (capacity, max_running_requests, chunked_prefill_size, max_prefill_tokens); capacity "ample"
# never evicts, "evict" must, "tight" also retracts (sizes from the workload, see `capacities`).
CONFIGS = [("ample", 64, None, 16384), ("ample", 4, 64, 16384), ("ample", 16, 8192, 128),
           ("evict", 16, None, 16384), ("evict", 8, 64, 256), ("tight", 64, None, 16384),
           ("tight", 8, 64, 16384), ("tight", 16, 256, 512)]
QUICK_CONFIGS = [CONFIGS[0], CONFIGS[4], CONFIGS[5]]
# Policies the full grid runs besides LPM and DFS-weight (0.4.10 has no HRRN).
FULL_POLICIES = {"0.4.10": ("fcfs",), "0.5.23": ("fcfs", "hrrn")}


# ---------------------------------------------------------------- (b) whole batches
def workload(name: str) -> list[Request]:
    return generate({"name": name, **WORKLOADS[name]}, seed=1)


def capacities(requests: list[Request]) -> dict[str, int]:
    """KV capacities for a workload: all of it, a third of it, or barely more than the longest
    request (and always above SGLang's max_req_len = capacity - 1 for every request)."""
    lengths = [len(r.prompt) + len(r.output) for r in requests]
    longest, total = max(lengths), sum(lengths)
    return {"ample": total + 64, "evict": max(longest + 64, total // 3),
            "tight": max(longest + 16, total // 8)}


def run_ours(requests, policy, cap, max_running, chunk, max_prefill, release: str):
    """One case through our `Scheduler` with ``scheduler.sglang=release``: its steps, each
    request's first-admission hit, the preemptions and whether work was left."""
    run = assembled(policy, release, cap, max_running_requests=max_running,
                    max_prefill_tokens=max_prefill, chunked_prefill_size=chunk)
    sched = Scheduler(run.build_cache(cap, requests), run.scheduler)
    reqs = [sched.submit(r, 0.0) for r in requests]
    steps = []
    while len(steps) < 200_000:
        batch = sched.next_batch()
        if batch is None:
            break
        steps.append((batch.kind, frozenset(e.req.id for e in batch.entries)))
        tokens = [int(e.req.request.output[len(e.req.output)])
                  if e.produces_token and e.req.remaining_new_tokens > 0 else None
                  for e in batch.entries]
        sched.complete(batch, tokens, float(len(steps)))
    return steps, {r.id: r.cached_tokens for r in reqs}, sched.preemptions, sched.has_work


def run_sglang(sgl, requests, policy, cap, max_running, chunk, max_prefill):
    """One case through the loaded release's loop: its steps, each request's first-admission hit,
    the retractions and whether it stalled for good."""
    max_req_len = cap - 1  # TpModelWorker: min(context_len - 1, max_total_num_tokens - 1)
    for r in requests:  # handle_generate_request would abort it or clip its max_new_tokens
        if len(r.prompt) >= max_req_len - 5 or len(r.prompt) + len(r.output) + 1 > max_req_len:
            raise ValueError(f"{r.id} does not fit SGLang's max_req_len {max_req_len}")
    width = max(len(r.prompt) + len(r.output) for r in requests) + 2
    loop = LOOPS[sgl.version](sgl, SGL_NAME[policy], cap, max_running, max_prefill, chunk, width)
    reqs = [REQS[sgl.version](r.id, r.prompt.tolist(), r.output.tolist()) for r in requests]
    loop.waiting.extend(reqs)
    loop.run()
    return loop.steps, {r.rid: r.first_hit for r in reqs}, loop.retractions, loop.stuck


def first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def describe(steps: list, i: int) -> str:
    return f"{steps[i][0]} {' '.join(sorted(steps[i][1]))}" if i < len(steps) else "(ended)"


def check_batches(sgl, quick: bool, show: int) -> list[dict]:
    """(b) over the grid: our scheduler against the loaded release's loop; LPM and DFS-weight,
    and `FULL_POLICIES` too unless ``quick``."""
    rows = []
    for name in WORKLOADS:
        requests = workload(name)
        caps = capacities(requests)
        for policy in ("lpm", "dfs_weight") + (() if quick else FULL_POLICIES[sgl.version]):
            for level, max_running, chunk, max_prefill in (QUICK_CONFIGS if quick else CONFIGS):
                args = (requests, policy, caps[level], max_running, chunk, max_prefill)
                row = {"case": f"{name}/{policy}/{level}={caps[level]}/run={max_running}/"
                               f"chunk={chunk}/pf={max_prefill}", "reqs": len(requests)}
                try:
                    ours = run_ours(*args, release=sgl.version)
                except Exception as e:  # a report, not a test: say what failed and go on
                    ours = None
                    row["error"] = f"ours: {type(e).__name__}: {e}"
                try:
                    theirs = run_sglang(sgl, *args)
                except Exception as e:
                    theirs = None
                    row["error"] = f"SGLang: {type(e).__name__}: {e}"
                rows.append(row)
                if ours is None or theirs is None:
                    continue
                kinds = [Counter(k for k, _ in s) for s in (ours[0], theirs[0])]
                row.update(hits=sum(ours[1][r.id] == theirs[1][r.id] for r in requests),
                           prefill=(kinds[0]["prefill"], kinds[1]["prefill"]),
                           decode=(kinds[0]["decode"], kinds[1]["decode"]),
                           retract=(ours[2], theirs[2]), stuck=(ours[3], theirs[3]),
                           diff=first_difference(ours[0], theirs[0]),
                           sglang_steps=len(theirs[0]))
                if row["diff"] is not None and show > 0:
                    show -= 1
                    i = row["diff"]
                    print(f"  {row['case']}: step {i}\n    ours   {describe(ours[0], i)}\n"
                          f"    SGLang {describe(theirs[0], i)}")
    return rows


def print_batches(rows: list[dict]) -> None:
    width = max(len(r["case"]) for r in rows)
    print(f"{'case':<{width}}  reqs  hits=  prefill o/s  decode o/s  retract o/s  steps")
    for r in rows:
        if "hits" not in r:
            print(f"{r['case']:<{width}}  {r['reqs']:>4}  {r['error']}")
            continue
        steps = "same" if r["diff"] is None else f"differ from step {r['diff']}"
        stuck = "; stuck: " + " and ".join(w for w, s in zip(("ours", "SGLang"), r["stuck"]) if s)
        print(f"{r['case']:<{width}}  {r['reqs']:>4}  {r['hits']:>5}  {'%d/%d' % r['prefill']:>11}"
              f"  {'%d/%d' % r['decode']:>10}  {'%d/%d' % r['retract']:>11}  {steps}"
              f"{stuck if any(r['stuck']) else ''}")


def random_batches(sgl, cases: int, seed: int, show: int) -> tuple[int, int]:
    """(b) on random offline cases: a grid workload drawn with a random seed, a random policy,
    capacity (from the longest request + 16 to all of them + 64), running limit, chunk size and
    prefill budget. Returns (identical, cases); prints the first ``show`` differences."""
    rng = random.Random(seed)
    policies = ["lpm", "dfs_weight", *FULL_POLICIES[sgl.version]]
    same = 0
    for _ in range(cases):
        name = rng.choice(list(WORKLOADS))
        requests = generate({"name": name, **WORKLOADS[name]}, seed=rng.randrange(1000))
        lengths = [len(r.prompt) + len(r.output) for r in requests]
        args = (requests, rng.choice(policies),
                rng.randint(max(lengths) + 16, sum(lengths) + 64), rng.choice([2, 4, 8, 16, 64]),
                rng.choice([None, 16, 32, 64, 256, 8192]), rng.choice([64, 128, 512, 16384]))
        ours, theirs = run_ours(*args, release=sgl.version), run_sglang(sgl, *args)
        i = first_difference(ours[0], theirs[0])
        same += i is None
        if i is not None and show > 0:
            show -= 1
            print(f"  {name} {args[1:]}: step {i}\n    ours   {describe(ours[0], i)}\n"
                  f"    SGLang {describe(theirs[0], i)}")
    return same, cases
