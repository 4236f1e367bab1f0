"""Small helpers shared by the Triton kernel wrappers (argument checks, launch settings)."""

from __future__ import annotations

import torch

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 (no TF32) for fp32 inputs, the default otherwise.

    fp32 is used for correctness runs against HF transformers, where TF32's 10-bit mantissa would
    show; fp16/bf16 ignore the setting.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels index rows by stride but assume unit stride along the last dim."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_attention_inputs(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> int:
    """Validate shapes/dtypes; return the GQA group size ``num_heads // num_kv_heads``."""
    if q.dim() != 3 or k_buf.dim() != 3 or v_buf.shape != k_buf.shape:
        raise ValueError(f"expected q [tokens, heads, head_dim] and k_buf, v_buf of one shape "
                         f"[slots, kv_heads, head_dim], got q {tuple(q.shape)}, k_buf "
                         f"{tuple(k_buf.shape)}, v_buf {tuple(v_buf.shape)}")
    head_dim = q.shape[2]
    if k_buf.shape[2] != head_dim or q.shape[1] % k_buf.shape[1]:
        raise ValueError(f"head_dim must match and num_heads must be a multiple of num_kv_heads, "
                         f"got q {tuple(q.shape)}, k_buf {tuple(k_buf.shape)}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 (a tl.dot dimension), "
                         f"got {head_dim}")
    if q.dtype not in _SUPPORTED or k_buf.dtype != q.dtype or v_buf.dtype != q.dtype:
        raise ValueError(f"q, k_buf, v_buf must share one dtype among {_SUPPORTED}, got "
                         f"{q.dtype}, {k_buf.dtype}, {v_buf.dtype}")
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("k_buf and v_buf must have unit stride along head_dim")
    return q.shape[1] // k_buf.shape[1]


def check_block(name: str, value: int) -> int:
    """Every tl.dot dimension must be >= 16 to compile on GPUs; blocks are powers of two."""
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    return value


def default_block(dtype: torch.dtype, head_dim: int) -> int:
    """Default KV/query tile: 64, or 32 when a row is over 256 bytes (fp32 at head_dim 128, any
    dtype at 256), so double-buffered K and V tiles fit in ~100 KB of shared memory (A10G)."""
    return 64 if torch.finfo(dtype).bits // 8 * head_dim <= 256 else 32


def check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _SUPPORTED:
        raise ValueError(f"{name} must be one of {_SUPPORTED}, got {t.dtype}")


def check_out(name: str, out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A caller's preallocated output, checked; a fresh contiguous one when None."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"{name} must be {tuple(shape)} {dtype} with unit last stride, got "
                         f"{tuple(out.shape)} {out.dtype} with strides {out.stride()}")
    return out


def attention_outputs(q: torch.Tensor, out: torch.Tensor | None, return_lse: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention kernel's output (the caller's ``out``, checked, or a fresh one of q's shape
    and dtype) and its fp32 LSE ``[tokens, heads]`` (a ``[1, 1]`` placeholder the kernel does not
    write when ``return_lse`` is false)."""
    out = check_out("out", out, tuple(q.shape), q.dtype, q.device)
    lse = torch.empty(tuple(q.shape[:2]) if return_lse else (1, 1), dtype=torch.float32,
                      device=q.device)
    return out, lse
