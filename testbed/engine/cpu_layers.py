"""The decoder layer's elementwise steps on the CPU as C functions (``cpu_layers.c``).

On the CPU a small model's decode layer is bound by its matmuls' weight reads and, beside them,
by how many torch operations it dispatches: the torch references of the fused steps
(`testbed.engine.layer_kernels.TORCH_KERNELS`) are about twenty operations a layer, a few
microseconds each whatever their size. These do each step in one call through ``ctypes`` (which
lets go of the interpreter's lock meanwhile), the same contract as the torch and Triton families:
add + RMSNorm, SiLU-and-mul, RoPE + KV store. fp32 only; the roundings are the references' up to
a unit or two in the last place (the sum of squares and the exponential differ in order and
implementation), the tolerance the Triton family is held to.

`load_layer_kernels` returns the family, or None and why not (no compiler, a failed build or
smoke test); `native_or_torch` is the runner's choice: where they cannot run (or the model is
not fp32) the engine runs the torch references and says why (``layer_kernels_error``).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from testbed.engine.layer_kernels import TORCH_KERNELS, LayerKernels, smoke_test
from testbed.engine.native_build import load_library

_p, _i64, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class NativeLayerSteps:
    """The library's three functions as functions of tensors (rows contiguous fp32)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.rmsnorm = lib.add_rmsnorm
        self.rmsnorm.argtypes = [_p, _p, _p, _i64, _i64, _f, _p, _p]
        self.rmsnorm.restype = None
        self.silu = lib.silu_and_mul
        self.silu.argtypes = [_p, _i64, _i64, _p]
        self.silu.restype = None
        self.rope = lib.rope_store
        self.rope.argtypes = [_p, _p, _p, _p] + [_i64] * 4 + [_p, _p, _p]
        self.rope.restype = None

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        out, stream = torch.empty_like(x), torch.empty_like(x)
        residual = None if residual is None else residual.contiguous()
        self.rmsnorm(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                     weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr(),
                     stream.data_ptr())
        return out, stream

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        tokens, width = gate_up.shape
        out = torch.empty((tokens, width // 2), dtype=gate_up.dtype)
        self.silu(gate_up.data_ptr(), tokens, width // 2, out.data_ptr())
        return out

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   out_slots: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                   num_heads: int, num_kv_heads: int) -> torch.Tensor:
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        if out_slots.dtype != torch.int32:
            out_slots = out_slots.int()
        out_slots = out_slots.contiguous()
        tokens, head_dim = qkv.shape[0], k_buf.shape[-1]
        q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype)
        self.rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), out_slots.data_ptr(), tokens,
                  num_heads, num_kv_heads, head_dim, k_buf.data_ptr(), v_buf.data_ptr(),
                  q.data_ptr())
        return q


@lru_cache(maxsize=None)
def load_layer_kernels() -> tuple[LayerKernels | None, str | None]:
    """The native family, built and smoke-tested (against the torch references) once per
    process, or None and why not."""
    try:
        steps = NativeLayerSteps(load_library())
        kernels = LayerKernels("native", steps.add_rmsnorm, steps.silu_and_mul, steps.rope_store)
        smoke_test(kernels, torch.device("cpu"), torch.float32)
    except Exception as e:  # noqa: BLE001 - any failure means: the torch references here
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    return kernels, None


def native_or_torch(dtype: torch.dtype) -> tuple[LayerKernels, str | None]:
    """The native family for a CPU model in ``dtype``, else the torch references and why."""
    if dtype != torch.float32:
        return TORCH_KERNELS, f"the native layer kernels are fp32 only, not {dtype}"
    kernels, error = load_layer_kernels()
    return (TORCH_KERNELS, error) if kernels is None else (kernels, None)
