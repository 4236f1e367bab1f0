"""Triton helpers the paged decode kernels share (`decode`, `cascade`): one KV tile of an online
softmax, and a chunk's partial result. Called from inside ``@triton.jit`` kernels (inlined)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_tile(q, K, V, slots, n_mask, kv_head, offs_d, stride_ks, stride_kh, stride_vs,
               stride_vh, sm_scale_log2, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """The online softmax over one tile of keys: ``q [rows, D]`` against the KV rows ``slots``
    (``n_mask``: which are keys; the tile's first always is) of one KV head, in log2 units.
    Returns the running max, sum and fp32 accumulator."""
    k_t = tl.load(K + slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
                  mask=n_mask[None, :], other=0.0)                   # [HEAD_DIM, BLOCK_N]
    qk = tl.dot(q, k_t, input_precision=DOT_PRECISION) * sm_scale_log2
    qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                mask=n_mask[:, None], other=0.0)                     # [BLOCK_N, HEAD_DIM]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def partial_result(m_i, l_i, acc):
    """A chunk's softmax-normalised output and natural-log LSE; an empty chunk (no key seen)
    gives ``0`` and ``-inf``, which a merge weighs 0."""
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    part = tl.where(nonempty[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    return part, lse
