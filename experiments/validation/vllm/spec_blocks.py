"""A differential check of block hashing under speculative decoding against vLLM 0.32's own code.

The rule checked (docs/design.md §4, "Speculative decoding" and "scheduler=vllm"): a KV block gets
its hash (becomes hit-able) only when full of *verified* tokens; drafts take blocks for their step
but are never hashed. vLLM's ``Scheduler`` with its ``KVCacheManager`` and ``BlockPool`` is
imported from the wheel (`wheel`: stand-ins for the config and structured output) and driven
with drafts as its engine core drives it with a drafter: ``schedule`` (running requests take
``num_tokens_with_spec − num_computed_tokens`` tokens, drafts included; ``allocate_slots`` takes
blocks for all of them and caches up to ``min(computed + new, request.num_tokens)``),
``update_from_output`` with each verifying request's accepted drafts and bonus token (rejected
drafts roll ``num_computed_tokens`` back), then ``update_draft_token_ids`` with the next drafts
(`wheel.VllmSide`). The stand-in config has no ``speculative_config`` and
``num_speculative_tokens`` 0, so vLLM's CUDA-graph padding of one-token admissions (placeholder
drafts for uniform decode batches) is off; drafts reach the scheduler only through
``spec_token_ids``. The testbed's side is ``scheduler=vllm`` (`testbed.scheduler.vllm`) with
``speculative`` over a ``BlockHashCache`` of the same usable blocks: its drafts as vLLM's
``spec_token_ids``, its verified tokens applied by `SpecSteps.apply` (rejected drafts: the lease
rewound, the blocks kept: ``BlockHashCache.rewind``), hashes registered by ``commit`` of the fill
(verified tokens only) at each ``allocate_slots``.

The cases are `scheduler.make_case`'s (2-12 requests sharing prefixes, 1-24 forced output
tokens, block sizes 4/8/16, pools from just enough blocks for the largest request, budgets and
thresholds that cut prompts and drafts, a third with aborts), each with ``k`` of 1-6 and a
deterministic draft schedule fed identically to both: after a request's ``n``-th output token it
proposes ``d`` drafts (at most ``k`` and its remaining output less one), the output's next ``d``
tokens with the ``a``-th replaced by 0 (never an output token) when ``a < d``, so that it accepts
``a`` of them (fewer when the budget cut the drafts scheduled). Compared, step by step: the
requests scheduled, tokens and drafts each, in order; the requests preempted; the free block
count; which blocks hold a hash and the token prefix each hash stands for (vLLM's block hash
traced back to the request blocks it was computed from; ours from the cache's key), so that a
hashed draft shows as a prefix no request has. Then each request's hit at its first admission,
the final free queue and the outputs. Exit code 0 when every case agrees, 1 otherwise, 2 when
vLLM cannot be had.

    python -m experiments.validation.vllm.spec_blocks [--cases N] [--cache-dir DIR]  # 1,000
    python -m experiments.validation.vllm.spec_blocks --quick                        # 100
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from experiments.validation.vllm import wheel
from experiments.validation.vllm.scheduler import MAX_STEPS, Case, check_args, load_wheel, make_case
from testbed.cache.block_hash import BlockHashCache
from testbed.scheduler.speculative import SpeculativeConfig
from testbed.scheduler.vllm import VllmScheduler
from testbed.scheduler.vllm_config import VllmSchedulerConfig
from testbed.sim.executor import predetermined_tokens
from testbed.workloads.request import TOKEN_DTYPE, Request

WRONG = 0  # a rejected draft's token: outputs are drawn from 1..999


@dataclass
class SpecCase:
    case: Case
    k: int  # drafts per step at most
    index: int

    def drafts(self, rid: str, n: int) -> list[int]:
        """What request ``rid`` drafts after its ``n``-th output token (fixed per case)."""
        i = next(j for j, r in enumerate(self.case.requests) if r[0] == rid)
        output = self.case.requests[i][2]
        room = min(self.k, len(output) - n - 1)
        if room < 1:
            return []
        rng = np.random.default_rng([self.index, i, n, 11])
        d = room if rng.random() < 0.6 else int(rng.integers(0, room + 1))
        a = d if rng.random() < 0.3 else int(rng.integers(0, d + 1))
        draft = list(output[n : n + d])
        if a < d:
            draft[a] = WRONG
        return draft


@dataclass
class Trace:
    """What one side did with a case."""

    steps: list[list[tuple[str, int, int]]] = field(default_factory=list)  # id, tokens, drafts
    preempted: list[set[str]] = field(default_factory=list)
    free: list[int] = field(default_factory=list)  # free blocks after each step
    hashed: list[dict[int, tuple]] = field(default_factory=list)  # block id (+1) -> its prefix
    hits: dict[str, int] = field(default_factory=dict)
    free_queue: list[int] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    stuck: bool = False


def _prefix_of(known: dict, key: Any) -> tuple:
    """The token prefix a block's hash stands for: (its length, the tokens), or ('unknown', key)
    when no request's verified tokens give that hash (a hashed draft would)."""
    return known.get(key, ("unknown", key))


def spec_case(rng: np.random.Generator, index: int) -> SpecCase:
    case = make_case(rng, index)
    k = int(np.random.default_rng([index, 13]).choice([1, 2, 3, 4, 4, 6]))
    return SpecCase(case, k, index)


def run_ours(sc: SpecCase) -> Trace:
    case = sc.case
    b = case.block_size
    cache = BlockHashCache(capacity=case.num_blocks * b, block_size=b)
    s = VllmScheduler(cache, VllmSchedulerConfig(**case.settings), check_invariants=True,
                      speculative=SpeculativeConfig(method="ngram", num_tokens=sc.k))
    # the case's drafts instead of prompt lookup's (the drafter's room cap is the same)
    s.spec.drafts = lambda reqs: [(np.asarray(sc.drafts(r.id, len(r.output)), TOKEN_DTYPE), None)
                                  for r in reqs]
    reqs = [s.submit(Request(rid, np.asarray(p, TOKEN_DTYPE), np.asarray(o, TOKEN_DTYPE)), 0.0)
            for rid, p, o in case.requests]
    by_id = {r.id: r for r in reqs}
    trace = Trace()
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
        trace.steps.append([(e.req.id, e.new, 0 if e.draft is None else len(e.draft))
                            for e in batch.entries])
        for e in batch.entries:
            if e.req.id not in trace.hits and e.req.cached_tokens is not None:
                trace.hits[e.req.id] = e.req.cached_tokens
        s.complete(batch, predetermined_tokens(batch), 0.0)
        trace.free.append(len(cache._free))
        known = {}
        for r in reqs:
            fill = r.fill()
            for i, key in enumerate(cache.block_keys(fill).tolist()):
                known[key] = ((i + 1) * b, tuple(fill[: (i + 1) * b].tolist()))
        trace.hashed.append({int(blk) + 1: _prefix_of(known, int(cache._key[blk]))
                             for blk in np.flatnonzero(cache._keyed[: cache.num_blocks])})
    trace.stuck |= s.has_work
    trace.free_queue = [blk + 1 for blk in cache._free.blocks()]
    trace.outputs = {r.id: [int(t) for t in r.output] for r in reqs}  # (aborted: so far)
    return trace


def run_vllm(v, sc: SpecCase) -> Trace:
    case = sc.case
    b = case.block_size
    side = wheel.VllmSide(v, case.num_blocks, b, case.settings, drafts=sc.drafts)
    for rid, p, o in case.requests:
        side.add(rid, p, o)
    pool = side.scheduler.kv_cache_manager.block_pool
    trace = Trace()
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
        trace.steps.append([(rid, n, len(side.scheduled_drafts.get(rid, ())))
                            for rid, n in scheduled])
        trace.hits.update({k: h for k, h in hits.items() if k not in trace.hits})
        trace.free.append(pool.get_num_free_blocks())
        known = {}
        for req in side.requests.values():
            tokens = list(req.all_token_ids)
            for i, h in enumerate(req.block_hashes):
                known[h] = ((i + 1) * b, tuple(tokens[: (i + 1) * b]))
        trace.hashed.append({blk.block_id: _prefix_of(known, v.get_block_hash(blk.block_hash))
                             for blk in pool.blocks if blk.block_hash is not None})
    trace.stuck |= side.has_work
    trace.free_queue = [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()]
    trace.outputs = {rid: list(req.output_token_ids) for rid, req in side.requests.items()}
    return trace


def _short(prefix: tuple) -> str:
    return f"{prefix[0]} tokens ending {list(prefix[1][-4:])}" \
        if prefix[0] != "unknown" else "a hash of no verified prefix"


def compare(ours: Trace, theirs: Trace) -> str | None:
    """None when the two traces agree, else what differs first."""
    for i, (a, b) in enumerate(zip(ours.steps, theirs.steps)):
        if a != b:
            return f"step {i}: (id, tokens, drafts) ours {a}, vLLM {b}"
        if ours.preempted[i] != theirs.preempted[i]:
            return f"step {i}: preempted ours {sorted(ours.preempted[i])}, vLLM " \
                   f"{sorted(theirs.preempted[i])}"
        if ours.free[i] != theirs.free[i]:
            return f"after step {i}: {ours.free[i]} free blocks, vLLM {theirs.free[i]}"
        if ours.hashed[i] != theirs.hashed[i]:
            h, t = ours.hashed[i], theirs.hashed[i]
            diff = {blk: (_short(h[blk]) if blk in h else None,
                          _short(t[blk]) if blk in t else None)
                    for blk in sorted(h.keys() | t.keys()) if h.get(blk) != t.get(blk)}
            return f"after step {i}: hashed blocks differ (block: ours, vLLM): {diff}"
    if len(ours.steps) != len(theirs.steps) or ours.stuck != theirs.stuck:
        return f"{len(ours.steps)} steps (stuck: {ours.stuck}) against vLLM's " \
               f"{len(theirs.steps)} (stuck: {theirs.stuck})"
    if ours.hits != theirs.hits:
        diff = {k: (ours.hits.get(k), theirs.hits.get(k)) for k in ours.hits.keys() | theirs.hits
                if ours.hits.get(k) != theirs.hits.get(k)}
        return f"first-admission hits (ours, vLLM): {diff}"
    if ours.free_queue != theirs.free_queue:
        return f"free queue at the end: ours {ours.free_queue}, vLLM {theirs.free_queue}"
    if ours.outputs != theirs.outputs:
        return "outputs differ"
    return None


def main() -> int:
    args = check_args(__doc__, 1000)
    v = load_wheel(args.cache_dir)
    if v is None:
        return 2
    print(f"vLLM {wheel.VERSION} from {v.root}: its Scheduler, KVCacheManager, BlockPool and "
          "Request, driven with drafts (spec_token_ids, update_draft_token_ids); stand-ins: the "
          "VllmConfig (no speculative_config: no CUDA-graph padding), structured output "
          "(experiments/validation/vllm/wheel.py)\n")
    n = args.cases
    rng = np.random.default_rng(args.seed)
    start = time.time()
    agree, shown = 0, 0
    counts = dict(steps=0, verifies=0, drafts=0, cut=0, preemptions=0, hit_reqs=0, hit_tokens=0,
                  hashed=0, aborts=0)
    for i in range(n):
        sc = spec_case(rng, i)
        ours, theirs = run_ours(sc), run_vllm(v, sc)
        problem = compare(ours, theirs)
        if problem is None:
            agree += 1
            counts["steps"] += len(ours.steps)
            entries = [e for step in ours.steps for e in step]
            counts["verifies"] += sum(d > 0 for _, _, d in entries)
            counts["drafts"] += sum(d for _, _, d in entries)
            counts["preemptions"] += sum(len(p) for p in ours.preempted)
            counts["hit_reqs"] += sum(h > 0 for h in ours.hits.values())
            counts["hit_tokens"] += sum(ours.hits.values())
            counts["hashed"] += len(ours.hashed[-1]) if ours.hashed else 0
            counts["aborts"] += bool(sc.case.aborts)
        elif shown < args.show:
            shown += 1
            c = sc.case
            print(f"  {c.name} (B={c.block_size}, {c.num_blocks} blocks, k={sc.k}, {c.settings}, "
                  f"{len(c.requests)} requests): {problem}")
    print(f"agreement: {agree}/{n} cases identical (per step: requests, tokens and drafts "
          f"scheduled, preemptions, free blocks, hashed blocks and the prefix of each hash; "
          f"first-admission hits, final free queue, outputs); over the agreeing cases "
          f"{counts['steps']} steps, {counts['verifies']} verifications of {counts['drafts']} "
          f"drafts, {counts['preemptions']} preemptions, {counts['hit_reqs']} requests with a "
          f"hit ({counts['hit_tokens']} tokens), {counts['hashed']} blocks hashed at the end, "
          f"{counts['aborts']} cases with aborts ({time.time() - start:.0f} s)")
    return 0 if agree == n else 1


if __name__ == "__main__":
    from experiments import entry
    entry(main)
