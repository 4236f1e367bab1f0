"""Steady host-memory behaviour for engine steps on the CPU.

glibc's malloc serves large blocks with ``mmap`` and returns them with ``munmap``, and raises that
threshold as a process frees big blocks: early on, every step's multi-megabyte temporaries (the
gathered KV, the scores) cost fresh page faults, later they reuse the heap. The same step then
measures up to twice as long in a fresh process as after a few hundred steps, which makes measured
step times depend on what ran before (the order of a benchmark's runs, the calibration grid versus
a workload). Fixing both thresholds at the start keeps freed memory in the heap from the first step
on: the behaviour PyTorch CPU deployments get from jemalloc or tcmalloc, without preloading one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit: blocks above it are always mapped
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of freed heap for reuse

_done = False


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks up to 32 MiB in the heap (once per process); False where the
    C library is not glibc (nothing changes there)."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
