"""How an engine run times its steps, the same in a calibration and in the run it predicts.

Two run keys say it: ``threads``, torch's intra-op threads (null: 1 on the CPU, as
``testbed.serve`` and ``experiments.validation.sim_vs_engine`` run it; torch's own default on a
GPU), and ``clock``, what a step's duration is read from: ``wall`` (``time.perf_counter``) or
``cpu`` (the CPU seconds of the thread that runs the step, ``time.thread_time``: on a CPU machine
shared with other jobs their time slices do not stretch it, nor do the server's HTTP threads beside
the engine's; needs the CPU and one torch thread, so that the step's work runs in the thread that
launches it); null: ``cpu`` where the engine runs on the CPU on one thread, else ``wall``. On the
2-core development machine, beside another job, SmolLM2's decode steps ran 5x slower with two
threads than the calibration (also two threads) had measured them, and wall time swings by up to 2x
from one minute to the next, so a cost model fitted under one setting predicts another's run
wrongly. ``python -m testbed.calibrate`` records both in the fitted file (``meta.threads``,
``meta.clock``), and a simulated run with ``cost_model=fitted`` refuses, in one line, a file
measured on the CPU under settings other than its own (the engine run it predicts uses the same
keys, with the same defaults). Since issue 46 the file also records ``meta.cpu_kernels`` (the
engine's CPU kernels, 2-3x apart in decode speed), checked the same way against the run's
``engine.cpu_kernels``.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from testbed.errors import BadInput, check_choice

CLOCKS = ("wall", "cpu")


def timing_settings(config: Mapping[str, Any], device: str) -> tuple[int | None, str]:
    """``threads`` and ``clock`` of a run on ``device``, checked and resolved: threads an integer
    >= 1 (None: torch's default, only off the CPU), clock ``wall`` or ``cpu`` (the CPU, one
    thread)."""
    threads, clock = config.get("threads"), config.get("clock")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise BadInput(f"threads must be an integer >= 1 or null, got {threads!r}")
    cpu = not str(device).startswith("cuda")
    if threads is None and cpu:
        threads = 1
    if clock is None:
        clock = "cpu" if cpu and threads == 1 else "wall"
    check_choice("clock", clock, CLOCKS, null=True)
    if clock == "cpu" and not (cpu and threads == 1):
        raise BadInput(f"clock=cpu times a CPU engine on one thread (process time sums every "
                       f"thread's); got device={device} threads={threads}")
    return threads, clock


def apply_timing(executor: Any, threads: int | None, clock: str) -> None:
    """Set torch's threads (process-wide) and the executor's step clock."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    # the thread's, not the process's: a server's HTTP threads run beside the step (issue 46)
    executor.clock = time.thread_time if clock == "cpu" else None


def check_fit_timing(meta: Mapping[str, Any], config: Mapping[str, Any], path: Any) -> None:
    """A fitted cost model measured on the CPU predicts an engine run with the same ``threads``
    and ``clock`` (and ``engine.cpu_kernels``, where the file records them): refuse, in one
    line, a file whose ``meta`` says otherwise than the run's keys (a file without them, written
    before them, is taken as it is)."""
    if meta.get("device") != "cpu" or "threads" not in meta:
        return
    threads, clock = timing_settings(config, "cpu")
    fitted = (meta.get("threads"), meta.get("clock"))
    if fitted != (threads, clock):
        raise BadInput(f"cost_model.path={path} was measured with threads={fitted[0]} "
                       f"clock={fitted[1]}, and this run's engine would run with "
                       f"threads={threads} clock={clock}: set threads={fitted[0]} "
                       f"clock={fitted[1]}, or calibrate again with threads={threads} "
                       f"clock={clock}")
    kernels = (config.get("engine") or {}).get("cpu_kernels") or "native"
    if "cpu_kernels" in meta and meta["cpu_kernels"] != kernels:  # issue 46: 2-3x apart
        raise BadInput(f"cost_model.path={path} was measured with engine.cpu_kernels="
                       f"{meta['cpu_kernels']}, and this run's engine would run "
                       f"engine.cpu_kernels={kernels}: set engine.cpu_kernels="
                       f"{meta['cpu_kernels']}, or calibrate again with {kernels}")
