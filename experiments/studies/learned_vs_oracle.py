"""What the learned eviction policy predicts against what the oracle knows, on one trace.

Replays the workload through the radix cache with LRU, ``eviction=learned``, the oracle, and
``whether`` (LRU, except that entries never used again go first: the oracle's knowledge of
*whether*, without *when*), each judged by an observer that reads the future (the oracle's index)
but decides nothing. Prints per policy the hit rate, how many evicted tokens the future uses again
(evictions Belady would rather have avoided) and, for the learned policy, how well its reuse
probability at each leaf's creation ranks the leaves the future uses again (ROC AUC), by the
leaf's turn.

    python -m experiments.studies.learned_vs_oracle [--trace data:mooncake_conversation] [--capacity 3e6]
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np
from sklearn.metrics import roc_auc_score

from testbed.config.assembly import assemble, compose_config
from testbed.cache import EVICTION, RadixCache
from testbed.cache.eviction import EvictionPolicy, Requester
from testbed.cache.oracle import Oracle
from testbed.backends.replay import replay


class Whether(Oracle):
    """LRU, but entries the future never uses again go first (knows whether, not when)."""

    name = "whether"

    def priority(self, entry: Any) -> Any:
        return (self.next_use(entry) < math.inf, entry.last_access)


class Judged(EvictionPolicy):
    """``inner`` decides; ``future`` (an oracle that decides nothing) records, per whole
    eviction, whether the future uses the entry again, and per leaf creation the inner policy's
    reuse probability (learned only) with the future's answer."""

    def __init__(self, inner: EvictionPolicy, future: Oracle) -> None:
        self.inner, self.future = inner, future
        self.evicted = {True: 0, False: 0}  # used again later -> tokens evicted
        self.created: list[tuple[float, bool, int]] = []  # (p, used again, turn)

    def priority(self, entry: Any) -> Any:
        return self.inner.priority(entry)

    def on_access(self, requester: Requester | None) -> None:
        self.future.on_access(requester)
        self.inner.on_access(requester)

    def on_create(self, entry: Any) -> None:
        self.inner.on_create(entry)
        if getattr(self.inner, "model", None) is not None:
            self.created.append((self.inner.reuse_probability(entry),
                                 self.future.next_use(entry) < math.inf,
                                 self.inner._turn.get(entry.id, 0)))

    def on_hit(self, entry: Any) -> None:
        self.inner.on_hit(entry)

    def on_evict(self, entry: Any, key: Any) -> None:
        if not entry.alive:
            self.evicted[self.future.next_use(entry) < math.inf] += len(entry.slots)
        self.inner.on_evict(entry, key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="data:mooncake_conversation")
    ap.add_argument("--format", default="mooncake")
    ap.add_argument("--capacity", type=lambda s: int(float(s)), default=3_000_000)
    args = ap.parse_args()
    run = assemble(compose_config(["workload=trace", f"workload.path={args.trace}",
                                   f"workload.format={args.format}", "backend=replay",
                                   "eviction=learned"]))
    requests = run.requests()
    prompt = sum(len(r.prompt) for r in requests)
    policies = {"lru": EVICTION.build("lru"), "learned": run.eviction.build(requests=requests),
                "whether": Whether(requests), "oracle": Oracle(requests)}
    print(f"{args.trace} at {args.capacity:,} tokens")
    print(f"{'policy':<10}{'hit rate':>10}{'evicted tokens used again':>28}")
    for name, policy in policies.items():
        judged = Judged(policy, Oracle(requests))
        cache = RadixCache(args.capacity, policy=judged)
        hit = sum(r.cached_tokens for r in replay(requests, cache)) / prompt
        again, total = judged.evicted[True], sum(judged.evicted.values())
        print(f"{name:<10}{hit:>10.4f}{again / max(total, 1):>27.1%} of {total:,}")
        if judged.created:
            p, used, turn = map(np.array, zip(*judged.created))
            print(f"  learned p at creation vs used again: ROC AUC {roc_auc_score(used, p):.3f}"
                  f" over {len(p):,} leaves ({used.mean():.1%} used again)")
            for lo, hi in ((1, 2), (2, 3), (3, 4), (4, 6), (6, 99)):
                sel = (turn >= lo) & (turn < hi)
                if sel.sum() > 50 and 0 < used[sel].mean() < 1:
                    label = f"turn {lo}" if hi == lo + 1 else f"turn {lo}-{hi - 1}"
                    print(f"    {label}: {sel.sum():,} leaves, "
                          f"{used[sel].mean():.1%} used again, mean p {p[sel].mean():.3f}, "
                          f"AUC {roc_auc_score(used[sel], p[sel]):.3f}")


if __name__ == "__main__":
    from experiments import entry
    entry(main)
