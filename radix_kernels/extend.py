"""Extend (prefill) attention over paged KV with a cached prefix — a Triton kernel on the pattern
of Triton's fused-attention tutorial.

One program handles ``BLOCK_M`` new tokens of one request for one query head (GQA: query head
``h`` reads KV head ``h // group``) and keeps a flash-attention online softmax in log2 units
(``exp2``, with ``log2(e)`` folded into the scale once), in two stages:

1. the cached prefix, read from the paged pool (each ``BLOCK_N`` keys' slot ids gathered from
   ``kv_indices``), which every new token sees: no causal mask; only the prefix's last tile is
   bounded;
2. the new tokens themselves, causal: the tiles wholly below the diagonal unmasked, and only the
   diagonal tiles (keys ``m0 ..`` of the program's rows ``m0 .. m0 + BLOCK_M``) masked ``j <= i``.
   Their keys and values come from ``k_new``/``v_new`` when the caller has them contiguous
   (``[total_new, kv_heads, head_dim]``, any row stride: the step's own K and V, as SDPA reads
   them), else from the pool where the step stored them.

The query and output tiles (and with ``k_new``/``v_new`` the new keys and values) are affine
tiles of the step's tensors; with ``descriptors=True`` they are read and written through tensor
descriptors (TMA on a GPU that has it; Triton 3.9 removed block pointers in their favour).
``num_stages`` is a launch setting (software pipelining of the KV loop). New token ``j`` of a
request with a cached prefix of ``P`` tokens thus sees KV positions ``<= P + j``: the causal
mask aligned to the lower right.

Semantics are exactly :func:`radix_kernels.reference.extend_attention`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._util import (attention_outputs, check_attention_inputs, check_block, default_block,
                    dot_precision, last_dim_contiguous)

_LOG2E = 1.4426950408889634


@triton.jit
def _softmax_tile(q, k_t, v, qk_scale, m_i, l_i, acc, visible, MASKED: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """One tile of the online softmax; ``visible`` applies only where ``MASKED`` (each row sees
    at least one key of a masked tile, so no running max stays -inf)."""
    qk = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_kv(K, V, kv_indices, at, n_mask, kv_head, offs_d, stride_ks, stride_kh, stride_vs,
              stride_vh, BOUNDED: tl.constexpr):
    """K transposed ``[D, BLOCK_N]`` and V ``[BLOCK_N, D]`` of the pool rows whose slot ids are
    at ``kv_indices[at]`` (``n_mask`` bounds them only where ``BOUNDED``)."""
    if BOUNDED:
        slots = tl.load(kv_indices + at, mask=n_mask, other=0).to(tl.int64)
        k_t = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
                      mask=n_mask[None, :], other=0.0)
        v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=n_mask[:, None], other=0.0)
    else:
        slots = tl.load(kv_indices + at).to(tl.int64)
        k_t = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None])
        v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :])
    return k_t, v


@triton.jit
def _new_kv(K, V, KN, VN, kv_indices, kv_at, row0, offs_n, n_mask, kv_head, offs_d, stride_ks,
            stride_kh, stride_vs, stride_vh, stride_knt, stride_knh, stride_vnt, stride_vnh,
            q_end, BOUNDED: tl.constexpr, NEW_CONTIGUOUS: tl.constexpr,
            DESCRIPTORS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """The new tokens' K (transposed) and V of one tile: rows ``row0 ..`` of ``k_new``/``v_new``
    (the step's token order; past the request's end ``q_end`` zeros or masked), or where they
    were stored in the pool (``kv_indices[kv_at]``)."""
    if NEW_CONTIGUOUS:
        rows = row0 + offs_n
        if DESCRIPTORS:
            k_desc = tl.make_tensor_descriptor(KN + kv_head * stride_knh, shape=[q_end, HEAD_DIM],
                                               strides=[stride_knt, 1],
                                               block_shape=[BLOCK_N, HEAD_DIM])
            v_desc = tl.make_tensor_descriptor(VN + kv_head * stride_vnh, shape=[q_end, HEAD_DIM],
                                               strides=[stride_vnt, 1],
                                               block_shape=[BLOCK_N, HEAD_DIM])
            k_t = tl.trans(k_desc.load([row0.to(tl.int32), 0]))
            v = v_desc.load([row0.to(tl.int32), 0])
        elif BOUNDED:
            k_t = tl.load(KN + rows[None, :] * stride_knt + kv_head * stride_knh
                          + offs_d[:, None], mask=n_mask[None, :], other=0.0)
            v = tl.load(VN + rows[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :],
                        mask=n_mask[:, None], other=0.0)
        else:
            k_t = tl.load(KN + rows[None, :] * stride_knt + kv_head * stride_knh + offs_d[:, None])
            v = tl.load(VN + rows[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :])
    else:
        k_t, v = _paged_kv(K, V, kv_indices, kv_at, n_mask, kv_head, offs_d, stride_ks,
                           stride_kh, stride_vs, stride_vh, BOUNDED)
    return k_t, v


@triton.jit
def _extend_kernel(
    Q, K, V, KN, VN, O, LSE,
    qo_indptr, kv_indptr, kv_indices,
    qk_scale,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ot, stride_oh, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, STORE_LSE: tl.constexpr, NEW_CONTIGUOUS: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)

    q_start = tl.load(qo_indptr + req).to(tl.int64)
    q_len = tl.load(qo_indptr + req + 1).to(tl.int64) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    kv_start = tl.load(kv_indptr + req).to(tl.int64)
    prefix = tl.load(kv_indptr + req + 1).to(tl.int64) - kv_start - q_len
    kv_head = head // GROUP
    q_end = q_start + q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)                      # query rows among the new tokens
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    if DESCRIPTORS:
        q_desc = tl.make_tensor_descriptor(Q + head * stride_qh, shape=[q_end, HEAD_DIM],
                                           strides=[stride_qt, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        q = q_desc.load([(q_start + m0).to(tl.int32), 0])
    else:
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
                    + offs_d[None, :], mask=m_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # 1. the cached prefix: every new token sees all of it; only its last tile is bounded
    whole = (prefix // BLOCK_N) * BLOCK_N
    for start in range(0, whole, BLOCK_N):
        k_t, v = _paged_kv(K, V, kv_indices, kv_start + start + offs_n, offs_n < BLOCK_N,
                           kv_head, offs_d, stride_ks, stride_kh, stride_vs, stride_vh, False)
        m_i, l_i, acc = _softmax_tile(q, k_t, v, qk_scale, m_i, l_i, acc, offs_n, False,
                                      DOT_PRECISION)
    if whole < prefix:
        n_mask = whole + offs_n < prefix
        k_t, v = _paged_kv(K, V, kv_indices, kv_start + whole + offs_n, n_mask, kv_head,
                           offs_d, stride_ks, stride_kh, stride_vs, stride_vh, True)
        m_i, l_i, acc = _softmax_tile(q, k_t, v, qk_scale, m_i, l_i, acc, n_mask[None, :],
                                      True, DOT_PRECISION)

    # 2. the new tokens: tiles wholly below the diagonal unmasked, the diagonal ones causal
    diagonal = (m0 // BLOCK_N) * BLOCK_N
    for start in range(0, diagonal, BLOCK_N):
        j = start + offs_n
        k_t, v = _new_kv(K, V, KN, VN, kv_indices, kv_start + prefix + j, q_start + start,
                         offs_n, j < q_len, kv_head, offs_d, stride_ks, stride_kh, stride_vs,
                         stride_vh, stride_knt, stride_knh, stride_vnt, stride_vnh, q_end, False,
                         NEW_CONTIGUOUS, DESCRIPTORS, HEAD_DIM, BLOCK_N)
        m_i, l_i, acc = _softmax_tile(q, k_t, v, qk_scale, m_i, l_i, acc, offs_n, False,
                                      DOT_PRECISION)
    for start in range(diagonal, tl.minimum(m0 + BLOCK_M, q_len), BLOCK_N):
        j = start + offs_n
        n_mask = j < q_len
        k_t, v = _new_kv(K, V, KN, VN, kv_indices, kv_start + prefix + j, q_start + start,
                         offs_n, n_mask, kv_head, offs_d, stride_ks, stride_kh, stride_vs,
                         stride_vh, stride_knt, stride_knh, stride_vnt, stride_vnh, q_end, True,
                         NEW_CONTIGUOUS, DESCRIPTORS, HEAD_DIM, BLOCK_N)
        visible = n_mask[None, :] & (j[None, :] <= offs_m[:, None])
        m_i, l_i, acc = _softmax_tile(q, k_t, v, qk_scale, m_i, l_i, acc, visible, True,
                                      DOT_PRECISION)

    out = (acc / l_i[:, None]).to(O.dtype.element_ty)
    if DESCRIPTORS:
        o_desc = tl.make_tensor_descriptor(O + head * stride_oh, shape=[q_end, HEAD_DIM],
                                           strides=[stride_ot, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        o_desc.store([(q_start + m0).to(tl.int32), 0], out)
    else:
        tl.store(O + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
                 + offs_d[None, :], out, mask=m_mask[:, None])
    if STORE_LSE:
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453               # log2 units -> natural
        tl.store(LSE + (q_start + offs_m) * stride_lt + head, lse, mask=m_mask)


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the tensor descriptors a kernel makes on the device (Triton asks for
    it through `triton.set_allocator` when a kernel calls ``tl.make_tensor_descriptor``)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     sm_scale: float | None = None, *, max_new: int | None = None,
                     return_lse: bool = False, out: torch.Tensor | None = None,
                     k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                     block_m: int | None = None, block_n: int | None = None,
                     num_warps: int = 4, num_stages: int = 2, descriptors: bool = False):
    """Causal (lower-right) attention of new tokens over their cached prefix and themselves.

    Args:
        q: ``[total_new, num_heads, head_dim]`` fp32/fp16/bf16; head_dim a power of two >= 16.
        k_buf, v_buf: ``[num_slots + 1, num_kv_heads, head_dim]``, q's dtype: the cached
            prefixes, and the new tokens' KV (stored already, :func:`radix_kernels.store_kv`)
            unless ``k_new``/``v_new`` are given.
        qo_indptr: ``[batch + 1]`` int32/int64 offsets of each request's new tokens in ``q``.
        kv_indptr, kv_indices: request ``i``'s KV slots (prefix, then new tokens) are
            ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``.
        sm_scale: softmax scale, default ``1 / sqrt(head_dim)``.
        max_new: the largest ``new_i`` (known on the CPU when the step is planned); computed from
            ``qo_indptr`` (a device sync) when omitted.
        return_lse: also return the natural-log LSE ``[total_new, num_heads]`` fp32.
        out: optional preallocated output of q's shape and dtype.
        k_new, v_new: the new tokens' K and V ``[total_new, num_kv_heads, head_dim]`` (unit
            last stride), in ``q``'s token order: read there instead of the pool.
        block_m, block_n: tile sizes (powers of two >= 16); default 64, or 32 for rows
            over 256 bytes (:func:`radix_kernels._util.default_block`).
        num_warps, num_stages: launch settings (``num_stages``: the KV loop's pipeline depth).
        descriptors: read q (and ``k_new``/``v_new``) and write the output through tensor
            descriptors (TMA where the GPU has it) instead of pointer tiles.

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
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together (the new tokens' K and V)")
    if k_new is not None and (k_new.shape != (total, k_buf.shape[1], head_dim)
                              or v_new.shape != k_new.shape or k_new.dtype != q.dtype
                              or v_new.dtype != q.dtype or k_new.stride(-1) != 1
                              or v_new.stride(-1) != 1):
        raise ValueError(f"k_new and v_new must be [{total}, {k_buf.shape[1]}, {head_dim}] "
                         f"{q.dtype} with unit last stride, got {tuple(k_new.shape)} "
                         f"{k_new.dtype}, {tuple(v_new.shape)} {v_new.dtype}")
    default = default_block(q.dtype, head_dim)
    block_m = check_block("block_m", default if block_m is None else block_m)
    block_n = check_block("block_n", default if block_n is None else block_n)
    batch = qo_indptr.numel() - 1
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out, lse = attention_outputs(q, out, return_lse)
    if max_new is None:
        max_new = int((qo_indptr[1:] - qo_indptr[:-1]).max().item()) if batch > 0 else 0
    if total == 0 or max_new == 0:
        return (out, lse) if return_lse else out
    if descriptors and q.is_cuda:
        triton.set_allocator(_descriptor_scratch)
    new = (k_new, v_new) if k_new is not None else (k_buf, v_buf)  # unread when from the pool
    grid = (batch, num_heads, triton.cdiv(max_new, block_m))
    _extend_kernel[grid](
        q, k_buf, v_buf, *new, out, lse, qo_indptr, kv_indptr, kv_indices,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), new[0].stride(0), new[0].stride(1),
        new[1].stride(0), new[1].stride(1), out.stride(0), out.stride(1), lse.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype), STORE_LSE=return_lse,
        NEW_CONTIGUOUS=k_new is not None, DESCRIPTORS=descriptors,
        num_warps=num_warps, num_stages=num_stages,
    )
    return (out, lse) if return_lse else out
