"""KV store — a Triton kernel that scatters new tokens' K and V into the per-layer buffers.

One program copies one token: its ``[num_kv_heads, head_dim]`` rows of K and V go to row
``slots[i]`` of ``k_buf`` and ``v_buf``, cast to the buffers' dtype. Inputs may be strided views
(e.g. slices of a fused QKV projection).

Semantics are exactly :func:`radix_kernels.reference.store_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K, V, KB, VB, slots,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + tok).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    k = tl.load(K + tok * stride_kt + offs_h * stride_kh + offs_d * stride_kd, mask=mask)
    v = tl.load(V + tok * stride_vt + offs_h * stride_vh + offs_d * stride_vd, mask=mask)
    tl.store(KB + slot * stride_kbs + offs_h * stride_kbh + offs_d, k.to(KB.dtype.element_ty),
             mask=mask)
    tl.store(VB + slot * stride_vbs + offs_h * stride_vbh + offs_d, v.to(VB.dtype.element_ty),
             mask=mask)


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k, v`` (``[n, num_kv_heads, head_dim]``) into ``k_buf, v_buf`` at rows ``slots``.

    ``slots`` is ``[n]`` int32/int64 (distinct, as the KV pool hands them out). The buffers are
    ``[num_slots + 1, num_kv_heads, head_dim]`` with unit stride along head_dim.

    Example::

        >>> import torch, radix_kernels
        >>> k_buf = torch.zeros(9, 2, 16); v_buf = torch.zeros(9, 2, 16)
        >>> k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
        >>> radix_kernels.store_kv(k_buf, v_buf, torch.tensor([5, 1, 7]), k, v)
        >>> bool((k_buf[5] == k[0]).all())
        True
    """
    n = slots.numel()
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != k_buf.shape[1:] \
            or v_buf.shape != k_buf.shape or k.shape[0] != n:
        raise ValueError(f"expected k, v [n, kv_heads, dim] matching buffers [slots, kv_heads, "
                         f"dim] and n == len(slots), got k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"k_buf {tuple(k_buf.shape)}, slots {tuple(slots.shape)}")
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("k_buf and v_buf must have unit stride along head_dim")
    if n == 0:
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    _store_kv_kernel[(n,)](
        k, v, k_buf, v_buf, slots,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
