"""The live server ``backend=server`` configs are sent to: ``python -m testbed.serve`` on the
tiny model, started by the fuzzer in a process of its own (in the background as the fuzz run
starts, so that its seconds of loading overlap the first configs) on a free loopback port
(polled until ``/health`` answers, `testbed.api.server.start_server`), and stopped at the end of
the fuzz run.

Its own config (cache, eviction, scheduler, the engine's CPU kernels) is drawn once per fuzz run
from the run's seed (`server_config`), with ``debug.check_invariants=true``: a broken invariant
inside the server fails its calls, which the fuzzer reports. It serves every server config of the
run in turn, so its cache holds what earlier configs sent.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from testbed.fuzz.group_space import choice

URL = "FUZZ_SERVER"  # the ``server.url`` a draw writes: the live server's, once it runs
SERVED = ["model=tiny", "device=cpu", "debug.check_invariants=true"]


def server_config(seed: int) -> list[str]:
    """The server's overrides for the fuzz run of ``seed`` (a stream of its own)."""
    rng = np.random.default_rng([seed, 58])
    return [*SERVED, f"cache.page_size={choice(rng, [1, 1, 4])}",
            f"cache.capacity_tokens={choice(rng, ['null', 2000])}",
            f"eviction={choice(rng, ['lru', 'lfu', 'slru', 'priority'])}",
            f"scheduler={choice(rng, ['lpm', 'fcfs', 'dfs_weight'])}",
            f"scheduler.overlap={choice(rng, ['true', 'false'])}",
            f"engine.cpu_kernels={choice(rng, ['native', 'torch'])}",
            f"engine.attention={choice(rng, ['torch', 'cascade'])}"]


@dataclass
class FuzzServer:
    overrides: list[str]
    handle: object | None = field(default=None, repr=False)
    _starting: Future | None = field(default=None, repr=False)

    def start(self) -> None:
        """Start it in the background (it loads for seconds): `url` waits for it."""
        from testbed.api.server import start_server

        if self.handle is None and self._starting is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fuzz-server")
            self._starting = pool.submit(start_server, self.overrides, in_process=False)
            pool.shutdown(wait=False)

    @property
    def url(self) -> str:
        """The server's URL, once it answers (started here if `start` was not called)."""
        if self.handle is None:
            self.start()
            starting, self._starting = self._starting, None
            self.handle = starting.result()
        return self.handle.url

    def command(self) -> str:
        """The command line that starts this server where the failing config expects it."""
        port = self.handle.url.rpartition(":")[2] if self.handle is not None else "PORT"
        return " ".join(["python -m testbed.serve", *self.overrides, f"serve.port={port}"])

    def stop(self) -> None:
        if self._starting is not None:  # started, never used
            try:
                self.handle = self._starting.result()
            except Exception:  # noqa: BLE001 - it failed to start: nothing to stop
                pass
            self._starting = None
        if self.handle is not None:
            self.handle.stop()
            self.handle = None
