"""Building and running the server: `build_engine` turns an assembled run into an `OnlineEngine`
and the `ServerFacts` its API checks requests against; `serve_forever` runs uvicorn on a socket
bound here (the ready line is printed once it listens); `start_server` starts one for tests and
the load test (in this process, in a thread, or as ``python -m testbed.serve``), on a free
loopback port, and returns once ``/health`` answers.

On a CPU the server's process runs torch on one thread (`one_cpu_thread`). KV pool
(`kv_pool`, stated in one line at start-up): ``cache.capacity_tokens`` when given; else on CUDA
what free memory leaves after the weights (the engine's rule), and on a CPU
``engine.cpu_kv_cache_gib`` GiB of KV (2 by default, as vLLM's ``VLLM_CPU_KVCACHE_SPACE``): a
server has no workload to cap the pool by, and the hardware preset's memory (an A10G's 24 GB by
default) is not the host's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from testbed.api.metrics import ServerMetrics
from testbed.api.online import OnlineEngine
from testbed.api.protocol import ServerFacts
from testbed.api.settings import ServeSettings, assemble_serve
from testbed.config.assembly import Assembly, compose_config
from testbed.cache.events import EventLog
from testbed.errors import BadInput

REPO = Path(__file__).resolve().parents[2]
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_pool(run: Assembly) -> tuple[int | None, str]:
    """The server's KV pool in tokens (None: sized from free CUDA memory once the weights load)
    and how it was sized, for the start-up line."""
    if run.capacity_tokens is not None:
        return run.capacity_tokens, f"cache.capacity_tokens={run.capacity_tokens}"
    if run.engine_device.startswith("cuda"):
        return None, (f"what free {run.engine_device} memory leaves after the weights "
                      f"(hardware.mem_fraction={run.mem_fraction})")
    gib = run.engine.cpu_kv_cache_gib
    dtype = run.engine.dtype or "float32"  # the engine's dtype on a CPU
    shape = run.model_shape
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[dtype]
    tokens = max(1, int(gib * 2**30) // per_token)
    return tokens, (f"{gib:g} GiB (engine.cpu_kv_cache_gib={gib:g}) / {per_token:,} bytes a "
                    f"token ({shape.name} KV in {dtype})")


def build_engine(run: Assembly, settings: ServeSettings) -> tuple[OnlineEngine, ServerFacts]:
    """The model, its KV pool, the cache and the scheduler of ``run``, behind an engine (not
    started) and the facts requests are checked against."""
    from testbed.backends.engine_assembly import build_engine_parts
    from testbed.scheduler.build import build_scheduler

    capacity, _ = kv_pool(run)
    # a radix cache publishes its changes (GET /kv_events: router=kv_events reads them)
    events = EventLog() if run.cache.label == "radix" and not run.has_lower_tiers else None
    parts = build_engine_parts(run, capacity, [], events=events)
    cache = parts.cache
    scheduler = build_scheduler(cache, run.scheduler, seed=run.seed,
                                eos_token_ids=parts.eos_token_ids, eos_for_all=True,
                                reuse=run.reuse, check_invariants=run.check_invariants,
                                decode_groups=run.decode_groups())
    group = run.config["model"]
    path = group.get("path")
    name = settings.model_name or group.get("name") or Path(path).name
    extra = 1 if run.scheduler.overlap else 0  # under overlap the last token takes a slot too
    facts = ServerFacts(
        model_name=name, temperature=float(run.engine.temperature),
        top_p=float(run.engine.top_p), default_max_tokens=settings.default_max_tokens,
        limits=parts.limits,
        fits=lambda n: cache.fits(n - 1 + extra), kv_tokens=int(cache.available_size),
        tokenizer=load_tokenizer(path), cache_label=run.cache.label)
    return OnlineEngine(scheduler, parts.executor, settings.max_queue,
                        metrics=ServerMetrics(name), events=events), facts


def load_tokenizer(path: str | None) -> Any:
    """The checkpoint directory's tokenizer (its chat template too), or None without one."""
    if not path or not any((Path(path) / f).is_file()
                           for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def ready_line(run: Assembly, facts: ServerFacts, host: str, port: int) -> str:
    return (f"serving {facts.model_name} on http://{host}:{port} (cache={run.cache.label}, "
            f"scheduler={run.scheduler.target or run.scheduler.name}, "
            f"kv_capacity_tokens={facts.kv_tokens})")


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def uvicorn_server(engine: OnlineEngine, facts: ServerFacts, log_level: str):
    import uvicorn

    from testbed.api.app import make_app

    config = uvicorn.Config(make_app(engine, facts), log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def serve_forever(run: Assembly, settings: ServeSettings) -> None:
    """Build, print the ready line once the socket listens, serve until SIGINT/SIGTERM
    (uvicorn's handlers), then stop the engine's loop thread and join it."""
    if not run.engine_device.startswith("cuda"):
        one_cpu_thread()
    engine, facts = build_engine(run, settings)
    sock = bind(settings.host, settings.port)
    server = uvicorn_server(engine, facts, settings.log_level)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again for the
    # handler it found: this one ends `run` instead of killing the process before the engine's
    # thread is joined
    found = {sig: signal.signal(sig, stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    engine.start()
    try:
        print(f"kv pool: {facts.kv_tokens:,} tokens, {kv_pool(run)[1]}", flush=True)
        print(ready_line(run, facts, settings.host, sock.getsockname()[1]), flush=True)
        server.run(sockets=[sock])
    except Stopped:
        pass
    finally:
        engine.stop()
        sock.close()
        for sig, handler in found.items():
            signal.signal(sig, handler)


def one_cpu_thread() -> None:
    """One intra-op thread for torch on a CPU: the HTTP threads share the cores with the engine,
    and torch's threads spin waiting for each other while those run (the load test's steps took
    5x longer with two threads on 2 cores, docs/results/serve.md)."""
    import torch

    torch.set_num_threads(1)


class Stopped(Exception):
    """A stop signal, after uvicorn's graceful shutdown."""


def stop_signal(_sig, _frame) -> None:
    """The handler uvicorn finds for SIGINT/SIGTERM and calls after its graceful shutdown:
    it ends ``server.run`` by raising `Stopped`, so the caller's cleanup runs."""
    raise Stopped


# ---------------------------------------------------------------------------- tests, load test
@dataclass
class ServerHandle:
    url: str
    engine: OnlineEngine | None = None  # in this process only
    _server: Any = None
    _thread: threading.Thread | None = None
    _sock: socket.socket | None = None
    _proc: subprocess.Popen | None = None

    output: str = ""  # a subprocess's stdout and stderr, once stopped

    @property
    def app(self) -> Any:
        """The ASGI app (in this process only), for tests that call it as a client cannot."""
        return self._server.config.app

    def stop(self) -> int | None:
        """Stop the server and the engine's loop; the subprocess by SIGTERM (killed after 30 s):
        its exit status."""
        if self._proc is not None:
            self._proc.terminate()
            try:
                self.output = self._proc.communicate(timeout=30)[0]
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self.output = self._proc.communicate()[0]
            return self._proc.returncode
        self._server.should_exit = True
        self._thread.join(30)
        self.engine.stop()
        self._sock.close()
        return None


def start_server(overrides: Sequence[str] = (), port: int = 0, in_process: bool = True,
                 timeout_s: float = 120.0) -> ServerHandle:
    """A server of ``conf/serve.yaml`` with ``overrides`` on ``127.0.0.1:port`` (0: a free one),
    returned once ``/health`` answers 200 (polled until ``timeout_s``)."""
    if in_process:
        run, settings = assemble_serve(compose_config(list(overrides), name="serve"))
        engine, facts = build_engine(run, settings)
        sock = bind("127.0.0.1", port)
        server = uvicorn_server(engine, facts, settings.log_level)
        engine.start()
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                  name="uvicorn", daemon=True)
        thread.start()
        handle = ServerHandle(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, server,
                              thread, sock)
    else:
        port = port or free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.Popen([sys.executable, "-m", "testbed.serve", *overrides,
                                 "serve.host=127.0.0.1", f"serve.port={port}"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        handle = ServerHandle(f"http://127.0.0.1:{port}", _proc=proc)
    return healthy_or_stopped(handle, timeout_s)


def free_port() -> int:
    """A loopback port nobody listens on now (for a server started in another process)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def healthy_or_stopped(handle: Any, timeout_s: float) -> Any:
    """``handle`` (a server's or a router's) once its ``/health`` answers 200; stopped, and the
    error raised, when it does not (`wait_healthy`)."""
    try:
        wait_healthy(handle, timeout_s)
    except BaseException:
        handle.stop()
        raise
    return handle


def wait_healthy(handle: ServerHandle, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(handle.url + "/health", timeout=5.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if handle._proc is not None and handle._proc.poll() is not None:
            output = handle._proc.stdout.read()
            last = output.strip().splitlines()[-1] if output.strip() else ""
            if handle._proc.returncode == 2 and last.startswith("error: "):  # refused its config
                raise BadInput(f"testbed.serve: {last[len('error: '):]}")
            raise RuntimeError(f"testbed.serve exited {handle._proc.returncode}: "
                               f"{output[-2000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{handle.url}/health did not answer 200 within {timeout_s} s")
        time.sleep(0.05)  # between polls: a refused connection returns at once
