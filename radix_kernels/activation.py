"""SwiGLU's activation — a Triton kernel: ``silu(gate) * up`` of the fused gate/up projection.

``gate_up`` is ``[T, 2 * I]`` as ``gate_up_proj`` lays it out (gate in the first half of the last
dim, up in the second). A program takes one row and ``BLOCK`` columns of ``I``: silu in fp32,
rounded to the activations' dtype, then the product with ``up`` in fp32, rounded again — torch's
``F.silu(gate) * up`` in that dtype.

Semantics are exactly :func:`radix_kernels.reference.silu_and_mul`, except that ``exp`` is the
GPU's (or numpy's in the interpreter), not torch's: silu can differ by a few fp32 units in the
last place, so by one unit of a 16-bit dtype where its rounding flips; the product is rounded as
torch rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import check_dtype, check_out, last_dim_contiguous


@triton.jit
def _silu_and_mul_kernel(GU, OUT, stride_gt, stride_ot, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(GU + row * stride_gt + cols, mask=mask, other=0.0)
    up = tl.load(GU + row * stride_gt + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(OUT + row * stride_ot + cols, out.to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None,
                 block_size: int | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2 * I]`` (gate first): ``[T, I]`` of its dtype.

    Args:
        gate_up: ``[T, 2 * I]`` fp32/fp16/bf16, unit stride along the last dim (rows may be
            strided).
        out: optional preallocated ``[T, I]`` of gate_up's dtype with unit last stride.
        block_size: columns of ``I`` a program takes (a power of two); default
            ``min(1024, next_power_of_2(I))``.

    Example::

        >>> import torch, radix_kernels
        >>> gate_up = torch.randn(3, 2 * 40)
        >>> out = radix_kernels.silu_and_mul(gate_up)
        >>> gate, up = gate_up.chunk(2, dim=-1)
        >>> out.shape, bool(torch.allclose(out, torch.nn.functional.silu(gate) * up))
        (torch.Size([3, 40]), True)
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [tokens, 2 * intermediate], got "
                         f"{tuple(gate_up.shape)}")
    check_dtype("gate_up", gate_up)
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if block_size is None:
        block_size = min(1024, triton.next_power_of_2(max(inter, 1)))
    elif block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    gate_up = last_dim_contiguous(gate_up)
    out = check_out("out", out, (num_rows, inter), gate_up.dtype, gate_up.device)
    if num_rows == 0 or inter == 0:
        return out
    _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block_size))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block_size,
        num_warps=4 if block_size <= 1024 else 8,
    )
    return out
