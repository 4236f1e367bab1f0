"""Fused residual add and RMSNorm — a Triton kernel, one program per row.

A decoder layer's two norms each take the residual stream and the previous sublayer's output
(vLLM's ``fused_add_rms_norm``): ``residual_out = x + residual``, rounded to x's dtype, and
``out = weight * norm(residual_out)`` with HF Llama's RMSNorm numerics — the mean of squares and
the scaling in fp32, the result cast to x's dtype, then multiplied by the weight in that dtype.
The first layer has no residual yet: ``residual=None`` normalises ``x`` and returns it as the
residual. A row up to 8,192 wide is held in registers (one read); a wider one is walked in
blocks twice, the second pass reading back the ``residual_out`` the first wrote.

Semantics are exactly :func:`radix_kernels.reference.fused_add_rmsnorm`, except for the order of
the fp32 sum of squares (and the GPU's ``rsqrt``): ``out`` can differ from the reference by a few
fp32 units in the last place before the cast, so by one unit of x's dtype where that cast rounds
the other way; ``residual_out`` is bitwise equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import check_dtype, check_out, last_dim_contiguous

MAX_ROW_BLOCK = 8192  # widest row held in registers at once (Llama-3-70B's hidden size)


@triton.jit
def _sum_block(x_row, r_row, ro_row, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """A block of the row, with the residual added (rounded to x's dtype) and stored; in fp32."""
    r = tl.load(x_row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(r_row + offs, mask=mask, other=0.0)
        r = (r.to(tl.float32) + res.to(tl.float32)).to(r.dtype)
        tl.store(ro_row + offs, r, mask=mask)
    return r.to(tl.float32)


@triton.jit
def _store_normed(o_row, W, rf, inv_rms, offs, mask):
    """``weight * (rf * inv_rms)``: the scaling rounded to the dtype, then the product."""
    w = tl.load(W + offs, mask=mask, other=0.0)
    normed = (rf * inv_rms).to(w.dtype)
    tl.store(o_row + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(w.dtype), mask=mask)


@triton.jit
def _fused_add_rmsnorm_kernel(
    X, R, W, OUT, ROUT,
    stride_x, stride_r, stride_o, stride_ro, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row, r_row = X + row * stride_x, R + row * stride_r
    o_row, ro_row = OUT + row * stride_o, ROUT + row * stride_ro
    if BLOCK >= HIDDEN:                                    # the row in registers: one read
        offs = tl.arange(0, BLOCK)
        mask = offs < HIDDEN
        rf = _sum_block(x_row, r_row, ro_row, offs, mask, HAS_RESIDUAL)
        inv_rms = tl.math.rsqrt(tl.sum(rf * rf, 0) / HIDDEN + eps)
        _store_normed(o_row, W, rf, inv_rms, offs, mask)
    else:                                                  # wider rows: two passes in blocks
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, HIDDEN, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            rf = _sum_block(x_row, r_row, ro_row, offs, offs < HIDDEN, HAS_RESIDUAL)
            acc += rf * rf
        inv_rms = tl.math.rsqrt(tl.sum(acc, 0) / HIDDEN + eps)
        tl.debug_barrier()                                 # pass 1's residual_out is visible
        src = ro_row if HAS_RESIDUAL else x_row
        for start in range(0, HIDDEN, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < HIDDEN
            rf = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            _store_normed(o_row, W, rf, inv_rms, offs, mask)


def _num_warps(block: int) -> int:
    """4 warps up to 1,024 columns, 8 up to 4,096, 16 beyond (a few columns per thread)."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float, *, out: torch.Tensor | None = None,
                      residual_out: torch.Tensor | None = None, block_size: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, residual_out)``: ``residual_out = x + residual`` and its RMSNorm times ``weight``.

    Args:
        x: ``[T, hidden]`` fp32/fp16/bf16, unit stride along hidden (rows may be strided).
        residual: ``[T, hidden]`` of x's dtype, or None (the first layer): then no add, and
            ``residual_out`` is ``x`` itself.
        weight: ``[hidden]`` of x's dtype.
        eps: added to the mean of squares.
        out, residual_out: optional preallocated outputs ``[T, hidden]`` of x's dtype with unit
            last stride. ``residual_out`` may be ``residual`` or ``x`` (in place); ``out`` may be
            ``x`` but not ``residual_out``. ``residual_out`` is ignored when residual is None.
        block_size: columns a program reads at once (a power of two); default the row's width
            rounded up to a power of two, or 4,096 for rows over 8,192 (then two passes).

    Example::

        >>> import torch, radix_kernels
        >>> x, res, w = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64)
        >>> out, res_out = radix_kernels.fused_add_rmsnorm(x, res, w, 1e-6)
        >>> bool(torch.equal(res_out, x + res))
        True
        >>> r = res_out
        >>> bool(torch.allclose(out, w * r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6)))
        True
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got {tuple(x.shape)}")
    check_dtype("x", x)
    num_rows, hidden = x.shape
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must be None or x's shape and dtype {tuple(x.shape)} "
                         f"{x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
    if weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{hidden}] {x.dtype}, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    if block_size is None:
        block_size = triton.next_power_of_2(hidden)
        block_size = block_size if block_size <= MAX_ROW_BLOCK else MAX_ROW_BLOCK // 2
    elif block_size < 1 or block_size & (block_size - 1) or block_size > MAX_ROW_BLOCK:
        raise ValueError(f"block_size must be a power of two <= {MAX_ROW_BLOCK}, got {block_size}")
    x, weight = last_dim_contiguous(x), weight.contiguous()
    out = check_out("out", out, x.shape, x.dtype, x.device)
    if residual is None:
        residual_out = x
    else:
        residual = last_dim_contiguous(residual)
        residual_out = check_out("residual_out", residual_out, x.shape, x.dtype, x.device)
        if residual_out.data_ptr() == out.data_ptr():
            raise ValueError("out and residual_out must be different tensors")
    if num_rows == 0:
        return out, residual_out
    res = x if residual is None else residual               # a placeholder when there is none
    _fused_add_rmsnorm_kernel[(num_rows,)](
        x, res, weight, out, residual_out,
        x.stride(0), res.stride(0), out.stride(0), residual_out.stride(0), float(eps),
        HIDDEN=hidden, BLOCK=block_size, HAS_RESIDUAL=residual is not None,
        num_warps=_num_warps(block_size),
    )
    return out, residual_out
