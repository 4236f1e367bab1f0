"""The whole Mooncake conversation trace at 3M tokens, pages 1 and 16, through our replay and
through SGLang 0.5.23's RadixCache fed replay.py's own calls (`tree_serving.serve` with none of
its rules): both hit rates and the requests that agree (the figures of
docs/results/sglang_fidelity.md; about 2 minutes).

    python -m experiments.validation.sglang.whole_trace
"""

from __future__ import annotations

import sys

from experiments import MOONCAKE_TRACE, entry
from experiments.validation.sglang import wheel
from experiments.validation.sglang.tree_serving import serve
from testbed.cache.radix import RadixCache
from testbed.backends.replay import replay
from testbed.workloads.traces import load_mooncake

RELEASE = "0.5.23"  # the release whose checkpoint insert the figures are about
PAGE_SIZES = (1, 16)
CAPACITY = 3_000_000


def whole_trace(sgl, page_size: int, capacity: int) -> tuple[float, float, int, int]:
    """The whole trace through our replay and through SGLang's tree fed replay.py's calls: both
    hit rates, requests agreeing (hit and evicted tokens), requests."""
    requests = load_mooncake(MOONCAKE_TRACE)
    prompt = sum(len(r.prompt) for r in requests)
    records = replay(requests, RadixCache(capacity, page_size=page_size, sglang=sgl.version))
    ours = [(r.cached_tokens, r.evicted_tokens) for r in records]
    hits, evicted, _, _ = serve(sgl, requests, page_size, capacity, rules=())
    same = sum(o == t for o, t in zip(ours, zip(hits, evicted)))
    return sum(h for h, _ in ours) / prompt, sum(hits) / prompt, same, len(requests)


def main() -> int:
    if not MOONCAKE_TRACE.exists():
        sys.exit(f"no Mooncake conversation trace at {MOONCAKE_TRACE} (python -m testbed.data "
                 "fetch mooncake_conversation puts it there)")
    sgl = wheel.load(wheel.fetch(wheel.wheel_dir(RELEASE), RELEASE), RELEASE)
    for page in PAGE_SIZES:
        ours, theirs, same, total = whole_trace(sgl, page, CAPACITY)
        print(f"Mooncake conversation, 3M tokens, page {page}: hit rate ours {ours:.6f}, "
              f"SGLang {RELEASE} {theirs:.6f}; {same}/{total} requests agree")
    return 0


if __name__ == "__main__":
    entry(main)
