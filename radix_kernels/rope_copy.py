"""KV copy with RoPE re-rotation — a Triton kernel that moves stored tokens to other positions.

One program moves one token: its K rows (every KV head) at slot ``src[i]`` are turned by
``shift[i]`` positions — in each frequency pair ``(j, j + head_dim/2)`` (HF's ``rotate_half``
convention) by the angle ``shift[i] · inv_freq[j]``, in fp32 — and written with its V rows to slot
``dst[i]``. For RoPE that gives the key computed at the new position
(`testbed.engine.rope_shift` says why).

Semantics are exactly :func:`radix_kernels.reference.copy_kv_rotated`, with one restriction: a
destination slot must not be another token's source (``dst[i] == src[j]`` only for ``i == j``),
since programs run in no fixed order; in-place re-rotation (``dst == src``) is fine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_kv_rotated_kernel(
    KB, VB, src, dst, shift, inv_freq,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    s = tl.load(src + i).to(tl.int64)
    d = tl.load(dst + i).to(tl.int64)
    delta = tl.load(shift + i).to(tl.float32)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HALF)
    angle = delta * tl.load(inv_freq + offs_d, mask=offs_d < HALF, other=0.0)
    cos, sin = tl.cos(angle), tl.sin(angle)
    k_src = KB + s * stride_kbs + offs_h * stride_kbh + offs_d
    x1 = tl.load(k_src, mask=mask).to(tl.float32)
    x2 = tl.load(k_src + HALF, mask=mask).to(tl.float32)
    v_lo = tl.load(VB + s * stride_vbs + offs_h * stride_vbh + offs_d, mask=mask)
    v_hi = tl.load(VB + s * stride_vbs + offs_h * stride_vbh + HALF + offs_d, mask=mask)
    k_dst = KB + d * stride_kbs + offs_h * stride_kbh + offs_d
    tl.store(k_dst, (x1 * cos - x2 * sin).to(KB.dtype.element_ty), mask=mask)
    tl.store(k_dst + HALF, (x2 * cos + x1 * sin).to(KB.dtype.element_ty), mask=mask)
    v_dst = VB + d * stride_vbs + offs_h * stride_vbh + offs_d
    tl.store(v_dst, v_lo, mask=mask)
    tl.store(v_dst + HALF, v_hi, mask=mask)


def copy_kv_rotated(k_buf: torch.Tensor, v_buf: torch.Tensor, src: torch.Tensor,
                    dst: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Copy K and V of slots ``src`` to slots ``dst`` (``[n]`` int) in one layer's buffers
    ``[slots, kv_heads, head_dim]``, keys turned by ``shift`` (``[n]`` int) positions with RoPE's
    ``inv_freq`` (``[head_dim / 2]`` fp32).

    Example::

        >>> import torch, radix_kernels
        >>> k_buf, v_buf = torch.randn(9, 2, 16), torch.randn(9, 2, 16)
        >>> inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
        >>> radix_kernels.copy_kv_rotated(k_buf, v_buf, torch.tensor([1, 2]),
        ...                               torch.tensor([5, 6]), torch.tensor([0, 0]), inv_freq)
        >>> bool(torch.allclose(k_buf[5], k_buf[1]))
        True
    """
    n = src.numel()
    if k_buf.dim() != 3 or v_buf.shape != k_buf.shape or k_buf.shape[2] % 2 \
            or dst.numel() != n or shift.numel() != n or inv_freq.numel() * 2 != k_buf.shape[2]:
        raise ValueError(f"expected buffers [slots, kv_heads, even head_dim], src, dst, shift of "
                         f"one length and inv_freq [head_dim / 2], got k_buf "
                         f"{tuple(k_buf.shape)}, v_buf {tuple(v_buf.shape)}, src {n}, dst "
                         f"{dst.numel()}, shift {shift.numel()}, inv_freq {inv_freq.numel()}")
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("k_buf and v_buf must have unit stride along head_dim")
    if n == 0:
        return
    num_kv_heads, half = k_buf.shape[1], k_buf.shape[2] // 2
    _copy_kv_rotated_kernel[(n,)](
        k_buf, v_buf, src, dst, shift, inv_freq.to(k_buf.device, torch.float32).contiguous(),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=triton.next_power_of_2(half),
    )
