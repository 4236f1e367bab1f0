"""What the differential checks against SGLang share: our side's run config for a release
(`assembled`) and the random trees and queues of (a) (`random_instance`)."""

from __future__ import annotations

import copy
from functools import lru_cache

import numpy as np

from testbed.config.assembly import Assembly, assemble, compose_config, plain


@lru_cache(maxsize=None)
def run_config(policy: str, release: str) -> dict:
    """The run config of our side: a radix cache (page size 1, LRU), ``scheduler=policy`` with
    the rules of SGLang ``release``."""
    return plain(compose_config(["cache=radix", "cache.page_size=1", "eviction=lru",
                                 f"scheduler={policy}", f"scheduler.sglang={release}"]))


def assembled(policy: str, release: str, capacity: int | None = None, **scheduler) -> Assembly:
    """`run_config` with a cache capacity and scheduler settings set, assembled (composed once
    per policy: 120 cases would otherwise spend seconds composing)."""
    config = copy.deepcopy(run_config(policy, release))
    config["cache"]["capacity_tokens"] = capacity
    config["scheduler"].update(scheduler)
    return assemble(config)


def random_instance(rng: np.random.Generator) -> tuple[list[list[int]], list[list[int]]]:
    """Token runs for the tree and prompts for the queue, each branching off an earlier run or
    prompt at a random point (a small vocabulary adds accidental partial matches)."""
    vocab = int(rng.choice([8, 64, 1000]))

    def grow(pool: list[list[int]]) -> list[int]:
        if pool and rng.random() < 0.8:
            base = pool[int(rng.integers(len(pool)))]
            seq = base[: int(rng.integers(0, len(base) + 1))]
        else:
            seq = []
        return seq + rng.integers(0, vocab, int(rng.integers(1, 80))).tolist()

    tree: list[list[int]] = []
    for _ in range(int(rng.integers(0, 25))):
        tree.append(grow(tree))
    size = int(rng.integers(129, 161)) if rng.random() < 0.1 else int(rng.integers(1, 41))
    queue: list[list[int]] = []
    for _ in range(size):
        queue.append(grow(tree + queue))
    return tree, queue
