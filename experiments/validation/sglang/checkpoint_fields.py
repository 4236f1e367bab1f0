"""Node by node after SGLang 0.5.23's checkpoint insert: our radix tree against 0.5.23's own
RadixCache, every statistic an eviction policy can read (issue 48).

Both trees are fed replay.py's calls one request at a time (`tree_serving.serve` with
none of its rules: the whole prompt matched, the shortfall evicted, prompt + output released
through ``release_kv_cache(checkpoint=True)``, i.e. ``RadixCache.checkpoint``: the insert, the
prompt's insert that cuts the new leaf at the prompt's end, the look-up of the whole key). After
every request the two trees must hold the same nodes (tokens before each, its tokens) and, node by
node, what 0.5.23's ``TreeNode`` keeps: ``hit_count`` (ours ``hits``), ``priority`` (ours negated:
lower is more urgent here), ``creation_time`` (ours ``created``: the same order over all nodes) and
``last_access_time`` (ours ``last_access``: our order must be one of the orders theirs allows: a
walk stamps its whole path with one time there, one tick per node here). Each request's hit and
evicted tokens must agree too.

Strategies: ``lru``, ``lfu``, ``slru`` (0.5.23's own), and ``size_aware`` against 0.5.23's tree
with SGLang PR 30300's hits-per-token rule as its strategy (`HitsPerToken`, written here from the
PR's description: the wheel ships neither it nor PR 23781's WLFU, whose key reads the clock's
values, seconds there and ticks here, so no differential check can pair it). Cases: random token
runs (`replay.random_runs`) at an evicting and a tight capacity; the Mooncake conversation
trace's first requests at 300K tokens; with ``--whole``, the whole trace at 3M (hits and evictions
of every request, the fields at the end).

    python -m experiments.validation.sglang.checkpoint_fields [--quick] [--whole]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import numpy as np

from experiments import MOONCAKE_TRACE, entry
from experiments.validation.sglang import replay, wheel
from experiments.validation.sglang.tree_serving import key_tokens, serve
from testbed.cache import EVICTION, RadixCache, Requester
from testbed.workloads.request import Request

RELEASE = "0.5.23"  # the release whose checkpoint insert is checked
STRATEGIES = ("lru", "lfu", "slru", "size_aware")
FIELDS = ("nodes", "hits", "priority", "created", "last_access")


class HitsPerToken:
    """PR 30300's rule for 0.5.23's tree: ``(hit_count + 1) / tokens``, smallest first (the
    tree's heap breaks ties by ``TreeNode.__lt__``: the older access)."""

    def get_priority(self, node) -> float:
        return (node.hit_count + 1) / max(len(node.value), 1)


def their_nodes(tree) -> dict[tuple, tuple]:
    """(tokens before, tokens) -> (hit_count, priority, creation_time, last_access_time)."""
    out, stack = {}, [(child, 0) for child in tree.root_node.children.values()]
    while stack:
        node, start = stack.pop()
        tokens = key_tokens(node.key).astype(np.int64).tobytes()
        out[start, tokens] = (node.hit_count, node.priority, node.creation_time,
                              node.last_access_time)
        stack.extend((child, start + len(node.key)) for child in node.children.values())
    return out


def our_nodes(cache: RadixCache) -> dict[tuple, tuple]:
    """The same for ours, the priority negated."""
    return {(n.start, n.key.astype(np.int64).tobytes()): (n.hits, -n.priority, n.created,
                                                          n.last_access) for n in cache.nodes()}


def compare(ours: dict, theirs: dict) -> dict[str, bool]:
    """Which of `FIELDS` agree between two snapshots (the orders as the module docstring says)."""
    same = {"nodes": ours.keys() == theirs.keys()}
    if not same["nodes"]:
        return {f: False for f in FIELDS}
    keys = list(ours)
    same["hits"] = all(ours[k][0] == theirs[k][0] for k in keys)
    same["priority"] = all(ours[k][1] == theirs[k][1] for k in keys)
    same["created"] = (sorted(keys, key=lambda k: ours[k][2])
                       == sorted(keys, key=lambda k: theirs[k][2]))
    by_ours = [theirs[k][3] for k in sorted(keys, key=lambda k: ours[k][3])]
    same["last_access"] = all(a <= b for a, b in zip(by_ours, by_ours[1:]))
    return same


def check_case(sgl, requests: list[Request], capacity: int | None, strategy: str,
               every: int = 1) -> Counter:
    """One case: requests whose hit and evicted tokens agree, and per field the snapshots
    (after every ``every``-th request and after the last) that agree."""
    snapshots: list[dict] = []
    step = [0]

    def after(tree) -> None:
        step[0] += 1
        if step[0] % every == 0 or step[0] == len(requests):
            snapshots.append(their_nodes(tree))

    hits, evicted, _, _ = serve(
        sgl, requests, 1, capacity, rules=(), eviction="lru" if strategy == "size_aware"
        else strategy, strategy=HitsPerToken() if strategy == "size_aware" else None, after=after)
    cache = RadixCache(capacity, policy=EVICTION.build(strategy), sglang=RELEASE)
    counts: Counter = Counter()
    mine = iter(snapshots)
    for i, r in enumerate(requests, 1):
        hit, ev, _, _ = cache.replay_one(r.prompt, r.output, Requester(r.id, r.priority, r.category))
        counts.update(requests=1, agree=(hit, ev) == (hits[i - 1], evicted[i - 1]))
        if i % every == 0 or i == len(requests):
            counts["snapshots"] += 1
            counts.update({f: ok for f, ok in compare(our_nodes(cache), next(mine)).items()})
    return counts


def cases(quick: bool, whole: bool) -> list[tuple[str, list[Request], int | None, int]]:
    """(name, requests, capacity, snapshot every) of the check."""
    out = []
    for seed in range(2 if quick else 8):
        runs = replay.random_runs(seed)
        caps = replay.capacities(runs, RELEASE)
        out += [(f"random runs {seed}, {level}", runs, caps[level], 1) for level in ("evict", "tight")]
    head = replay.mooncake(300 if quick else 1500)
    if head is not None:
        out.append((f"Mooncake conversation, first {len(head)}, 300K", head, 300_000, 1))
    if whole and MOONCAKE_TRACE.exists():
        from testbed.workloads.traces import load_mooncake
        out.append(("Mooncake conversation, whole, 3M", load_mooncake(MOONCAKE_TRACE), 3_000_000,
                    10**9))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 random-run seeds, 300 trace requests")
    ap.add_argument("--whole", action="store_true", help="also the whole Mooncake trace at 3M")
    ap.add_argument("--strategies", type=lambda s: s.split(","), default=list(STRATEGIES))
    args = ap.parse_args()
    try:
        sgl = wheel.load(wheel.fetch(wheel.wheel_dir(RELEASE), RELEASE), RELEASE)
    except Exception as e:  # noqa: BLE001 (no wheel: say why)
        print(f"cannot get SGLang 0.5.23: {e}", file=sys.stderr)
        return 2
    started, ok = time.perf_counter(), True
    for strategy in args.strategies:
        total: Counter = Counter()
        for name, requests, capacity, every in cases(args.quick, args.whole):
            c = check_case(sgl, requests, capacity, strategy, every)
            total += c
            if c["agree"] != c["requests"] or any(c[f] != c["snapshots"] for f in FIELDS):
                ok = False
                print(f"  {strategy}, {name}: {dict(c)}")
        print(f"{strategy}: requests agreeing {total['agree']}/{total['requests']}; snapshots "
              f"{total['snapshots']}, agreeing: " + ", ".join(f"{f} {total[f]}" for f in FIELDS))
    print(f"{'all agree' if ok else 'DISAGREEMENT'} ({time.perf_counter() - started:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    entry(main)
