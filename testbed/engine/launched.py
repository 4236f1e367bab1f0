"""`LaunchedStep`: an engine step on its way, from launch to its tokens on the host.

`EngineExecutor.launch` enqueues the step's work on the device (inputs, forward, sampling, the
tokens into the token table, their copy to the host) and returns one of these at once; its
`result` waits for the copy and returns the `StepOutcome`. Nothing in between reads the device:
the serving loop forms and launches the next step meanwhile (`testbed.serving.step_cycle`).

`DeviceTimer` times the device's share with CUDA events recorded around the step's work on the
stream (its start waits for the step before it, so the span is this step's own), and `Readback`
copies the step's tokens into pinned host memory asynchronously, an event marking the copy's end.
On the CPU the work is done by the time launch returns: launch's time is the device's, and the
readback holds the tokens.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from testbed.scheduler.batch import Batch, StepOutcome


class DeviceTimer:
    """The device time of the work enqueued between `start` and `stop`, by CUDA events (on the
    CPU nothing: launch's own time is the device's there)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._stop = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._start.record()

    def stop(self) -> None:
        if self.cuda:
            self._stop.record()

    def seconds(self) -> float | None:
        """The span, once the work is done (after `Readback.wait`); None on the CPU."""
        return self._start.elapsed_time(self._stop) / 1e3 if self.cuda else None


class Readback:
    """``values`` (a device tensor) on their way to the host: into pinned memory by an
    asynchronous copy on CUDA, an event recorded after it."""

    def __init__(self, values: torch.Tensor) -> None:
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.done: torch.cuda.Event | None = torch.cuda.Event()
            self.done.record()
        else:
            self.host, self.done = values, None

    def wait(self) -> float:
        """Wait for the copy; the seconds waited (0 on the CPU)."""
        if self.done is None:
            return 0.0
        t0 = time.perf_counter()
        self.done.synchronize()
        return time.perf_counter() - t0

    def array(self) -> np.ndarray:
        return self.host.numpy()


class LaunchedStep:
    """A launched engine step (the handle `testbed.serving.executor` names)."""

    def __init__(self, executor: Any, batch: Batch, sampled: Readback, forced: np.ndarray | None,
                 top: list | None, logits: torch.Tensor | None, timer: DeviceTimer,
                 launch_s: float, synchronous: bool, capture_s: float = 0.0,
                 verified: list | None = None) -> None:
        self.executor, self.batch = executor, batch
        self.sampled, self.forced, self.top, self.logits = sampled, forced, top, logits
        self.timer = timer
        self.launch_s = launch_s  # host seconds (a synchronous device's work included)
        self.synchronous = synchronous
        self.capture_s = capture_s  # a CUDA graph captured inside the step: not its work
        self.verified = verified  # a speculative verification's tokens, decided at launch
        self._outcome: StepOutcome | None = None

    def result(self) -> StepOutcome:
        if self._outcome is None:
            self._outcome = self._read()
        return self._outcome

    def _read(self) -> StepOutcome:
        ex, batch = self.executor, self.batch
        clock = ex.step_clock
        t0, wall = clock(), time.perf_counter()
        wait_s = self.sampled.wait()
        sampled = self.sampled.array().tolist()
        gpu_s = self.timer.seconds()
        tokens: list = [] if self.verified is None else self.verified
        for i, (e, own) in enumerate(zip(batch.entries, sampled) if self.verified is None
                                     else ()):
            if not e.makes_output:
                tokens.append(None)
            elif self.forced is not None and self.forced[i] >= 0:  # the workload's token
                tok = int(self.forced[i])
                ex.forced_tokens += 1
                ex.forced_agreed += tok == own
                tokens.append(tok)
            else:
                tokens.append(int(own))
        logprobs = None if self.top is None else \
            [None if t is None else (t[0].cpu().numpy(), t[1].cpu().numpy()) for t in self.top]
        read_s = clock() - t0
        host_s = 0.0 if self.synchronous else self.launch_s
        if self.synchronous or gpu_s is None:
            gpu_s = self.launch_s  # the CPU: launch's work is the device's
        else:
            gpu_s = max(gpu_s - self.capture_s, 0.0)
        duration = self.launch_s + read_s
        ex.steps += 1
        ex.busy_s += duration
        ex.wall_s += time.perf_counter() - wall
        if self.logits is not None:  # approximate requests against exact: not the step's time
            ex.quality.observe(batch, self.logits, tokens)
        return StepOutcome(duration_s=duration, tokens=tokens, logprobs=logprobs, gpu_s=gpu_s,
                           host_s=host_s, wait_s=wait_s)
