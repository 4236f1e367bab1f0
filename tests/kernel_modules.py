"""Loading `radix_kernels`' Triton modules for a test file, in the interpreter or on CUDA.

Triton decides interpreter vs compiled when a ``@triton.jit`` function is *defined*, and
``import triton`` defines ``triton.language``'s own jit helpers; so ``TRITON_INTERPRET=1`` must be
set before triton is first imported (``tests/conftest.py`` and each kernel test file set it).
``tests/test_kernels.py``'s docstring says more.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import torch

import radix_kernels


def load_kernel_modules(names):
    """(modules by name, device, skip reason or None, whether a fresh process must run them)."""
    if not radix_kernels.triton_available():
        return None, None, "triton is not installed", False
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import KernelInterface

    interpret = bool(triton.knobs.runtime.interpret)
    if isinstance(tl.cdiv, InterpretedFunction) != interpret:
        # triton.language's own @jit helpers (tl.max, tl.zeros, ...) were defined when an
        # earlier test module imported triton without TRITON_INTERPRET=1; interpreted kernels
        # cannot call them. Only a fresh process can fix that.
        return None, None, ("triton was imported before TRITON_INTERPRET=1 was set (by an earlier "
                            "test module); test_kernel_grid_in_fresh_process runs this grid in a "
                            "subprocess instead"), True
    mods = {}
    for name in names:
        mod = importlib.import_module(f"radix_kernels.{name}")
        kernels = [v for v in vars(mod).values() if isinstance(v, KernelInterface)]
        if any(isinstance(k, InterpretedFunction) != interpret for k in kernels):
            mod = importlib.reload(mod)  # imported earlier in this session in the other mode
        mods[name] = mod
    if interpret:
        return mods, "cpu", None, False
    if not torch.cuda.is_available():
        return None, None, "TRITON_INTERPRET is off and there is no CUDA device", False
    return mods, "cuda", None, False


def run_in_fresh_process(test_file: str) -> None:
    """Run a kernel test file with ``TRITON_INTERPRET=1`` set before triton is imported."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        test_file], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
