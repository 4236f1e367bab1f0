"""Extend (prefill) attention over paged KV with a cached prefix — a Triton kernel.

One program handles ``BLOCK_M`` new tokens of one request for one query head. It walks the
request's KV in blocks of ``BLOCK_N`` positions, gathers their slot ids from ``kv_indices``,
loads K/V rows from the token-granular buffers, and keeps a flash-attention online softmax
(running max ``m``, running sum ``l``, fp32 accumulator). GQA maps query head ``h`` to KV head
``h // group``. The causal mask is lower-right aligned: new token ``j`` of a request with a
cached prefix of ``P`` tokens sees KV positions ``<= P + j``, and the KV loop stops at the last
position any row of the block can see.

Semantics are exactly :func:`radix_kernels.reference.extend_attention`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._util import (check_attention_inputs, check_block, default_block, dot_precision,
                    last_dim_contiguous)

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    Q, K, V, O, LSE,
    qo_indptr, kv_indptr, kv_indices,
    sm_scale_log2,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, STORE_LSE: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)

    q_start = tl.load(qo_indptr + req).to(tl.int64)
    q_len = tl.load(qo_indptr + req + 1).to(tl.int64) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    kv_start = tl.load(kv_indptr + req).to(tl.int64)
    kv_len = tl.load(kv_indptr + req + 1).to(tl.int64) - kv_start
    prefix = kv_len - q_len
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)       # query rows among the new tokens
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # The block's last row sees positions <= prefix + (m_block + 1) * BLOCK_M - 1. Row 0's first
    # key (position 0) is always visible, so no row's running max stays -inf after block 0.
    kv_end = tl.minimum(kv_len, prefix + (m_block + 1) * BLOCK_M)
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_len
        slots = tl.load(kv_indices + kv_start + offs_n, mask=n_mask, other=0).to(tl.int64)
        k_t = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
                      mask=n_mask[None, :], other=0.0)               # [HEAD_DIM, BLOCK_N]
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION) * sm_scale_log2
        visible = n_mask[None, :] & (offs_n[None, :] <= prefix + offs_m[:, None])
        qk = tl.where(visible, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=n_mask[:, None], other=0.0)                 # [BLOCK_N, HEAD_DIM]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(O + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_mask[:, None])
    if STORE_LSE:
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453               # log2 units -> natural
        tl.store(LSE + (q_start + offs_m) * stride_lt + head, lse, mask=m_mask)


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     sm_scale: float | None = None, *, max_new: int | None = None,
                     return_lse: bool = False, out: torch.Tensor | None = None,
                     block_m: int | None = None, block_n: int | None = None,
                     num_warps: int = 4, num_stages: int = 2):
    """Causal (lower-right) attention of new tokens over their cached prefix and themselves.

    Args:
        q: ``[total_new, num_heads, head_dim]`` fp32/fp16/bf16; head_dim a power of two >= 16.
        k_buf, v_buf: ``[num_slots + 1, num_kv_heads, head_dim]``, q's dtype; the new tokens'
            KV must already be stored (:func:`radix_kernels.store_kv`).
        qo_indptr: ``[batch + 1]`` int32/int64 offsets of each request's new tokens in ``q``.
        kv_indptr, kv_indices: request ``i``'s KV slots (prefix, then new tokens) are
            ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``.
        sm_scale: softmax scale, default ``1 / sqrt(head_dim)``.
        max_new: the largest ``new_i`` (known on the CPU when the step is planned); computed from
            ``qo_indptr`` (a device sync) when omitted.
        return_lse: also return the natural-log LSE ``[total_new, num_heads]`` fp32.
        out: optional preallocated output of q's shape and dtype.
        block_m, block_n: tile sizes (powers of two >= 16); default 64, or 32 for rows
            over 256 bytes (:func:`radix_kernels._util.default_block`).

    Returns ``o`` (q's shape and dtype), or ``(o, lse)``.

    Example::

        >>> import torch, radix_kernels
        >>> k_buf = torch.randn(9, 2, 16); v_buf = torch.randn(9, 2, 16)   # 8 slots + padding
        >>> q = torch.randn(3, 4, 16)                     # one request: 3 new tokens, 4 heads
        >>> qo_indptr = torch.tensor([0, 3]); kv_indptr = torch.tensor([0, 5])
        >>> kv_indices = torch.tensor([7, 2, 5, 1, 8])    # 2 cached + 3 new, any slot order
        >>> o = radix_kernels.extend_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices)
        >>> o.shape
        torch.Size([3, 4, 16])
    """
    group = check_attention_inputs(q, k_buf, v_buf)
    q = last_dim_contiguous(q)
    total, num_heads, head_dim = q.shape
    default = default_block(q.dtype, head_dim)
    block_m = check_block("block_m", default if block_m is None else block_m)
    block_n = check_block("block_n", default if block_n is None else block_n)
    batch = qo_indptr.numel() - 1
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with unit last stride, got "
                         f"{tuple(out.shape)} {out.dtype}")
    lse = torch.empty((total, num_heads) if return_lse else (1, 1), dtype=torch.float32,
                      device=q.device)
    if max_new is None:
        max_new = int((qo_indptr[1:] - qo_indptr[:-1]).max().item()) if batch > 0 else 0
    if total == 0 or max_new == 0:
        return (out, lse) if return_lse else out

    grid = (batch, num_heads, triton.cdiv(max_new, block_m))
    _extend_kernel[grid](
        q, k_buf, v_buf, out, lse, qo_indptr, kv_indptr, kv_indices,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype), STORE_LSE=return_lse,
        num_warps=num_warps, num_stages=num_stages,
    )
    return (out, lse) if return_lse else out
