"""Fresh-process cells and their memory, for the speed benchmark (`experiments.benchmarks.speed`):
a cell runs in a process of its own (``--cell``), so one side's memory and warm caches never
reach another's; its peak resident memory is measured above what it held when its clock started.
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

from experiments import REPO
from testbed.perf import gc_paused
from testbed.workloads.request import Request


def status(key: str) -> int:
    """A ``/proc/self/status`` figure in kB (``VmRSS``, ``VmHWM``)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1))


def peak_during(fn: Callable[[], object]) -> tuple[float, float, object]:
    """(seconds, MB of resident memory at the peak above what was resident before, result) of
    ``fn()``: the peak is reset first (``/proc/self/clear_refs``), so what loading left behind
    does not count."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    with gc_paused():
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
    return seconds, (status("VmHWM") - before) / 1024, out


def token_mb(requests: Iterable[Request]) -> float:
    """MB of the requests' own token arrays (prompt and output)."""
    return sum(r.prompt.nbytes + r.output.nbytes for r in requests) / 2 ** 20


def mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f} MB"


def child(cell: list[str], budget: float) -> dict:
    """A ``--cell`` in a fresh process: its JSON line, or ``{"error": why}``."""
    cmd = [sys.executable, "-m", "experiments.benchmarks.speed", *cell]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=budget, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"over {budget:.0f} s (stopped)"}
    if done.returncode:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])
