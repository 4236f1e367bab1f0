"""Describe a workload: sizes, sharing (the ideal hit rate) and the shape of its radix tree.

``python -m testbed.workloads [overrides]`` prints the table for the composed workload (the same
``workload``/``arrival``/``seed`` config as ``testbed.run``); ``save=FILE`` also writes the workload
as a token trace that ``workload=trace workload.format=tokens`` replays.
"""

from __future__ import annotations

from typing import Any

from testbed.cache.radix import RadixCache
from testbed.backends.replay import replay
from testbed.workloads.request import Request


def describe(requests: list[Request]) -> dict[str, Any]:
    """Figures of a workload in arrival order. The ideal hit rate is docs/design.md §3's: an unlimited
    radix cache replaying it reaches exactly that, so one replay gives the tree too."""
    tree = RadixCache(capacity=None)
    records = replay(requests, tree)
    prompt = sum(r.prompt_tokens for r in records)
    depth, stack = 0, [(node, 1) for node in tree.root.children.values()]
    while stack:
        node, d = stack.pop()
        depth = max(depth, d)
        stack += [(child, d + 1) for child in node.children.values()]
    return {
        "programs": len({r.program if r.program is not None else r.id for r in requests}),
        "requests": len(requests),
        "prompt_tokens": prompt,
        "output_tokens": sum(r.output_tokens for r in records),
        "ideal_hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
        "unique_tokens": tree.total_size,
        "tree_nodes": tree.num_nodes - 1,
        "tree_depth": depth,
        "max_sequence_tokens": max((len(r.prompt) + len(r.output) for r in requests), default=0),
        "last_arrival_s": max((r.arrival_s for r in requests), default=0.0),
    }


def format_table(figures: dict[str, Any]) -> str:
    width = max(map(len, figures))
    rows = []
    for key, value in figures.items():
        text = f"{value:.6f}" if isinstance(value, float) else f"{value:,}"
        rows.append(f"  {key:<{width}}  {text}")
    return "\n".join(rows)
