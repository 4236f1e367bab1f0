"""Replay speed of the prefix caches, side by side on one trace.

Replays the same requests (in order, one at a time: docs/design.md §4 "Replay backend") through

1. ``RadixCache`` via ``testbed.replay.replay``;
2. ``BlockHashCache`` (vLLM V1 style) via the same ``replay``;
3. ``PlainRadix``, defined below: the obvious per-token Python radix tree (edges are lists of ints
   compared token by token, children by first token, LRU by a counter, eviction by a heap of all
   leaves rebuilt per evict call as SGLang does, a Python list as the free-slot pool).

For each it prints requests per second, prompt tokens processed per second, wall seconds (the replay
loop alone, by ``time.perf_counter``; loading the trace and building the cache are not counted) and
the hit rate (cached prompt tokens / prompt tokens), then each cache's speed relative to the
baseline. The baseline follows the radix semantics exactly, so its total cached tokens must equal
RadixCache's; the script checks this (and the evicted tokens) and says which way it went.

Run it from the repository root:

    python experiments/bench_cache.py [--limit N] [--capacity N] [--skip-baseline]
    make bench ARGS="--limit 500 --capacity none"

The default trace is ``../shared/traces/mooncake_conversation_trace.jsonl`` beside the repository;
if it is missing, a generated shared-prefix workload (16 groups x 8 prompts) is used instead. The
default replays the whole trace (about a minute on two CPU cores); ``--limit 2000`` takes seconds.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script, installed or not

from testbed.cache.block_hash import BlockHashCache  # noqa: E402
from testbed.cache.radix import RadixCache  # noqa: E402
from testbed.replay import replay  # noqa: E402
from testbed.workloads.synthetic import shared_prefix  # noqa: E402
from testbed.workloads.traces import load_mooncake, load_tokens  # noqa: E402

DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
DEFAULT_CAPACITY = 3_000_000
# The whole trace by default (about a minute on 2 CPU cores); --limit 2000 for a quick look.
DEFAULT_LIMIT = 0


# ------------------------------------------------------------------------- the obvious baseline
class Node:
    __slots__ = ("key", "slots", "children", "parent", "lock", "last")

    def __init__(self, key: list[int], slots: list[int], parent: "Node | None", last: int) -> None:
        self.key = key  # the edge's tokens
        self.slots = slots  # one KV slot per token of the edge
        self.children: dict[int, Node] = {}  # by first token
        self.parent = parent
        self.lock = 0
        self.last = last  # access time (a counter)


class PlainRadix:
    """Per-token radix tree with LRU leaf eviction; ``capacity`` in tokens, None for unlimited."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.free = list(range(capacity, 0, -1)) if capacity is not None else []
        self.minted = capacity or 0
        self.clock = 0
        self.root = Node([], [], None, 0)
        self.root.lock = 1  # never evicted

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def walk(self, key: list[int]) -> tuple[Node, int, list[int]]:
        """Follow ``key`` from the root touching every node on the way; split the edge the walk
        stops inside. Returns (last node, tokens matched, their slots)."""
        node = self.root
        node.last = self.tick()
        i = 0
        slots: list[int] = []
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            child.last = self.tick()
            edge = child.key
            j = 0
            n = min(len(edge), len(key) - i)
            while j < n and edge[j] == key[i + j]:
                j += 1
            if j < len(edge):
                child = self.split(child, j)
            slots += child.slots
            i += j
            node = child
            if j < n or i == len(key):
                break
        return node, i, slots

    def split(self, child: Node, at: int) -> Node:
        """Cut ``child`` after ``at`` tokens; a new head (accessed now) takes the first part."""
        head = Node(child.key[:at], child.slots[:at], child.parent, self.tick())
        head.lock = child.lock
        child.parent.children[child.key[0]] = head
        head.children[child.key[at]] = child
        child.parent = head
        child.key = child.key[at:]
        child.slots = child.slots[at:]
        return head

    def match(self, key: list[int]) -> tuple[Node, int, list[int]]:
        if not key:
            return self.root, 0, []
        return self.walk(key)

    def insert(self, key: list[int], slots: list[int]) -> int:
        """Cache ``key`` with ``slots``; returns how many leading tokens were already cached."""
        if not key:
            return 0
        node, present, _ = self.walk(key)
        if present < len(key):
            node.children[key[present]] = Node(key[present:], slots[present:], node, self.tick())
        return present

    def lock_path(self, node: Node, delta: int) -> None:
        while node is not self.root:
            node.lock += delta
            assert node.lock >= 0
            node = node.parent

    def leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def evict(self, num_tokens: int) -> int:
        """Remove unlocked leaves, oldest access first, until ``num_tokens`` are freed."""
        heap = [(x.last, id(x), x) for x in self.leaves() if not x.lock]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.free.extend(leaf.slots)
            freed += len(leaf.key)
            if parent is not self.root and not parent.children and not parent.lock:
                heapq.heappush(heap, (parent.last, id(parent), parent))
        return freed

    def alloc(self, n: int) -> list[int]:
        if len(self.free) < n:  # only an unlimited pool gets here: mint fresh ids
            fresh = n - len(self.free)
            self.free.extend(range(self.minted + 1, self.minted + fresh + 1))
            self.minted += fresh
        out = self.free[len(self.free) - n :]
        del self.free[len(self.free) - n :]
        return out

    def check(self) -> None:
        """Every slot id is free or held by exactly one node."""
        held = [s for node in self.nodes() for s in node.slots]
        assert sorted(held + self.free) == list(range(1, self.minted + 1)), "slot lost or shared"
        assert all(node.lock == 0 for node in self.nodes()), "lock left behind"

    def nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            out.append(stack.pop())
            stack.extend(out[-1].children.values())
        return out


def replay_plain(requests, tree: PlainRadix) -> tuple[list[int], list[int]]:
    """The replay loop of docs/design.md §4 over the plain tree; returns (hits, evicted) per request."""
    hits, evicted = [], []
    for r in requests:
        prompt = r.prompt.tolist()
        seq = prompt + r.output.tolist()
        if tree.capacity is not None and len(seq) > tree.capacity:
            hits.append(0)
            evicted.append(0)
            continue
        node, hit, slots = tree.match(prompt)
        tree.lock_path(node, +1)
        need = len(seq) - hit
        ev = 0
        if tree.capacity is not None and len(tree.free) < need:
            ev = tree.evict(need - len(tree.free))
        slots = slots + tree.alloc(need)
        present = tree.insert(seq, slots)
        tree.free.extend(slots[hit:present])  # duplicates of cached KV
        tree.lock_path(node, -1)
        hits.append(hit)
        evicted.append(ev)
    return hits, evicted


# ------------------------------------------------------------------------- the bench
def parse_capacity(text: str) -> int | None:
    if text.lower() in ("0", "none", "null", "unlimited"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"--capacity must be an integer >= 0 or 'none', got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                    help="trace file (default: %(default)s)")
    ap.add_argument("--format", choices=("mooncake", "tokens"), default="mooncake")
    ap.add_argument("--capacity", type=parse_capacity, default=DEFAULT_CAPACITY,
                    help="cache size in tokens; 0 or 'none' for unlimited (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                    help="replay only the first N requests; 0 for all (default: %(default)s)")
    ap.add_argument("--skip-baseline", action="store_true",
                    help="do not run the per-token baseline")
    args = ap.parse_args(argv)
    if args.limit < 0:
        ap.error(f"--limit must be >= 0, got {args.limit}")

    if args.trace.is_file():
        loader = load_mooncake if args.format == "mooncake" else load_tokens
        requests = loader(args.trace)
        source = f"{args.trace} ({args.format})"
    else:
        requests = shared_prefix(num_groups=16, prompts_per_group=8)
        source = "generated shared_prefix(num_groups=16, prompts_per_group=8)"
        print(f"trace not found: {args.trace}; falling back to a generated workload")
    if args.limit:
        requests = requests[: args.limit]
    prompt_tokens = sum(len(r.prompt) for r in requests)
    cap = "unlimited" if args.capacity is None else f"{args.capacity:,} tokens"
    print(f"workload: {source}")
    print(f"requests: {len(requests):,}   prompt tokens: {prompt_tokens:,}   "
          f"output tokens: {sum(len(r.output) for r in requests):,}   capacity: {cap}")

    results = {}  # name -> (wall seconds, cached tokens, evicted tokens)
    for name, cache in (("radix", RadixCache(args.capacity)),
                        ("block_hash", BlockHashCache(args.capacity))):
        print(f"  replaying {name} ...", flush=True)
        gc.collect()
        t0 = time.perf_counter()
        records = replay(requests, cache)
        wall = time.perf_counter() - t0
        results[name] = (wall, sum(r.cached_tokens for r in records),
                         sum(r.evicted_tokens for r in records))
    if not args.skip_baseline:
        print("  replaying baseline (per-token Python radix) ...", flush=True)
        tree = PlainRadix(args.capacity)
        gc.collect()
        t0 = time.perf_counter()
        hits, evicted = replay_plain(requests, tree)
        wall = time.perf_counter() - t0
        tree.check()
        results["baseline"] = (wall, sum(hits), sum(evicted))

    print()
    print(f"{'cache':<12}{'requests/s':>14}{'prompt tok/s':>16}{'wall s':>10}{'hit rate':>10}")
    for name, (wall, cached, _) in results.items():
        print(f"{name:<12}{len(requests) / wall:>14,.1f}{prompt_tokens / wall:>16,.0f}"
              f"{wall:>10.3f}{cached / max(prompt_tokens, 1):>10.4f}")
    print()

    if "baseline" not in results:
        print("baseline skipped: no speed ratios")
        return 0
    base_wall = results["baseline"][0]
    for name in ("radix", "block_hash"):
        print(f"{name} / baseline: {base_wall / results[name][0]:.1f}x req/s")
    _, radix_cached, radix_evicted = results["radix"]
    _, base_cached, base_evicted = results["baseline"]
    if base_cached == radix_cached:
        print(f"OK: baseline cached tokens == radix cached tokens ({radix_cached:,}); "
              f"evicted tokens {base_evicted:,} vs radix {radix_evicted:,}")
        return 0
    print(f"MISMATCH: baseline cached tokens {base_cached:,} != "
          f"radix cached tokens {radix_cached:,}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
