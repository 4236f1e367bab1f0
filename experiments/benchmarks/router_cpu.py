"""The live router's own CPU per streamed chunk, beside SGLang's gateway ``smg`` on the same calls.

Two stub replicas (this module's ``--stub PORT``: an OpenAI-compatible answer of ``--chunks``
one-token chunks, 2 ms apart, no model) stand behind each front end in turn: ``testbed.route``
with a policy, or ``smg`` (`experiments.studies.routing_fronts`, which installs it into its own
environment once). ``--calls`` streamed text completions, ``--concurrency`` at once, go through
the front; the CPU seconds its processes used meanwhile (``/proc``, user and system) are the
figure, per chunk streamed. Only the front ends differ, so their ratio is the routers' cost
side by side; the fronts alternate over ``--rounds`` and the fastest round of each counts. On a
machine of two cores or more the stubs and this driver keep to the last core, so the front has
one to itself.

    python -m experiments.benchmarks.router_cpu [--calls 600] [--chunks 32] [--concurrency 6] \\
        [--rounds 3] [--fronts cache_aware smg_cache_aware]

docs/results/routing_live.md quotes a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

from experiments.studies.routing_fronts import MODEL, REPO, front_end, wait_answering

GAP_S = 0.002  # between a stub's chunks: a fast replica's decode steps


# ------------------------------------------------------------------------- the stub replica
def stub_app(chunks: int):
    """A replica that lists ``MODEL`` and answers every completion with ``chunks`` chunks."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def health(_):
        return JSONResponse({})

    async def models(_):
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(request):
        await request.json()

        async def stream():
            for i in range(chunks):
                last = i == chunks - 1
                choice = {"index": 0, "text": " a", "token_ids": [100 + i],
                          "finish_reason": "length" if last else None}
                yield f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n"
                await asyncio.sleep(GAP_S)
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/completions", completions, methods=["POST"])])


@contextlib.contextmanager
def stubs(n: int, chunks: int, core: set[int] | None) -> Iterator[list[str]]:
    """``n`` stub replicas as processes of their own, answering: their URLs."""
    from testbed.api.server import free_port

    ports = [free_port() for _ in range(n)]
    procs = [subprocess.Popen([sys.executable, "-m", "experiments.benchmarks.router_cpu",
                               "--stub", str(p), "--chunks", str(chunks)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for proc in procs:
            if core:
                os.sched_setaffinity(proc.pid, core)
        for url, proc in zip(urls, procs):
            wait_answering(url, proc, "a stub replica", timeout_s=60)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


# ------------------------------------------------------------------------- the calls
async def drive(url: str, calls: int, concurrency: int, chunks: int) -> None:
    """``calls`` streamed completions through ``url``, ``concurrency`` at once; each must bring
    ``chunks`` chunks and ``[DONE]``."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        slots = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            body = {"model": MODEL, "prompt": f"call {i}: the same question again",
                    "max_tokens": chunks, "stream": True}
            async with slots, client.stream("POST", url + "/v1/completions", json=body) as r:
                got = [line async for line in r.aiter_lines() if line.startswith("data:")]
            if r.status_code != 200 or len(got) != chunks + 1:
                raise RuntimeError(f"call {i}: HTTP {r.status_code}, {len(got)} lines")

        await asyncio.gather(*(one(i) for i in range(calls)))


def measure(front: str, urls: list[str], args, cores: tuple[set[int], set[int]] | None,
            cache: Path, log: Path) -> dict:
    """One round of one front: CPU seconds of its processes over the calls (after a warm-up).
    ``cores``: the front's and the driver's (the front inherits this process's at its start)."""
    with contextlib.ExitStack() as stack:
        if cores:
            os.sched_setaffinity(0, cores[0])
        url, cpu_s = stack.enter_context(front_end(front, urls, cache, log))
        if cores:
            os.sched_setaffinity(0, cores[1])
        asyncio.run(drive(url, args.concurrency, args.concurrency, args.chunks))  # warm-up
        before, t0 = cpu_s(), time.perf_counter()
        asyncio.run(drive(url, args.calls, args.concurrency, args.chunks))
        wall, used = time.perf_counter() - t0, cpu_s() - before
    return {"front": front, "cpu_s": used, "wall_s": wall,
            "us_per_chunk": used / (args.calls * args.chunks) * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.benchmarks.router_cpu",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=600)
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fronts", nargs="+", default=["cache_aware", "smg_cache_aware"])
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "radix-testbed")
    p.add_argument("--stub", type=int, help=argparse.SUPPRESS)  # run one stub on this port
    args = p.parse_args(argv)
    if args.stub is not None:
        import uvicorn
        uvicorn.run(stub_app(args.chunks), host="127.0.0.1", port=args.stub, log_level="error")
        return 0
    if min(args.calls, args.chunks, args.concurrency, args.rounds) < 1:
        p.error("--calls, --chunks, --concurrency and --rounds must be at least 1")
    every = sorted(os.sched_getaffinity(0))
    cores = (set(every[:-1]), {every[-1]}) if len(every) > 1 else None
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, stubs(2, args.chunks, cores and cores[1]) as urls:
        for r in range(args.rounds):
            for front in args.fronts:
                row = measure(front, urls, args, cores, args.cache_dir, Path(tmp) / f"{front}.log")
                print(f"round {r + 1} {front:<18} {row['cpu_s']:6.2f} CPU s  "
                      f"{row['us_per_chunk']:6.1f} us/chunk  ({row['wall_s']:.1f} s)", flush=True)
                if front not in best or row["cpu_s"] < best[front]["cpu_s"]:
                    best[front] = row
    print(f"\n== the front's CPU per streamed chunk, fastest of {args.rounds} "
          f"({args.calls} calls x {args.chunks} chunks, {args.concurrency} at once)")
    smg = next((best[f] for f in best if f.startswith("smg_")), None)
    for front, row in best.items():
        ratio = f"  {row['cpu_s'] / smg['cpu_s']:.2f}x smg's" if smg else ""
        print(f"{front:<18} {row['us_per_chunk']:7.1f} us/chunk{ratio}")
    return 0


if __name__ == "__main__":
    from experiments import entry
    entry(main)
