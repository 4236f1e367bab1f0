"""Cascade decode attention in two launches — the prefix and suffix passes in one, their merge
folded into the split-KV reduction.

A decode step whose requests share cached prefixes (`testbed.engine.cascade` plans it) reads
each group's prefix once, for all its members' queries, and each request's own suffix; the two
partial results merge exactly by their log-sum-exps. Composed of the plain kernels that takes
the suffix pass (split + reduce), the prefix pass (split + reduce), a gather of the members'
queries and the merge: seven launches and copies a layer. Here:

- Stage 1, grid ``(B · suffix_splits + G · prefix_splits, num_kv_heads)``: a program is either
  one chunk of one request's suffix (its GQA group of query rows), or one chunk of one group's
  prefix, whose query rows are the group's ``W`` member places times the GQA group, each row's
  query read from its member's row of ``q`` (``gather``: no copy of the queries). Each writes
  its rows' softmax-normalised partial output and log-sum-exp, the suffix's per request, the
  prefix's per member place. The programs of both passes share one grid, so a short suffix pass
  does not leave the device idle while the prefix pass waits for a launch of its own.
- Stage 2, grid ``(B, num_heads)``: request ``i``'s suffix chunks and, where ``grouped[i]``, the
  prefix chunks of its member place ``places[i]``, combined by their log-sum-exps in one pass:
  the split-KV reduction and the cascade merge are one step. A request in no group reduces its
  own chunks alone (plain decode's result).

A member place past a narrower group's end repeats the group's first member (`gather`), a
padded group (a CUDA graph's) reads one key; no request reads their rows. Semantics:
:func:`radix_kernels.reference.cascade_decode_attention` (plain decode over each request's whole
KV, to rounding).
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
def _cascade_split_kernel(
    Q, K, V, MID_O, MID_LSE,
    s_indptr, s_indices, p_indptr, p_indices, gather,
    sm_scale_log2, num_requests, suffix_splits, prefix_splits, width, prefix_base,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    after = pid - num_requests * suffix_splits  # >= 0: a program of the prefix pass
    is_prefix = after >= 0
    after = tl.maximum(after, 0)
    group = after // prefix_splits
    req = tl.minimum(pid // suffix_splits, num_requests - 1)
    splits = tl.where(is_prefix, prefix_splits, suffix_splits)
    split = tl.where(is_prefix, after % prefix_splits, pid % suffix_splits)
    # the program's KV range: its request's suffix, or its group's prefix
    s_start = tl.load(s_indptr + req, mask=~is_prefix, other=0).to(tl.int64)
    s_end = tl.load(s_indptr + req + 1, mask=~is_prefix, other=0).to(tl.int64)
    p_start = tl.load(p_indptr + group, mask=is_prefix, other=0).to(tl.int64)
    p_end = tl.load(p_indptr + group + 1, mask=is_prefix, other=0).to(tl.int64)
    kv_start = tl.where(is_prefix, p_start, s_start)
    kv_len = tl.where(is_prefix, p_end, s_end) - kv_start
    split_len = tl.cdiv(kv_len, splits)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)

    # query rows: (member place w, GQA head r) -> row w * GROUP + r; a suffix program has one place
    offs_r = tl.arange(0, BLOCK_H)
    member = offs_r // GROUP
    r_mask = offs_r < tl.where(is_prefix, width * GROUP, GROUP)
    place = group * width + member
    # masks combine as integer bounds (a block's mask and a scalar flag do not `&` in the
    # interpreter): a suffix program reads no member place, a prefix program no suffix slot
    rows = tl.load(gather + place, mask=offs_r < tl.where(is_prefix, width * GROUP, 0),
                   other=0).to(tl.int64)
    rows = tl.where(is_prefix, rows, req)
    heads = kv_head * GROUP + offs_r % GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=r_mask[:, None], other=0.0)                       # [BLOCK_H, HEAD_DIM]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        at = kv_start + offs_n
        slots = tl.load(s_indices + at, mask=offs_n < tl.where(is_prefix, 0, hi), other=0) \
            + tl.load(p_indices + at, mask=offs_n < tl.where(is_prefix, hi, 0), other=0)
        slots = slots.to(tl.int64)
        m_i, l_i, acc = paged_tile(q, K, V, slots, n_mask, kv_head, offs_d, stride_ks,
                                   stride_kh, stride_vs, stride_vh, sm_scale_log2, m_i, l_i,
                                   acc, DOT_PRECISION)

    part, lse = partial_result(m_i, l_i, acc)
    # where the partial goes: [B, H, suffix_splits] then [G * W, H, prefix_splits], rows of D
    out_row = tl.where(is_prefix, prefix_base + (place * NUM_HEADS + heads) * prefix_splits,
                       (req * NUM_HEADS + heads) * suffix_splits) + split
    out_row = out_row.to(tl.int64)
    tl.store(MID_O + out_row[:, None] * HEAD_DIM + offs_d[None, :], part, mask=r_mask[:, None])
    tl.store(MID_LSE + out_row, lse, mask=r_mask)


@triton.jit
def _cascade_reduce_kernel(
    MID_O, MID_LSE, O, LSE, places, grouped,
    suffix_splits, prefix_splits, prefix_base,
    stride_ob, stride_oh, stride_eb,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_P: tl.constexpr, STORE_LSE: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < suffix_splits
    s_rows = (req.to(tl.int64) * NUM_HEADS + head) * suffix_splits + offs_s
    offs_p = tl.arange(0, BLOCK_P)
    in_group = tl.load(grouped + req) != 0
    p_mask = offs_p < tl.where(in_group, prefix_splits, 0)
    place = tl.load(places + req).to(tl.int64)
    p_rows = prefix_base + (place * NUM_HEADS + head) * prefix_splits + offs_p
    lse_s = tl.load(MID_LSE + s_rows, mask=s_mask, other=float("-inf"))
    lse_p = tl.load(MID_LSE + p_rows, mask=p_mask, other=float("-inf"))
    o_s = tl.load(MID_O + s_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None],
                  other=0.0)                                           # [BLOCK_S, HEAD_DIM]
    o_p = tl.load(MID_O + p_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=p_mask[:, None],
                  other=0.0)                                           # [BLOCK_P, HEAD_DIM]
    m = tl.maximum(tl.max(lse_s, 0), tl.max(lse_p, 0))
    m = tl.where(m == float("-inf"), 0.0, m)                 # every chunk empty: weights are 0
    w_s = tl.exp(lse_s - m)
    w_p = tl.exp(lse_p - m)
    total = tl.sum(w_s, 0) + tl.sum(w_p, 0)
    total_safe = tl.where(total > 0, total, 1.0)
    out = (tl.sum(o_s * w_s[:, None], 0) + tl.sum(o_p * w_p[:, None], 0)) / total_safe
    tl.store(O + req * stride_ob + head * stride_oh + offs_d, out.to(O.dtype.element_ty))
    if STORE_LSE:
        lse_out = tl.where(total > 0, m + tl.log(total_safe), float("-inf"))
        tl.store(LSE + req * stride_eb + head, lse_out)


def cascade_decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                             suffix_indptr: torch.Tensor, suffix_indices: torch.Tensor,
                             prefix_indptr: torch.Tensor, prefix_indices: torch.Tensor,
                             gather: torch.Tensor, places: torch.Tensor, grouped: torch.Tensor,
                             sm_scale: float | None = None, *, suffix_splits: int = 8,
                             prefix_splits: int = 32, return_lse: bool = False,
                             out: torch.Tensor | None = None, block_n: int | None = None,
                             num_warps: int = 4, num_stages: int = 2):
    """One query per request over its KV, shared prefixes read once per group, in two launches.

    Args:
        q: ``[B, num_heads, head_dim]`` fp32/fp16/bf16; head_dim a power of two >= 16.
        k_buf, v_buf: ``[num_slots + 1, num_kv_heads, head_dim]``, q's dtype.
        suffix_indptr, suffix_indices: request ``i``'s own KV slots (all of its KV when it is
            in no group; at least one: its new token).
        prefix_indptr, prefix_indices: group ``g``'s shared prefix slots (at least one).
        gather: ``[G * W]`` the request of each member place (group ``g``'s places
            ``g·W .. g·W + W − 1``; a narrower group repeats a member there).
        places, grouped: ``[B]`` request ``i``'s member place, and whether it has one.
        suffix_splits, prefix_splits: split-KV chunks of each pass (fixed per call: a static
            launch shape, so a CUDA graph replays it).
        return_lse: also return the natural-log LSE ``[B, num_heads]`` fp32.
        block_n: KV tile (power of two >= 16); default as `decode_attention`'s.

    The prefix pass's programs hold ``W · (num_heads / num_kv_heads)`` query rows (padded to a
    power of two >= 16): the caller keeps that to what a program's registers hold (64 in the
    engine, `testbed.engine.cascade.split_wide`).

    Returns ``o`` (q's shape and dtype), or ``(o, lse)``.

    Example::

        >>> import torch, radix_kernels
        >>> k_buf, v_buf = torch.randn(9, 2, 16), torch.randn(9, 2, 16)
        >>> q = torch.randn(3, 4, 16)          # 3 requests; the first two share slots 1, 2
        >>> suffix = torch.tensor([0, 1, 3, 6]), torch.tensor([3, 4, 5, 6, 7, 8])
        >>> prefix = torch.tensor([0, 2]), torch.tensor([1, 2])
        >>> o = radix_kernels.cascade_decode_attention(
        ...     q, k_buf, v_buf, *suffix, *prefix, gather=torch.tensor([0, 1]),
        ...     places=torch.tensor([0, 1, 0]), grouped=torch.tensor([True, True, False]))
        >>> o.shape
        torch.Size([3, 4, 16])
    """
    group = check_attention_inputs(q, k_buf, v_buf)
    if block_n is None:
        block_n = default_block(q.dtype, q.shape[-1])
    check_block("block_n", block_n)
    if suffix_splits < 1 or prefix_splits < 1:
        raise ValueError(f"suffix_splits and prefix_splits must be >= 1, got {suffix_splits}, "
                         f"{prefix_splits}")
    q = last_dim_contiguous(q)
    batch, num_heads, head_dim = q.shape
    num_groups = prefix_indptr.numel() - 1
    if num_groups < 1 or gather.numel() % num_groups:
        raise ValueError(f"gather must hold W member places for each of the {num_groups} "
                         f"groups (at least one), got {gather.numel()}")
    if places.shape != (batch,) or grouped.shape != (batch,) \
            or suffix_indptr.numel() != batch + 1:
        raise ValueError(f"suffix_indptr [{batch + 1}], places and grouped [{batch}] expected, "
                         f"got {tuple(suffix_indptr.shape)}, {tuple(places.shape)}, "
                         f"{tuple(grouped.shape)}")
    width = gather.numel() // num_groups
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out, lse = attention_outputs(q, out, return_lse)
    if batch == 0:
        return (out, lse) if return_lse else out
    prefix_base = batch * num_heads * suffix_splits  # the prefix pass's rows follow the suffix's
    rows = prefix_base + gather.numel() * num_heads * prefix_splits
    mid_o = torch.empty((rows, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(rows, dtype=torch.float32, device=q.device)
    programs = batch * suffix_splits + num_groups * prefix_splits
    _cascade_split_kernel[(programs, k_buf.shape[1])](
        q, k_buf, v_buf, mid_o, mid_lse, suffix_indptr, suffix_indices, prefix_indptr,
        prefix_indices, gather, sm_scale * _LOG2E, batch, suffix_splits, prefix_splits, width,
        prefix_base, q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(width * group)), BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    _cascade_reduce_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, lse, places, grouped, suffix_splits, prefix_splits, prefix_base,
        out.stride(0), out.stride(1), lse.stride(0),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(suffix_splits),
        BLOCK_P=triton.next_power_of_2(prefix_splits), STORE_LSE=return_lse,
    )
    return (out, lse) if return_lse else out
