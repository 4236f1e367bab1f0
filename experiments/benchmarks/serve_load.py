"""Reliability of `python -m testbed.serve` under load (issue 30, point 4).

Starts the server (the tiny random Llama with a 512-token KV pool by default, so eviction, chunking
and retraction happen) on a free loopback port, then ``--clients`` concurrent clients send
``--requests`` requests in all, streamed: prompts drawn over a few shared prefixes, a share
(``--disconnect``) going away, half of them closing the stream after one to three chunks and half
sent without streaming and closed as soon as the server reads the body (``Expect:
100-continue``: the server's handler is running then), a share (``--malformed``) each of a
malformed kind in turn (bad JSON, JSON nested too deeply, max_tokens 0, past the context, an id
outside the vocabulary, an id of 2**64, a batch of prompts, a wrong type). A poller asks
``/health`` every 0.2 s throughout. At the end, once the server has nothing left to do (no
request live, no HTTP request in progress but the one asking), it checks:

- every well-formed request answered exactly once (one last chunk with a ``finish_reason``, one
  ``[DONE]``, its ``token_ids`` adding up to ``usage.completion_tokens``), every response id
  distinct, none lost: the server's ``submitted`` = ``finished`` + ``aborted``, nothing live;
- every malformed request answered 4xx with an OpenAI error body;
- the server answered no 5xx, nor left any request unanswered, and answered 499 to every
  non-streaming client that went away (its own counts, ``http_answered``: those clients cannot
  see their answer);
- ``/health`` never failed;
- ``/debug/state`` (read between steps in the engine's loop): the cache's invariants hold, no
  lease and no locked token left.

    python -m experiments.benchmarks.serve_load [--clients 16] [--requests 400] \\
        [--disconnect 0.1] [--malformed 0.1] [--seed 0] [--in-process] [OVERRIDES...]

It prints a table of requests, completed, disconnects, malformed (4xx), health checks, latency
percentiles and locks at the end, and exits 1 when a check fails. docs/results/serve.md has the
figures of a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from testbed.api.server import ServerHandle, one_cpu_thread, start_server

# a KV pool small enough to evict, prompts chunked, and reservations of one future token so that
# the scheduler admits optimistically and retracts under pressure: aborts meet every state
DEFAULT_OVERRIDES = ["model=tiny", "engine.device=cpu", "cache.capacity_tokens=512",
                     "scheduler.chunked_prefill_size=64", "scheduler.clip_max_new_tokens=1",
                     "serve.max_queue=512"]
VOCAB = 256  # the tiny model's
MALFORMED = {  # kind -> the raw body sent
    "bad_json": '{"prompt": [1, 2, 3], "max_tokens": ',
    "nested_too_deeply": "[" * 100_000 + "]" * 100_000,
    "max_tokens_negative": json.dumps({"prompt": [1, 2, 3], "max_tokens": -1}),
    "past_context": json.dumps({"prompt": [1] * 64, "max_tokens": 5000}),
    "outside_vocabulary": json.dumps({"prompt": [1, VOCAB + 7, 3], "max_tokens": 4}),
    "id_of_2_64": json.dumps({"prompt": [1, 2**64, 3], "max_tokens": 4}),
    "batch_of_prompts": json.dumps({"prompt": [[1, 2], [3, 4]], "max_tokens": 4}),
    "wrong_type": json.dumps({"prompt": [1, 2], "max_tokens": "four"}),
}


@dataclass
class Outcome:
    kind: str  # ok | disconnect (mid-stream) | gone (not streaming) | malformed
    status: int | None = None
    ids: set = field(default_factory=set)  # response ids seen
    finals: int = 0  # chunks with a finish_reason
    done: int = 0  # [DONE] lines
    tokens: int = 0
    usage_tokens: int | None = None
    cached: int = 0
    prompt: int = 0
    latency_s: float | None = None
    ttft_s: float | None = None
    error: str | None = None


def plan(n: int, disconnect: float, malformed: float, seed: int) -> list[dict]:
    """Each request's kind and body, in the order the clients take them: ``round(n ×
    malformed)`` malformed ones (each kind in turn), ``round(n × disconnect)`` that disconnect
    (half mid-stream, rounded up; half not streaming), the rest well-formed, in a shuffled
    order."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, VOCAB, 32).tolist() for _ in range(4)]
    bad_kinds = list(MALFORMED)
    n_bad, n_left = round(n * malformed), round(n * disconnect)
    kinds = ["malformed"] * n_bad + ["disconnect"] * ((n_left + 1) // 2) + \
        ["gone"] * (n_left // 2) + ["ok"] * (n - n_bad - n_left)
    rng.shuffle(kinds)
    out, bad = [], 0
    for kind in kinds:
        prompt = (prefixes[rng.integers(4)] if rng.random() < 0.7 else []) + \
            rng.integers(0, VOCAB, int(rng.integers(4, 25))).tolist()
        if kind == "malformed":
            out.append({"kind": kind, "raw": MALFORMED[bad_kinds[bad % len(bad_kinds)]]})
            bad += 1
        elif kind in ("disconnect", "gone"):  # long enough to be cut off
            out.append({"kind": kind, "body": {"prompt": prompt, "max_tokens": 400,
                                               "ignore_eos": True},
                        "chunks": int(rng.integers(1, 4))})
        else:
            out.append({"kind": kind, "body": {"prompt": prompt,
                                               "max_tokens": int(rng.integers(4, 33))}})
    return out


async def one(client: httpx.AsyncClient, url: str, item: dict) -> Outcome:
    out = Outcome(item["kind"])
    start = time.perf_counter()
    if item["kind"] == "malformed":
        r = await client.post(url, content=item["raw"], headers={"content-type": "application/json"})
        out.status = r.status_code
        if "error" not in r.json():
            out.error = "no OpenAI error body"
        return out
    body = {**item["body"], "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error = (await r.aread()).decode()[:200]
            return out
        seen = 0
        async for line in r.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                out.done += 1
                continue
            chunk = json.loads(line.removeprefix("data: "))
            out.ids.add(chunk["id"])
            for c in chunk["choices"]:
                out.tokens += len(c.get("token_ids", []))
                if out.ttft_s is None and c.get("token_ids"):
                    out.ttft_s = time.perf_counter() - start
                out.finals += c["finish_reason"] is not None
            if chunk.get("usage"):
                u = chunk["usage"]
                out.usage_tokens = u["completion_tokens"]
                out.cached, out.prompt = u["prompt_tokens_details"]["cached_tokens"], \
                    u["prompt_tokens"]
            seen += 1
            if item["kind"] == "disconnect" and seen >= item["chunks"]:
                break  # leaving the block closes the connection mid-stream
    out.latency_s = time.perf_counter() - start
    return out


async def gone(url: str, item: dict) -> Outcome:
    """A non-streaming request whose client goes away while the server handles it: sent with
    ``Expect: 100-continue``, so the server's ``100 Continue`` says its handler is reading the
    body; the body is sent and the connection closed at once. Its status is that ``100``."""
    out = Outcome("gone")
    target = httpx.URL(url)
    body = json.dumps(item["body"]).encode()
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(f"POST {target.raw_path.decode()} HTTP/1.1\r\nHost: {target.host}\r\n"
                     "Content-Type: application/json\r\nExpect: 100-continue\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode())
        await writer.drain()
        out.status = int((await reader.readline()).split()[1])
        writer.write(body)
        await writer.drain()
    finally:
        writer.close()
        await writer.wait_closed()
    return out


async def health_poller(url: str, stop: asyncio.Event, counts: dict) -> None:
    async with httpx.AsyncClient(timeout=5.0) as client:
        while not stop.is_set():
            try:
                ok = (await client.get(url + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            counts["ok" if ok else "failed"] += 1
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except asyncio.TimeoutError:
                pass


async def drive(url: str, items: list[dict], clients: int) -> tuple[list[Outcome], dict]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    results: list[Outcome] = []
    health = {"ok": 0, "failed": 0}
    stop = asyncio.Event()
    poller = asyncio.ensure_future(health_poller(url, stop, health))

    async def worker() -> None:
        async with httpx.AsyncClient(timeout=120.0) as client:
            while not queue.empty():
                item = queue.get_nowait()
                try:
                    send = gone(url + "/v1/completions", item) if item["kind"] == "gone" \
                        else one(client, url + "/v1/completions", item)
                    results.append(await send)
                except Exception as e:  # noqa: BLE001 - a transport failure counts against it
                    results.append(Outcome(item["kind"], error=f"{type(e).__name__}: {e}"))

    await asyncio.gather(*(worker() for _ in range(clients)))
    stop.set()
    await poller
    return results, health


def settled_state(url: str, timeout_s: float = 60.0) -> dict:
    """``/debug/state`` once nothing is live, the scheduler has no work and the server handles
    no HTTP request but this one (polled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = httpx.get(url + "/debug/state", timeout=30).json()
        if (state["live"] == 0 and not state["has_work"] and state["http_in_progress"] == 1) \
                or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(items: list[dict], results: list[Outcome], health: dict, state: dict) -> dict:
    ok = [r for r in results if r.kind == "ok"]
    disc = [r for r in results if r.kind == "disconnect"]
    left = [r for r in results if r.kind == "gone"]
    bad = [r for r in results if r.kind == "malformed"]
    answered = {int(k): v for k, v in state["http_answered"].items()}
    complete = [r for r in ok if r.status == 200 and r.finals == 1 and r.done == 1
                and len(r.ids) == 1 and r.usage_tokens == r.tokens and not r.error]
    ids = [i for r in ok + disc for i in r.ids]
    latencies = [r.latency_s for r in complete]
    ttfts = [r.ttft_s for r in complete if r.ttft_s is not None]
    return {
        "requests": len(items), "answered": len(results),
        "completed": len(complete), "well_formed": len(ok),
        "disconnects": len(disc), "gone": len(left),
        "gone_read": sum(r.status == 100 and not r.error for r in left),
        "aborted_by_server": state["aborted"],
        "malformed": len(bad), "malformed_4xx": sum(400 <= (r.status or 0) < 500
                                                    and not r.error for r in bad),
        "answered_499": answered.get(499, 0),
        "answered_5xx": sum(v for k, v in answered.items() if k >= 500),
        "unanswered": answered.get(0, 0),
        "health_ok": health["ok"], "health_failed": health["failed"],
        "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "duplicated_ids": len(ids) - len(set(ids)),
        "lost": state["submitted"] - state["finished"] - state["aborted"] + state["live"],
        "submitted": state["submitted"], "finished": state["finished"],
        "cached_tokens": sum(r.cached for r in complete),
        "prompt_tokens": sum(r.prompt for r in complete),
        "leases_at_end": state["leases"], "locked_tokens_at_end": state["protected_tokens"],
        "invariants": state["invariants"], "steps": state["steps"],
        "preemptions": state["preemptions"],
    }


def failures(s: dict) -> list[str]:
    """The acceptance checks that fail (none: the run passes)."""
    checks = {
        "every request answered": s["answered"] == s["requests"],
        "every well-formed request completed exactly once": s["completed"] == s["well_formed"],
        "every malformed request got a 4xx": s["malformed_4xx"] == s["malformed"],
        "no request lost": s["lost"] == 0,
        "no response duplicated": s["duplicated_ids"] == 0,
        "the server took the well-formed requests and at most those of the clients that left":
            s["well_formed"] + s["disconnects"] <= s["submitted"]
            <= s["well_formed"] + s["disconnects"] + s["gone"],
        "every non-streaming client that left was read, then answered 499":
            s["gone_read"] == s["gone"] == s["answered_499"],
        "the server answered no 5xx and left no request unanswered":
            s["answered_5xx"] == s["unanswered"] == 0,
        "health never failed": s["health_failed"] == 0 and s["health_ok"] > 0,
        "no lease or lock left": s["leases_at_end"] == 0 and s["locked_tokens_at_end"] == 0,
        "the cache's invariants hold": s["invariants"] == "ok",
    }
    return [name for name, passed in checks.items() if not passed]


def table(s: dict, wall_s: float) -> str:
    def ms(v):
        return "-" if v is None else f"{1000 * v:.0f} ms"
    rows = [("requests", s["requests"]),
            ("completed (well-formed, answered once)", f"{s['completed']} / {s['well_formed']}"),
            ("disconnects mid-stream / not streaming (aborted by the server)",
             f"{s['disconnects']} / {s['gone']} ({s['aborted_by_server']})"),
            ("answered 499 / 5xx / none (the server's counts)",
             f"{s['answered_499']} / {s['answered_5xx']} / {s['unanswered']}"),
            ("malformed (answered 4xx)", f"{s['malformed']} ({s['malformed_4xx']})"),
            ("lost / duplicated", f"{s['lost']} / {s['duplicated_ids']}"),
            ("health checks ok / failed", f"{s['health_ok']} / {s['health_failed']}"),
            ("latency p50 / p99", f"{ms(s['latency_p50_s'])} / {ms(s['latency_p99_s'])}"),
            ("TTFT p50 / p99", f"{ms(s['ttft_p50_s'])} / {ms(s['ttft_p99_s'])}"),
            ("cached / prompt tokens (completed)", f"{s['cached_tokens']} / {s['prompt_tokens']}"),
            ("engine steps (retractions)", f"{s['steps']} ({s['preemptions']})"),
            ("leases / locked tokens at the end",
             f"{s['leases_at_end']} / {s['locked_tokens_at_end']}"),
            ("cache invariants at the end", s["invariants"]),
            ("wall time", f"{wall_s:.1f} s")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:<{width}} | {v} |" for k, v in rows)


def run(clients: int, requests: int, disconnect: float, malformed: float, seed: int = 0,
        overrides: list[str] | None = None, in_process: bool = False,
        server: ServerHandle | None = None) -> tuple[dict, float]:
    """One load test; returns its summary and wall time. ``server``: use this one (else start
    ``testbed.serve`` with ``DEFAULT_OVERRIDES`` + ``overrides`` and stop it after)."""
    items = plan(requests, disconnect, malformed, seed)
    own = server is None
    if own and in_process:  # as python -m testbed.serve runs on a CPU
        one_cpu_thread()
    if own:
        server = start_server([*DEFAULT_OVERRIDES, *(overrides or [])], in_process=in_process)
    try:
        start = time.perf_counter()
        results, health = asyncio.run(drive(server.url, items, clients))
        wall = time.perf_counter() - start
        state = settled_state(server.url)
    finally:
        if own:
            server.stop()
    return summarize(items, results, health, state), wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--disconnect", type=float, default=0.1,
                   help="share going away (half mid-stream, half not streaming)")
    p.add_argument("--malformed", type=float, default=0.1, help="share of malformed requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in-process", action="store_true",
                   help="run the server in this process (a thread) instead of python -m "
                        "testbed.serve")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for the server, after "
                   + " ".join(DEFAULT_OVERRIDES))
    a = p.parse_args(argv)
    summary, wall = run(a.clients, a.requests, a.disconnect, a.malformed, a.seed, a.overrides,
                        a.in_process)
    print(table(summary, wall))
    failed = failures(summary)
    for name in failed:
        print(f"FAILED: {name}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    from experiments import entry
    entry(main)
