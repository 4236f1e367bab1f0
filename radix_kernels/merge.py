"""Merge two partial attention states by their log-sum-exp — a Triton kernel.

Two attention results over disjoint key sets (say a shared prefix and a request's own suffix,
cascade-style) combine exactly: with ``m = max(lse_a, lse_b)``, ``w_x = exp(lse_x - m)``,
``o = (w_a o_a + w_b o_b) / (w_a + w_b)`` and ``lse = m + log(w_a + w_b)``. One program merges
one (token, head) row. A side with ``lse = -inf`` contributes nothing; two empty sides give
``o = 0, lse = -inf``.

Semantics are exactly :func:`radix_kernels.reference.merge_states`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    OA, LA, OB, LB, O, L, PLACES, KEEP,
    stride_oat, stride_oah, stride_lat, stride_lah,
    stride_obt, stride_obh, stride_lbt, stride_lbh,
    stride_ot, stride_oh, stride_lt, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GATHERED: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row_a = tok
    if GATHERED:  # side a's row of this token, and whether it has one
        row_a = tl.load(PLACES + tok)
    lse_a = tl.load(LA + row_a * stride_lat + head * stride_lah).to(tl.float32)
    lse_b = tl.load(LB + tok * stride_lbt + head * stride_lbh).to(tl.float32)
    o_a = tl.load(OA + row_a * stride_oat + head * stride_oah + offs_d, mask=d_mask, other=0.0)
    o_b = tl.load(OB + tok * stride_obt + head * stride_obh + offs_d, mask=d_mask, other=0.0)
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    total = w_a + w_b
    total_safe = tl.where(total > 0, total, 1.0)
    out = (o_a.to(tl.float32) * w_a + o_b.to(tl.float32) * w_b) / total_safe
    lse = tl.where(total > 0, m + tl.log(total_safe), float("-inf"))
    if GATHERED:  # a token without a side a keeps side b as it is (exactly: b's own values)
        keep = tl.load(KEEP + tok) != 0
        out = tl.where(keep, out, o_b.to(tl.float32))
        lse = tl.where(keep, lse, lse_b)
    tl.store(O + tok * stride_ot + head * stride_oh + offs_d, out.to(O.dtype.element_ty),
             mask=d_mask)
    tl.store(L + tok * stride_lt + head * stride_lh, lse)


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor, places: torch.Tensor | None = None,
                 keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention outputs over disjoint key sets.

    With ``places`` and ``keep`` (``[n]`` each: int, bool), token ``i``'s side a is row
    ``places[i]`` of ``o_a``/``lse_a`` (which may have any number of rows), and only where
    ``keep[i]``; elsewhere the result is side b exactly (cascade decoding: a request in no group
    keeps its own attention). One launch either way.

    Args:
        o_a, o_b: ``[n, num_heads, head_dim]`` (any float dtype, same for both).
        lse_a, lse_b: ``[n, num_heads]`` natural-log LSEs of the two parts (``-inf``: no keys).

    Returns ``(o, lse)``: ``o`` in ``o_a``'s dtype, ``lse`` fp32 — attention over the union.

    Example::

        >>> import torch, radix_kernels
        >>> o_a, o_b = torch.randn(3, 4, 16), torch.randn(3, 4, 16)
        >>> lse_a, lse_b = torch.randn(3, 4), torch.randn(3, 4)
        >>> o, lse = radix_kernels.merge_states(o_a, lse_a, o_b, lse_b)
        >>> o.shape, lse.shape
        (torch.Size([3, 4, 16]), torch.Size([3, 4]))
    """
    gathered = places is not None
    if gathered != (keep is not None):
        raise ValueError("places and keep go together (side a's row of each token, and "
                         "whether it has one)")
    rows_a = o_b.shape[0] if not gathered else o_a.shape[0]
    if o_a.dim() != 3 or o_a.shape[1:] != o_b.shape[1:] or o_a.shape[0] != rows_a \
            or lse_a.shape != o_a.shape[:2] or lse_b.shape != o_b.shape[:2] \
            or (gathered and (places.shape != (o_b.shape[0],) or keep.shape != places.shape)):
        raise ValueError(f"expected o_a, o_b [n, heads, dim] and lse_a, lse_b [n, heads] (o_a "
                         f"any rows with places, keep [n]), got {tuple(o_a.shape)}, "
                         f"{tuple(lse_a.shape)}, {tuple(o_b.shape)}, {tuple(lse_b.shape)}")
    if o_a.stride(-1) != 1:
        o_a = o_a.contiguous()
    if o_b.stride(-1) != 1:
        o_b = o_b.contiguous()
    n, num_heads, head_dim = o_b.shape
    o = torch.empty_like(o_b, dtype=o_a.dtype)
    lse = torch.empty((n, num_heads), dtype=torch.float32, device=o_a.device)
    if o.numel() == 0:
        return o, lse
    _merge_kernel[(n, num_heads)](
        o_a, lse_a, o_b, lse_b, o, lse, places if gathered else lse, keep if gathered else lse,
        o_a.stride(0), o_a.stride(1), lse_a.stride(0), lse_a.stride(1),
        o_b.stride(0), o_b.stride(1), lse_b.stride(0), lse_b.stride(1),
        o.stride(0), o.stride(1), lse.stride(0), lse.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), GATHERED=gathered,
    )
    return o, lse
