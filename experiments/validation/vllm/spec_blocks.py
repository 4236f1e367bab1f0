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

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from experiments.validation.vllm import wheel
from experiments.validation.vllm.scheduler import (Case, compare, drive_ours, drive_vllm,
                                                   make_case, run_check)
from testbed.cache.block_hash import BlockHashCache
from testbed.scheduler.speculative import SpeculativeConfig
from testbed.scheduler.vllm import VllmScheduler
from testbed.scheduler.vllm_config import VllmSchedulerConfig
from testbed.workloads.request import TOKEN_DTYPE

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
    trace = Trace()

    def after_step(reqs) -> None:
        trace.free.append(len(cache._free))
        known = {}
        for r in reqs:
            fill = r.fill()
            for i, key in enumerate(cache.block_keys(fill).tolist()):
                known[key] = ((i + 1) * b, tuple(fill[: (i + 1) * b].tolist()))
        trace.hashed.append({int(blk) + 1: _prefix_of(known, int(cache._key[blk]))
                             for blk in np.flatnonzero(cache._keyed[: cache.num_blocks])})
    reqs = drive_ours(case, s, cache, trace,
                      lambda e: (e.req.id, e.new, 0 if e.draft is None else len(e.draft)),
                      after_step)
    trace.outputs = {r.id: [int(t) for t in r.output] for r in reqs}  # (aborted: so far)
    return trace


def run_vllm(v, sc: SpecCase) -> Trace:
    case = sc.case
    b = case.block_size
    side = wheel.VllmSide(v, case.num_blocks, b, case.settings, drafts=sc.drafts)
    pool = side.scheduler.kv_cache_manager.block_pool
    trace = Trace()

    def after_step() -> None:
        trace.free.append(pool.get_num_free_blocks())
        known = {}
        for req in side.requests.values():
            tokens = list(req.all_token_ids)
            for i, h in enumerate(req.block_hashes):
                known[h] = ((i + 1) * b, tuple(tokens[: (i + 1) * b]))
        trace.hashed.append({blk.block_id: _prefix_of(known, v.get_block_hash(blk.block_hash))
                             for blk in pool.blocks if blk.block_hash is not None})
    drive_vllm(case, side, trace,
               lambda rid, n: (rid, n, len(side.scheduled_drafts.get(rid, ()))), after_step)
    trace.outputs = {rid: list(req.output_token_ids) for rid, req in side.requests.items()}
    return trace


def _short(prefix: tuple) -> str:
    return f"{prefix[0]} tokens ending {list(prefix[1][-4:])}" \
        if prefix[0] != "unknown" else "a hash of no verified prefix"


def differ(ours: Trace, theirs: Trace) -> str | None:
    """`scheduler.compare` with, after each step, the free blocks and the hashed blocks with
    the prefix each hash stands for; at the end, the outputs."""
    def per_step(i: int) -> str | None:
        if ours.free[i] != theirs.free[i]:
            return f"after step {i}: {ours.free[i]} free blocks, vLLM {theirs.free[i]}"
        if ours.hashed[i] != theirs.hashed[i]:
            h, t = ours.hashed[i], theirs.hashed[i]
            diff = {blk: (_short(h[blk]) if blk in h else None,
                          _short(t[blk]) if blk in t else None)
                    for blk in sorted(h.keys() | t.keys()) if h.get(blk) != t.get(blk)}
            return f"after step {i}: hashed blocks differ (block: ours, vLLM): {diff}"
        return None
    return compare(ours, theirs, "(id, tokens, drafts) ", per_step,
                   lambda: None if ours.outputs == theirs.outputs else "outputs differ")


def tally(counts: Counter, sc: SpecCase, ours: Trace) -> None:
    counts["steps"] += len(ours.steps)
    entries = [e for step in ours.steps for e in step]
    counts["verifies"] += sum(d > 0 for _, _, d in entries)
    counts["drafts"] += sum(d for _, _, d in entries)
    counts["preemptions"] += sum(len(p) for p in ours.preempted)
    counts["hit_reqs"] += sum(h > 0 for h in ours.hits.values())
    counts["hit_tokens"] += sum(ours.hits.values())
    counts["hashed"] += len(ours.hashed[-1]) if ours.hashed else 0
    counts["aborts"] += bool(sc.case.aborts)


def main() -> int:
    return run_check(
        __doc__, 1000, "its Scheduler, KVCacheManager, BlockPool and Request, driven with drafts "
        "(spec_token_ids, update_draft_token_ids); stand-ins: the VllmConfig (no "
        "speculative_config: no CUDA-graph padding), structured output", spec_case, run_ours,
        run_vllm, differ, tally,
        lambda sc: (f"{sc.case.name} (B={sc.case.block_size}, {sc.case.num_blocks} blocks, "
                    f"k={sc.k}, {sc.case.settings}, {len(sc.case.requests)} requests)"),
        lambda c: ("(per step: requests, tokens and drafts scheduled, preemptions, free blocks, "
                   "hashed blocks and the prefix of each hash; first-admission hits, final free "
                   f"queue, outputs); over the agreeing cases {c['steps']} steps, "
                   f"{c['verifies']} verifications of {c['drafts']} drafts, {c['preemptions']} "
                   f"preemptions, {c['hit_reqs']} requests with a hit ({c['hit_tokens']} tokens), "
                   f"{c['hashed']} blocks hashed at the end, {c['aborts']} cases with aborts"))


if __name__ == "__main__":
    from experiments import entry
    entry(main)
