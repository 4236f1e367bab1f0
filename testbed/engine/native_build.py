"""The CPU's native kernels as one shared library, compiled on first use and cached.

Three C files beside this one, compiled as one unit: ``cpu_attention.c`` (attention over the KV
pool in place, `testbed.engine.cpu_attention`), ``cpu_layers.c`` (the decoder layer's
elementwise steps, `testbed.engine.cpu_layers`) and ``cpu_linear.c`` (few-row matmuls on packed
weight panels, `testbed.engine.linear`). Plain C, no torch headers, so the build takes
about a second: the system's C compiler (``$CC``, else ``cc``, else ``gcc``) with ``-O3
-march=native`` and fast-math (for the vectorized ``expf``: the kernels use no infinity inside),
into ``$XDG_CACHE_HOME/radix-testbed/kernels`` (``~/.cache`` when unset) under a name that hashes
the sources, flags, compiler and host. Callers reach the functions through ``ctypes`` with the
tensors' addresses; each family smoke-tests its functions before the engine uses them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE_FILES = ("cpu_attention.c", "cpu_layers.c", "cpu_linear.c")
SOURCE = "\n".join((Path(__file__).parent / name).read_text() for name in SOURCE_FILES)

FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC")
# Linked in a second step, without -ffast-math: with it GCC (before 13) links crtfastmath.o into
# the library, whose constructor turns on flush-to-zero for the whole process when ctypes loads it
# (every float op in the process then loses subnormals: torch's, numpy's, the simulator's).
LINK_FLAGS = ("-shared",)
BUILD_TIMEOUT_S = 120


def kernel_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache).expanduser() / "radix-testbed" / "kernels"


def compiler() -> str:
    found = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if found is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on the PATH")
    return found


def build(directory: Path | None = None) -> Path:
    """The kernels' shared library, compiled once per source, flags, compiler and machine
    (written under a temporary name, then renamed: concurrent builds do not collide)."""
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.splitlines()[:1]
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, *LINK_FLAGS, cc, *version, platform.machine(),
                                    platform.node()]).encode()).hexdigest()[:16]
    directory = directory or kernel_dir()
    target = directory / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src, obj, lib = (Path(tmp) / name for name in ("cpu_kernels.c", "k.o", "lib.so"))
        src.write_text(SOURCE)
        for command in ([cc, *FLAGS, "-c", str(src), "-o", str(obj)],
                        [cc, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"]):
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"{Path(cc).name} failed: {done.stderr.strip()[:300]}")
        os.replace(lib, target)
    return target


@functools.lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL:
    """The library, built if this host has not built these sources yet, loaded once per process
    (a build checks the compiler's version: one subprocess, not one per kernel family). Raises if
    it cannot be built: no compiler, a failed build; a failure is not cached."""
    return ctypes.CDLL(str(build()))
