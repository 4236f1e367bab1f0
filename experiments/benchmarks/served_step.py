"""The served decode step beside the offline one: closed loops of B streams on ``testbed.serve``,
timed by the server itself (``GET /debug/steps``, `testbed.api.step_log`).

`closed_loop` runs B clients (the project's `OpenAIClient`, as ``backend=server`` calls), each
sending one streamed completion after another: a prompt of random token ids (no two requests
share a prefix, as the offline profile's synthetic requests share none), ``tokens`` forced output
tokens. `served_decode` reads the steps the server ran meanwhile and keeps the decode steps of
exactly B requests that follow one (the steady state, no admission between them), and says what
one took:

- ``step``: the loop's period, its turn (forming, the forward, applying, handing the tokens on)
  plus the wait before it (``turn_s + idle_s``): what a client sees between two tokens;
- ``engine_cpu``: the CPU time the loop thread got in its turn (the engine's work);
- ``waited``: the turn's wall time less that: the loop thread waiting, for a core (``runqueue``,
  the kernel's run delay: other processes held both cores) or asleep (the rest: the
  interpreter's lock, held by the HTTP side);
- ``handing``: handing the step's tokens to the HTTP side;
- ``http_cpu``: the rest of the server process's CPU time in the turn: the event loop's work
  (SSE, JSON, detokenizing), on the other core or taking the lock from the loop thread;

and, over the whole loop, the cores the client (this process) and every other process on the
machine kept busy (/proc/stat): on a shared machine a loop thread that waits while others' jobs
hold both cores is the machine's load, not the server's cost.

Used by ``decode_profile --served`` (docs/results/vs_vllm_serving.md, "Where the time goes").
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, replace

import numpy as np

from testbed.remote.openai_client import OpenAIClient, completion_body
from testbed.remote.settings import ServerSettings

FIRST_ID = 1000  # prompts draw ids above the special tokens


async def _stream_loop(client: OpenAIClient, model: str, rng: np.random.Generator, prompt: int,
                       tokens: int, calls: int, vocab: int) -> int:
    failed = 0
    for _ in range(calls):
        ids = rng.integers(FIRST_ID, vocab, prompt).tolist()
        done = await client.complete(completion_body(model, ids, tokens, True, 0.0, 1.0))
        failed += done.failed
    return failed


async def _closed_loop(url: str, streams: int, prompt: int, tokens: int, calls: int,
                       vocab: int, seed: int) -> int:
    async with OpenAIClient(ServerSettings(url)) as client:
        model = await client.first_model()
        rngs = [np.random.default_rng([seed, i]) for i in range(streams)]
        failed = await asyncio.gather(*(_stream_loop(client, model, r, prompt, tokens, calls,
                                                     vocab) for r in rngs))
    return sum(failed)


def closed_loop(url: str, streams: int, prompt: int, tokens: int, calls: int, vocab: int,
                seed: int = 0) -> None:
    """``streams`` clients, ``calls`` completions each, one after another (raises when any
    failed)."""
    failed = asyncio.run(_closed_loop(url, streams, prompt, tokens, calls, vocab, seed))
    if failed:
        raise RuntimeError(f"{failed} completions failed on {url}")


@dataclass(frozen=True)
class ServedDecode:
    """Medians over a run's steady decode steps at one batch (seconds; ``steps``: how many), and
    the machine's load while the loop ran (cores busy on average: ``None`` off Linux)."""

    batch: int
    steps: int
    step_s: float  # the loop's period: turn + idle
    engine_cpu_s: float  # the loop thread's CPU time in the turn
    waited_s: float  # the turn's wall time less that: waiting for the lock or a core
    runqueue_s: float | None  # of which waiting for a core (the machine's load)
    handing_s: float
    http_cpu_s: float  # the server process's other threads, in the turn
    client_cores: float = 0.0  # this process (the client) over the loop
    others_cores: float | None = None  # every other process on the machine


def steady_decodes(records: list[dict], batch: int) -> list[dict]:
    """The decode steps of ``batch`` requests whose step before was one too."""
    return [s for before, s in zip(records, records[1:])
            if s["kind"] == before["kind"] == "decode"
            and s["requests"] == before["requests"] == batch]


def served_decode(records: list[dict], batch: int) -> ServedDecode:
    steady = steady_decodes(records, batch)
    if not steady:
        raise RuntimeError(f"no steady decode step at batch {batch} among {len(records)} steps")

    def median(key) -> float:
        return float(np.median([key(s) for s in steady]))

    return ServedDecode(
        batch=batch, steps=len(steady), step_s=median(lambda s: s["turn_s"] + s["idle_s"]),
        engine_cpu_s=median(lambda s: s["thread_cpu_s"]),
        waited_s=median(lambda s: s["turn_s"] - s["thread_cpu_s"]),
        runqueue_s=None if any(s.get("runqueue_s") is None for s in steady)
        else median(lambda s: s["runqueue_s"]),
        handing_s=median(lambda s: s["handing_s"]),
        http_cpu_s=median(lambda s: s["process_cpu_s"] - s["thread_cpu_s"]))


def machine_busy_s() -> float | None:
    """CPU seconds every core of the machine has been busy since boot (/proc/stat), or None."""
    try:
        fields = open("/proc/stat").readline().split()[1:]
    except OSError:
        return None
    ticks = [int(f) for f in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle, iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def measure(url: str, streams: int, prompt: int, tokens: int, calls: int, vocab: int,
            seed: int = 0) -> ServedDecode:
    """A closed loop of ``streams`` on the server at ``url``: its steady decode steps, and who
    else kept the machine's cores busy meanwhile."""
    import httpx

    first = httpx.get(url + "/debug/steps", params={"since": 10**12}).json()["recorded"]
    wall, client, machine = time.perf_counter(), time.process_time(), machine_busy_s()
    closed_loop(url, streams, prompt, tokens, calls, vocab, seed)
    wall, client = time.perf_counter() - wall, time.process_time() - client
    machine = None if machine is None else machine_busy_s() - machine
    records = httpx.get(url + "/debug/steps", params={"since": first}).json()["steps"]
    server = sum(s["process_cpu_s"] for s in records)  # its turns (the HTTP side's idle work
    #                                                     between them is small and not counted)
    others = None if machine is None else max(machine - server - client, 0.0) / wall
    return replace(served_decode(records, streams), client_cores=client / wall,
                   others_cores=others)


def steps_recorded(url: str) -> int | None:
    """How many steps the server at ``url`` has logged so far; None when it keeps no log (not
    ``testbed.serve``: vLLM)."""
    import httpx

    r = httpx.get(url + "/debug/steps", params={"since": 10**12})
    return r.json()["recorded"] if r.status_code == 200 else None


def steps_since(url: str, first: int) -> list[dict]:
    import httpx

    return httpx.get(url + "/debug/steps", params={"since": first}).json()["steps"]


def near(batch: int) -> tuple[int, int]:
    """The batch sizes counted as "about ``batch``" in a workload's step profile."""
    spread = max(1, batch // 4)
    return batch - spread, batch + spread


def own_decode_ms(records: list[dict], batch: int) -> float | None:
    """The median period (turn + idle, ms) of the server's own decode steps of about ``batch``
    requests; None when it ran none."""
    low, high = near(batch)
    times = [s["turn_s"] + s["idle_s"] for s in records
             if s["kind"] == "decode" and low <= s["requests"] <= high]
    return 1e3 * float(np.median(times)) if times else None
