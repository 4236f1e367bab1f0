"""RoPE on the fused projection's q and k, and the KV store — one Triton kernel.

One program takes one token's row of ``qkv`` (``[(H + 2 * KH) * D]``: q heads, k heads, v heads,
as ``qkv_proj`` outputs it): it rotates q and k by the token's ``cos`` and sign-folded ``sin``
tables (`testbed.engine.model.rope_tables`), writes q to a fresh ``[T, H, D]`` tensor, and
writes rotated k and plain v to row ``out_slots[t]`` of ``k_buf, v_buf``, cast to the buffers'
dtype — ``apply_rope`` and ``store_kv`` in one launch.

The rotation is ``apply_rope``'s ``x * cos + roll(x, D / 2) * sin`` with torch's rounding in the
activations' dtype: each product is the exact fp32 product rounded to that dtype, and so is their
sum. Launched without fp contraction (no fused multiply-add), so it is bitwise equal to
:func:`radix_kernels.reference.rope_store_kv` — whose semantics are exactly this kernel's — in
every dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import check_dtype


@triton.jit
def _rotate(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi):
    """The two halves of ``x * cos + roll(x, D/2) * sin``, each op rounded to x's dtype."""
    dt = lo.dtype
    lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
    out_lo = (lo32 * cos_lo).to(dt).to(tl.float32) + (hi32 * sin_lo).to(dt).to(tl.float32)
    out_hi = (hi32 * cos_hi).to(dt).to(tl.float32) + (lo32 * sin_hi).to(dt).to(tl.float32)
    return out_lo.to(dt), out_hi.to(dt)


@triton.jit
def _rope_store_kv_kernel(
    QKV, COS, SIN, slots, Q, KB, VB,
    stride_xt, stride_xc, stride_ct, stride_cd, stride_st, stride_sd,
    stride_qt, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < HALF
    c_row, s_row = COS + tok * stride_ct, SIN + tok * stride_st
    cos_lo = tl.load(c_row + d * stride_cd, mask=d_mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(c_row + (d + HALF) * stride_cd, mask=d_mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(s_row + d * stride_sd, mask=d_mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(s_row + (d + HALF) * stride_sd, mask=d_mask, other=0.0).to(tl.float32)
    x_row = QKV + tok * stride_xt

    hq = tl.arange(0, BLOCK_HQ)[:, None]                  # q heads
    mask = (hq < NUM_HEADS) & d_mask
    src = x_row + (hq * HEAD_DIM + d) * stride_xc
    lo = tl.load(src, mask=mask, other=0.0)
    hi = tl.load(src + HALF * stride_xc, mask=mask, other=0.0)
    q_lo, q_hi = _rotate(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi)
    dst = Q + tok * stride_qt + hq * stride_qh + d
    tl.store(dst, q_lo, mask=mask)
    tl.store(dst + HALF, q_hi, mask=mask)

    slot = tl.load(slots + tok).to(tl.int64)
    hk = tl.arange(0, BLOCK_HK)[:, None]                  # k heads, then v heads
    mask = (hk < NUM_KV_HEADS) & d_mask
    src = x_row + ((NUM_HEADS + hk) * HEAD_DIM + d) * stride_xc
    lo = tl.load(src, mask=mask, other=0.0)
    hi = tl.load(src + HALF * stride_xc, mask=mask, other=0.0)
    k_lo, k_hi = _rotate(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi)
    dst = KB + slot * stride_kbs + hk * stride_kbh + d
    tl.store(dst, k_lo.to(KB.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, k_hi.to(KB.dtype.element_ty), mask=mask)
    src = x_row + ((NUM_HEADS + NUM_KV_HEADS + hk) * HEAD_DIM + d) * stride_xc
    dst = VB + slot * stride_vbs + hk * stride_vbh + d
    tl.store(dst, tl.load(src, mask=mask).to(VB.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, tl.load(src + HALF * stride_xc, mask=mask).to(VB.dtype.element_ty),
             mask=mask)


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  out_slots: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Rotate q and k of ``qkv`` (RoPE), store k and v at ``out_slots``; return q ``[T, H, D]``.

    Args:
        qkv: ``[T, (num_heads + 2 * num_kv_heads) * D]`` fp32/fp16/bf16, any strides (a slice of
            a wider projection, say).
        cos, sin: ``[T, 1, D]`` of qkv's dtype, any strides: ``cos`` twice and ``sin``
            sign-folded ``[-sin, sin]``, as `testbed.engine.model.rope_tables` returns them.
        out_slots: ``[T]`` int32/int64, distinct: the KV rows the tokens' k and v go to.
        k_buf, v_buf: ``[num_slots + 1, num_kv_heads, D]`` of one shape, unit stride along D;
            values are cast to their dtype.
        num_heads, num_kv_heads: query and KV heads (D follows from qkv's width).

    Returns q ``[T, num_heads, D]``, contiguous, of qkv's dtype.

    Example::

        >>> import torch, radix_kernels
        >>> t, h, kh, d = 3, 4, 2, 16
        >>> qkv = torch.randn(t, (h + 2 * kh) * d)
        >>> angle = torch.arange(t).float()[:, None, None] * torch.rand(d // 2)
        >>> cos = torch.cat((angle.cos(), angle.cos()), -1)
        >>> sin = torch.cat((-angle.sin(), angle.sin()), -1)
        >>> k_buf, v_buf = torch.zeros(9, kh, d), torch.zeros(9, kh, d)
        >>> slots = torch.tensor([5, 1, 7])
        >>> q = radix_kernels.rope_store_kv(qkv, cos, sin, slots, k_buf, v_buf, h, kh)
        >>> q.shape, bool(torch.equal(v_buf[1], qkv[1, -kh * d:].view(kh, d)))
        (torch.Size([3, 4, 16]), True)
    """
    if qkv.dim() != 2 or num_heads < 1 or num_kv_heads < 1 \
            or qkv.shape[1] % (num_heads + 2 * num_kv_heads):
        raise ValueError(f"qkv must be [tokens, (num_heads + 2 * num_kv_heads) * head_dim], got "
                         f"{tuple(qkv.shape)} with num_heads {num_heads}, num_kv_heads "
                         f"{num_kv_heads}")
    check_dtype("qkv", qkv)
    t, head_dim = qkv.shape[0], qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {head_dim}")
    if k_buf.dim() != 3 or v_buf.shape != k_buf.shape \
            or tuple(k_buf.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k_buf and v_buf must be [slots, {num_kv_heads}, {head_dim}], got "
                         f"{tuple(k_buf.shape)} and {tuple(v_buf.shape)}")
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("k_buf and v_buf must have unit stride along head_dim")
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (t, 1, head_dim) or table.dtype != qkv.dtype:
            raise ValueError(f"{name} must be [{t}, 1, {head_dim}] {qkv.dtype} (rope_tables), "
                             f"got {tuple(table.shape)} {table.dtype}")
    if out_slots.shape != (t,) or out_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"out_slots must be [{t}] int32/int64, got {tuple(out_slots.shape)} "
                         f"{out_slots.dtype}")
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    _rope_store_kv_kernel[(t,)](
        qkv, cos, sin, out_slots, q, k_buf, v_buf,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2),
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
        v_buf.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        enable_fp_fusion=False,
    )
    return q
