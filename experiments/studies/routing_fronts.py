"""The routing study's processes (`experiments.studies.routing_live`): the replicas
(``testbed.serve`` or vLLM's CPU server) and each front end in front of them (``python -m
testbed.route`` or SGLang's gateway ``smg``, installed into its own virtual environment), and
what the study reads from the replicas (their ``/metrics`` counters) and does to them (empty
their caches)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx

from experiments import REPO
from experiments.validation.vllm import live as vllm_live
from testbed.errors import BadInput

SMG_VERSION = "1.13.0"
MODEL = "smollm2_135m"
CAPACITY = 6144  # tokens of KV per replica: less than the workloads' distinct prefixes
# smg 1.13.0's cache_aware defaults (smg/router_args.py: threshold 0.3, imbalance 64 requests and
# 1.5x, pruning every 120 s) are the router group's, and smg inserts a prompt only when it routes
# it (no answer teaches its tree): the simulator runs smg's twin so
SMG_CACHE_AWARE = ["router=cache_aware", "router.update_on_complete=false"]
# our cache_aware at sglang-router 0.1's thresholds (the group's defaults until 2026-12-07)
SGLANG_ROUTER_0_1 = ["router=cache_aware", "router.cache_threshold=0.5",
                     "router.balance_abs_threshold=32", "router.balance_rel_threshold=1.0001",
                     "router.eviction_interval_s=60"]
FRONT_ROUTERS = {"cache_aware_router_0_1": SGLANG_ROUTER_0_1,
                 # our cache_aware at smg's rule: a prompt inserted when routed, never an answer
                 "cache_aware_at_routing": SMG_CACHE_AWARE,
                 # our cache_aware sending a miss to the smallest tree (SGLang's router's choice)
                 # rather than the least loaded replica (smg's)
                 "cache_aware_smallest_tree": ["router=cache_aware",
                                               "router.fallback=smallest_tree"],
                 # our cache_aware and kv_events breaking a tie of loads towards the replica
                 # sent the fewest requests, not the lowest index (routing_live.md: a chat run's
                 # tenant 1 meets such a tie)
                 "cache_aware_fewest_sent": ["router=cache_aware", "router.tie_break=fewest_sent"],
                 "kv_events_fewest_sent": ["router=kv_events", "router.tie_break=fewest_sent"],
                 "smg_cache_aware": SMG_CACHE_AWARE}  # smg's: the simulator's twin
VLLM_BLOCK = 32  # vLLM 0.32's CPU attention takes blocks in multiples of 32


def smg_binary(cache: Path) -> Path:
    """smg's launcher in its own virtual environment under ``cache``, installed once."""
    venv = cache / "venvs" / f"smg-{SMG_VERSION}"
    smg = venv / "bin" / "smg"
    if smg.exists():
        return smg
    venv.parent.mkdir(parents=True, exist_ok=True)
    print(f"installing smg=={SMG_VERSION} into {venv} (once)", file=sys.stderr)
    for cmd in ([sys.executable, "-m", "venv", str(venv)],
                [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                 f"smg=={SMG_VERSION}"]):
        subprocess.run(cmd, check=True)
    return smg


def front_command(front: str, urls: list[str], port: int, cache: Path) -> list[str]:
    if front.startswith("smg_"):
        return [str(smg_binary(cache)), "launch", "--worker-urls", *urls, "--policy",
                front.removeprefix("smg_"), "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warn"]
    return [sys.executable, "-m", "testbed.route", *router_of(front), f"model={MODEL}",
            f"route.urls=[{','.join(urls)}]", f"route.port={port}"]


def router_of(front: str) -> list[str]:
    """The ``router`` overrides of a front end (its simulator twin's, for smg's)."""
    return FRONT_ROUTERS.get(front, [f"router={front}"])


def session_cpu_s(session: int) -> float:
    """CPU seconds (user and system) the live processes of a session have used (Linux's
    /proc/PID/stat; 0 where there is none): a front end's own work, its children's included."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[3]) == session:  # (after the name: state, ppid, pgrp, session, ...)
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def wait_answering(url: str, proc: subprocess.Popen, name: str, see: str = "",
                   timeout_s: float = 120) -> None:
    """Until ``url``'s ``GET /health`` answers 200; raises (naming ``name``, then ``see``) if
    ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}{see}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not answer {url}/health{see}")
        time.sleep(0.1)


@contextlib.contextmanager
def front_end(front: str, urls: list[str], cache: Path, log: Path
              ) -> Iterator[tuple[str, Callable[[], float]]]:
    """The router (ours or smg) in front of ``urls``, as its own process (a session of its own),
    until the block ends: its URL, and what reads the CPU seconds its processes have used."""
    from testbed.api.server import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(front_command(front, urls, port, cache), cwd=REPO, env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_answering(url, proc, front, f"; see {log}")
        yield url, lambda: session_cpu_s(proc.pid)
    finally:
        vllm_live.stop(proc)


def counters(urls: list[str]) -> list[dict]:
    """Each replica's own prefix-cache and request counts, from its ``GET /metrics`` (vLLM's
    names, under ``vllm:`` or the testbed's ``testbed:``): prompt tokens queried and hit, and
    finished requests by reason."""
    return [metric_counters(httpx.get(u + "/metrics", timeout=60).text) for u in urls]


def metric_counters(text: str) -> dict:
    """``prefix_cache_queries``, ``prefix_cache_hits`` and ``request_success`` (reason ->
    count) of a Prometheus text exposition in vLLM's names, whatever their prefix."""
    out: dict = {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0, "request_success": {}}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        name, _, labels = sample.partition("{")
        name = name.split(":", 1)[-1]
        if name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
            out[name.removesuffix("_total")] += float(value)
        elif name == "request_success_total":
            reason = labels.split('finished_reason="', 1)[-1].split('"', 1)[0]
            out["request_success"][reason] = out["request_success"].get(reason, 0) + float(value)
    return out


def reset(urls: list[str]) -> None:
    """Empty every replica's prefix cache (``POST /reset_prefix_cache``: testbed.serve answers
    with ``success``, vLLM in dev mode with an empty body), retrying while a request ends."""
    for u in urls:
        for _ in range(100):  # a request may still be ending
            r = httpx.post(u + "/reset_prefix_cache", timeout=60)
            if r.status_code == 200 and (not r.content or r.json().get("success", True)):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"{u}/reset_prefix_cache did not succeed")


@contextlib.contextmanager
def replicas(kind: str, n: int, cache: Path, out: Path) -> Iterator[list[str]]:
    """``n`` replicas of SmolLM2 with ``CAPACITY`` tokens of KV each, started side by side,
    until the block ends: their URLs."""
    if kind == "testbed":
        from testbed.gateway.launch import start_replicas
        handles = start_replicas(n, [f"model={MODEL}", "device=cpu",
                                     f"cache.capacity_tokens={CAPACITY}"], 600)
        try:
            yield [h.url for h in handles]
        finally:
            for h in handles:
                h.stop()
        return
    from concurrent.futures import ThreadPoolExecutor

    from testbed.data import resolve_model
    python, model = vllm_live.venv_python(cache), resolve_model(vllm_live.MODEL)
    blocks = CAPACITY // VLLM_BLOCK + 1  # vLLM keeps its first block (the null block) out
    servers = [vllm_live.serve(python, model, VLLM_BLOCK, blocks, out / f"vllm_{i}.log",
                               env={"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))})
               for i in range(n)]
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(n) as pool:
        started = [pool.submit(s.__enter__) for s in servers]
        failure = None
        for s, f in zip(servers, started):
            try:
                f.result()
                stack.push(s)  # its __exit__ stops it
            except Exception as e:  # noqa: BLE001 - stop the others, then report this one
                failure = failure or e
        if failure is not None:
            raise BadInput(f"a vLLM replica did not start: {failure}")
        yield [f.result().url for f in started]
