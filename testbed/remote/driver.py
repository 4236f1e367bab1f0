"""The serving loop of ``backend=server``: the workload's calls sent to a live server on the wall
clock, with the simulator's rules (`testbed.serving.driver.Driver`) and its bookkeeping
(`testbed.workloads.graph.ProgramGraph`).

Programs start in arrival order, at most ``max_in_flight`` at once; a root call is sent at its
``arrival_s`` (seconds since the run began), a waiting one ``think_time_s`` after the last of its
``after`` dependencies finished (the end of its stream), and with ``max_concurrency`` a ready call
waits in a FIFO until fewer than that many calls are outstanding. A call whose prompt splices in
earlier outputs (``segments``) has it rebuilt with `materialize` from the outputs the server
returned, forced or not: the server's cache holds what it generated. A call that failed counts
as finished for its dependents, which splice in its workload output instead (empty for a
generated call), as the simulator does for a request aborted at submission. An exception from
``send`` (the server unreachable) stops the run: every call still waiting or running is
cancelled and the exception raised.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np
from tqdm import tqdm

from testbed.remote.openai_client import Completion
from testbed.workloads.graph import ProgramGraph
from testbed.workloads.request import TOKEN_DTYPE, Request, materialize

Send = Callable[[Request, np.ndarray], Awaitable[Completion]]


@dataclass
class Sent:
    """A call as it was sent: its prompt (rebuilt from real outputs where it splices them in),
    when (seconds since the run began) and what came back."""

    call: Request
    prompt: np.ndarray
    sent_s: float
    completion: Completion | None = None


class RemoteDriver:
    def __init__(self, requests: list[Request], send: Send, max_in_flight: int | None = None,
                 max_concurrency: int | None = None, progress: bool = False) -> None:
        self.graph = ProgramGraph(requests)
        self.send = send
        self.max_in_flight = max_in_flight
        self.sent: list[Sent] = []  # in the order the calls were sent
        self.t0 = 0.0  # time.perf_counter() when the run began
        self._outputs: dict[str, np.ndarray] = {}
        self._free_slots = max_concurrency  # None: unlimited
        self._slot_waiters: deque[asyncio.Future] = deque()
        self._in_flight = 0
        self._tasks: set[asyncio.Task] = set()
        self._fatal: BaseException | None = None
        self._bar = tqdm(total=len(requests), desc="server", unit="req",
                         disable=None if progress else True)

    def now(self) -> float:
        """Seconds since the run began."""
        return time.perf_counter() - self.t0

    async def run(self) -> list[Sent]:
        """Send every call; returns them in the order they were sent."""
        self.t0 = time.perf_counter()
        self._all_done = asyncio.Event()
        self._program_done = asyncio.Event()
        if self.graph.total:
            self._spawn(self._start_programs())
            await self._all_done.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._bar.close()
        if self._fatal is not None:
            raise self._fatal
        return self.sent

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(self._guarded(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guarded(self, work: Awaitable[None]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - re-raised by run()
            if self._fatal is None:
                self._fatal = e
            self._all_done.set()

    async def _start_programs(self) -> None:
        programs = self.graph.programs
        for index, program in enumerate(programs):
            while self.max_in_flight is not None and self._in_flight >= self.max_in_flight:
                self._program_done.clear()
                await self._program_done.wait()
            await self.until(self.graph.first_arrival(index))
            self._in_flight += 1
            for call in self.graph.roots[program]:
                self._spawn(self._serve(call, call.arrival_s))

    async def until(self, when: float) -> None:
        """Until ``when`` (run seconds) has come: a timer may fire early (uvloop's keep whole
        milliseconds), and a call is never sent before its time. Yields at least once, as a
        sleep of nothing does."""
        await asyncio.sleep(max(0.0, when - self.now()))
        while (left := when - self.now()) > 0:
            await asyncio.sleep(left)

    async def _serve(self, call: Request, when: float) -> None:
        """Send ``call`` at ``when`` once a call slot is free; then release what it waited on."""
        await self.until(when)
        await self._take_slot()
        prompt = materialize(call.segments, self._outputs) if call.segments else call.prompt
        sent = Sent(call, prompt, self.now())
        self.sent.append(sent)
        sent.completion = done = await self.send(call, prompt)
        self._give_slot()
        ok = not done.failed and done.output_ids is not None
        self._outputs[call.id] = np.asarray(done.output_ids, dtype=TOKEN_DTYPE) if ok \
            else call.output
        program_done, ready = self.graph.finish(call, done.finish - self.t0)
        self._bar.update(1)
        if program_done:
            self._in_flight -= 1
            self._program_done.set()
        for dep, at in ready:
            self._spawn(self._serve(dep, at))
        if self.graph.all_finished:
            self._all_done.set()

    async def _take_slot(self) -> None:
        """Wait, first come first served, until fewer than ``max_concurrency`` calls are out."""
        if self._free_slots is None:
            return
        if self._free_slots > 0 and not self._slot_waiters:
            self._free_slots -= 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(turn)
        await turn  # the slot is handed over by _give_slot

    def _give_slot(self) -> None:
        if self._free_slots is None:
            return
        while self._slot_waiters:
            turn = self._slot_waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._free_slots += 1
