"""What the order of a request's KV slots costs the CPU's in-place decode kernel.

The kernel (`testbed.engine.cpu_attention`) reads each key and value row where its slot lies.
The same decode attention (30 layers of SmolLM2-135M's shape: 3 KV heads of 64, 3 query rows
each, a pool of 16,352 slots per layer) over three placements of the same number of slots,
fastest of five, one thread:

- ``ascending``: each request's slots one run (a fresh pool, or one sorted as `KVSlotPool` keeps
  its freed pages since issue 46);
- ``interleaved``: the requests' slots alternate, as decode steps of page 1 hand them out (one
  slot per request per step);
- ``scattered``: slots drawn at random from the whole pool, as a free list handed out in freeing
  order becomes over a server's life.

    python -m experiments.benchmarks.slot_order [--shapes 4x1000 16x448] [--repeats 5]

Prints milliseconds per step's attention and each placement over ``ascending``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from testbed.engine.cpu_attention import load_kernel

SLOTS, KV_HEADS, ROWS, HEAD_DIM, LAYERS = 16352, 3, 3, 64, 30


def placements(batch: int, context: int, seed: int = 0) -> dict[str, torch.Tensor]:
    n = batch * context
    ascending = torch.arange(1, n + 1, dtype=torch.int32)
    interleaved = ascending.view(context, batch).t().contiguous().view(-1)
    scattered = np.random.default_rng(seed).permutation(np.arange(1, SLOTS + 1))[:n]
    return {"ascending": ascending, "interleaved": interleaved,
            "scattered": torch.from_numpy(scattered.astype(np.int32))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.benchmarks.slot_order",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4x1000", "16x448"],
                    help="BATCHxCONTEXT, each request's cached tokens")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kernel, error = load_kernel()
    if kernel is None:
        raise SystemExit(f"error: the decode kernel did not load: {error}")
    k_bufs = [torch.randn(SLOTS + 1, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    v_bufs = [torch.randn(SLOTS + 1, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    for shape in args.shapes:
        batch, context = map(int, shape.split("x"))
        if batch * context > SLOTS:
            raise SystemExit(f"error: --shapes {shape}: more than the pool's {SLOTS} slots")
        q = torch.randn(batch, KV_HEADS, ROWS, HEAD_DIM)
        indptr = torch.arange(0, (batch + 1) * context, context, dtype=torch.int64)
        best: dict[str, float] = {}
        for _ in range(args.repeats):  # interleaved, so drift touches every placement alike
            for name, slots in placements(batch, context).items():
                start = time.perf_counter()
                for k_buf, v_buf in zip(k_bufs, v_bufs):
                    kernel(q, k_buf, v_buf, indptr, slots, HEAD_DIM ** -0.5)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
        base = best["ascending"]
        print(f"{batch} x {context}: " + ", ".join(
            f"{name} {1e3 * s:.2f} ms ({s / base:.2f}x)" for name, s in best.items()))


if __name__ == "__main__":
    main()
