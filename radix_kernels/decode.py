"""Decode attention over paged KV with split-KV — two Triton kernels.

Decode has one query per request, so there is little parallelism across queries; split-KV
(flash-decoding) adds it across the KV length instead.

- Stage 1, grid ``(batch, num_kv_heads, num_kv_splits)``: a program takes one request, one KV
  head and one contiguous chunk of the request's KV, and computes, for every query head sharing
  that KV head (the GQA group, padded to ``BLOCK_H >= 16`` rows so ``tl.dot`` compiles), the
  softmax-normalised partial output and its log-sum-exp. Each KV row is read once per KV head.
  An empty chunk (a short request) writes ``o = 0, lse = -inf``.
- Stage 2, grid ``(batch, num_heads)``: merges the chunks' partial results with their LSEs.

Semantics are exactly :func:`radix_kernels.reference.decode_attention`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._paged import paged_tile, partial_result
from ._util import (attention_outputs, check_attention_inputs, check_block, default_block,
                    dot_precision, last_dim_contiguous)

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    Q, K, V, MID_O, MID_LSE,
    kv_indptr, kv_indices,
    sm_scale_log2,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    kv_start = tl.load(kv_indptr + req).to(tl.int64)
    kv_len = tl.load(kv_indptr + req + 1).to(tl.int64) - kv_start
    split_len = tl.cdiv(kv_len, NUM_SPLITS)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None], other=0.0)                      # [BLOCK_H, HEAD_DIM]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slots = tl.load(kv_indices + kv_start + offs_n, mask=n_mask, other=0).to(tl.int64)
        m_i, l_i, acc = paged_tile(q, K, V, slots, n_mask, kv_head, offs_d, stride_ks,
                                   stride_kh, stride_vs, stride_vh, sm_scale_log2, m_i, l_i,
                                   acc, DOT_PRECISION)

    part, lse = partial_result(m_i, l_i, acc)
    tl.store(MID_O + req * stride_mb + heads[:, None] * stride_mh + split * stride_ms
             + offs_d[None, :], part, mask=h_mask[:, None])
    tl.store(MID_LSE + req * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    MID_O, MID_LSE, O, LSE,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh, stride_eb,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(MID_LSE + req * stride_lb + head * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    part = tl.load(MID_O + req * stride_mb + head * stride_mh + offs_s[:, None] * stride_ms
                   + offs_d[None, :], mask=s_mask[:, None], other=0.0)  # [BLOCK_S, HEAD_DIM]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)                 # all splits empty: weights are 0
    w = tl.exp(lse - m)
    total = tl.sum(w, 0)
    total_safe = tl.where(total > 0, total, 1.0)
    out = tl.sum(part * w[:, None], 0) / total_safe
    tl.store(O + req * stride_ob + head * stride_oh + offs_d, out.to(O.dtype.element_ty))
    if STORE_LSE:
        lse_out = tl.where(total > 0, m + tl.log(total_safe), float("-inf"))
        tl.store(LSE + req * stride_eb + head, lse_out)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     sm_scale: float | None = None, *, num_kv_splits: int = 8,
                     return_lse: bool = False, out: torch.Tensor | None = None,
                     block_n: int | None = None, num_warps: int = 4, num_stages: int = 2):
    """Attention of one new token per request over all its KV (prefix + itself), split-KV.

    Args:
        q: ``[batch, num_heads, head_dim]``, fp32/fp16/bf16; head_dim a power of two >= 16.
        k_buf, v_buf: ``[num_slots + 1, num_kv_heads, head_dim]``, q's dtype; the new token's KV
            must already be stored.
        kv_indptr, kv_indices: request ``i``'s KV slots are
            ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`` (at least one, its own).
        sm_scale: softmax scale, default ``1 / sqrt(head_dim)``.
        num_kv_splits: chunks each request's KV is split into (stage 1 parallelism); fixed per
            call, so no device sync and a static launch shape.
        return_lse: also return the natural-log LSE ``[batch, num_heads]`` fp32.
        out: optional preallocated output of q's shape and dtype.
        block_n: KV tile (power of two >= 16); default 64, or 32 for rows over 256 bytes.

    Returns ``o`` (q's shape and dtype), or ``(o, lse)``.

    Example::

        >>> import torch, radix_kernels
        >>> k_buf = torch.randn(9, 2, 16); v_buf = torch.randn(9, 2, 16)
        >>> q = torch.randn(2, 4, 16)                          # 2 requests, 4 heads, GQA group 2
        >>> kv_indptr = torch.tensor([0, 3, 8])
        >>> kv_indices = torch.tensor([4, 1, 6, 2, 3, 8, 7, 5])
        >>> radix_kernels.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices).shape
        torch.Size([2, 4, 16])
    """
    group = check_attention_inputs(q, k_buf, v_buf)
    if block_n is None:
        block_n = default_block(q.dtype, q.shape[-1])
    check_block("block_n", block_n)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    q = last_dim_contiguous(q)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out, lse = attention_outputs(q, out, return_lse)
    if batch == 0:
        return (out, lse) if return_lse else out

    mid_o = torch.empty((batch, num_heads, num_kv_splits, head_dim), dtype=torch.float32,
                        device=q.device)
    mid_lse = torch.empty((batch, num_heads, num_kv_splits), dtype=torch.float32,
                          device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, num_kv_splits)](
        q, k_buf, v_buf, mid_o, mid_lse, kv_indptr, kv_indices,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, NUM_SPLITS=num_kv_splits, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, lse,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        HEAD_DIM=head_dim, NUM_SPLITS=num_kv_splits,
        BLOCK_S=triton.next_power_of_2(num_kv_splits), STORE_LSE=return_lse,
    )
    return (out, lse) if return_lse else out
