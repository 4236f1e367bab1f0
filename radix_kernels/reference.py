"""Torch references for the kernels: readable, slow, trusted.

These are the definitions the Triton kernels are tested against, and the engine's ``torch``
attention backend calls them directly. Attention is computed in fp32 and returned in the query's
dtype. The decoder-layer kernels (`fused_add_rmsnorm`, `silu_and_mul`, `rope_store_kv`) compute
as HF Llama does in the activations' dtype: each elementwise op rounded to that dtype, as torch
rounds it.

Layout (FlashInfer style, built once per step on the CPU and shared by every layer):

- ``k_buf, v_buf``: ``[num_slots + 1, num_kv_heads, head_dim]`` per layer; slot 0 is padding.
- ``qo_indptr``: ``[batch + 1]``; request ``i``'s new (query) tokens are
  ``q[qo_indptr[i]:qo_indptr[i + 1]]``.
- ``kv_indptr`` / ``kv_indices``: request ``i``'s KV slots are
  ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`` — its cached prefix, then its new tokens, so the
  KV length is ``prefix_i + new_i`` (the new tokens' KV is stored before attention runs).
- GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (HF ``repeat_kv``).
- Causal mask, lower-right aligned: new token ``j`` (0-based among request ``i``'s new tokens) sees
  KV positions ``< prefix_i + j + 1``. (SDPA's ``is_causal=True`` is top-left aligned: wrong here.)
- LSE is the natural log of the sum of ``exp(sm_scale * q·k)`` over the keys a query sees;
  ``-inf`` for a query that sees none.
"""

from __future__ import annotations

import math

import torch

__all__ = ["store_kv", "extend_attention", "decode_attention", "merge_states", "copy_kv_rotated",
           "fused_add_rmsnorm", "silu_and_mul", "rope_store_kv"]


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write new tokens' ``k, v`` (``[n, num_kv_heads, head_dim]``) into the buffers at ``slots``.

    ``slots`` is ``[n]`` int32/int64; values are cast to the buffers' dtype.
    """
    idx = slots.long()
    k_buf[idx] = k.to(k_buf.dtype)
    v_buf[idx] = v.to(v_buf.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, sm_scale: float):
    """One request: q ``[n, H, D]``, k/v ``[L, KH, D]`` (fp32), ``L = prefix + n``. -> (o, lse)."""
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)                    # [L, H, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * sm_scale   # [H, n, L]
    pos = torch.arange(k.shape[0], device=q.device)
    last_visible = prefix + torch.arange(n, device=q.device)  # query j sees pos <= prefix + j
    scores = scores.masked_fill(pos[None, None, :] > last_visible[None, :, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                    # [H, n]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a query seeing nothing -> 0
    out = torch.einsum("hnl,lhd->nhd", probs, v)
    return out, lse.transpose(0, 1)                          # [n, H, D], [n, H]


def _check(q, k_buf, v_buf):
    if q.dim() != 3 or k_buf.dim() != 3 or v_buf.shape != k_buf.shape:
        raise ValueError(f"expected q [tokens, heads, dim] and k_buf == v_buf shape "
                         f"[slots, kv_heads, dim], got {tuple(q.shape)}, {tuple(k_buf.shape)}, "
                         f"{tuple(v_buf.shape)}")
    if q.shape[2] != k_buf.shape[2] or q.shape[1] % k_buf.shape[1]:
        raise ValueError(f"head_dim must match and num_heads must be a multiple of num_kv_heads, "
                         f"got q {tuple(q.shape)} and k_buf {tuple(k_buf.shape)}")


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     sm_scale: float | None = None, return_lse: bool = False):
    """Causal (lower-right) attention of each request's new tokens over its prefix + new tokens.

    ``q``: ``[total_new, num_heads, head_dim]``. Returns ``o`` of q's shape and dtype, and with
    ``return_lse`` also ``lse`` ``[total_new, num_heads]`` fp32.
    """
    _check(q, k_buf, v_buf)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    for i in range(len(qo) - 1):
        q0, q1, k0, k1 = qo[i], qo[i + 1], kvp[i], kvp[i + 1]
        if q1 == q0:
            continue
        if k1 - k0 < q1 - q0:
            raise ValueError(f"request {i}: KV length {k1 - k0} < new tokens {q1 - q0}; "
                             f"kv_indices must hold the prefix and the new tokens")
        slots = kv_indices[k0:k1].long()
        o_i, lse_i = _attend(q[q0:q1].float(), k_buf[slots].float(), v_buf[slots].float(),
                             (k1 - k0) - (q1 - q0), sm_scale)
        out[q0:q1], lse[q0:q1] = o_i, lse_i
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     sm_scale: float | None = None, return_lse: bool = False):
    """One query per request (``q``: ``[batch, num_heads, head_dim]``) over all its KV.

    The same as :func:`extend_attention` with ``qo_indptr = arange(batch + 1)``.
    """
    qo_indptr = torch.arange(q.shape[0] + 1, device=kv_indptr.device)
    return extend_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, sm_scale,
                            return_lse)


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
                 places: torch.Tensor | None = None, keep: torch.Tensor | None = None):
    """Merge two partial attention results over disjoint key sets (the split-KV merge).

    ``o_*``: ``[n, heads, dim]``; ``lse_*``: ``[n, heads]``. Returns ``(o, lse)``: attention over
    the union of both key sets. A side with ``lse = -inf`` (no keys) contributes nothing; if both
    are empty the output is 0 and ``lse = -inf``. With ``places`` and ``keep`` (``[n]``), token
    ``i``'s side a is row ``places[i]`` of ``o_a``, and only where ``keep[i]``; elsewhere the
    result is side b exactly.
    """
    if places is not None:
        o, lse = merge_states(o_a.index_select(0, places), lse_a.index_select(0, places), o_b,
                              lse_b)
        keep = keep.bool()
        return (torch.where(keep[:, None, None], o, o_b.to(o.dtype)),
                torch.where(keep[:, None], lse, lse_b.float()))
    lse_a, lse_b = lse_a.float(), lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    safe = torch.where(total > 0, total, torch.ones_like(total))
    o = (o_a.float() * w_a[..., None] + o_b.float() * w_b[..., None]) / safe[..., None]
    return o.to(o_a.dtype), m + torch.log(total)


def cascade_decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                             suffix_indptr: torch.Tensor, suffix_indices: torch.Tensor,
                             prefix_indptr: torch.Tensor, prefix_indices: torch.Tensor,
                             gather: torch.Tensor, places: torch.Tensor, grouped: torch.Tensor,
                             sm_scale: float | None = None, return_lse: bool = False, **_):
    """Cascade decode (`radix_kernels.cascade`): each request over its suffix, each member place
    over its group's prefix with its member's query, merged where ``grouped`` (launch settings
    such as ``suffix_splits`` are the kernel's and ignored here)."""
    o_s, lse_s = decode_attention(q, k_buf, v_buf, suffix_indptr, suffix_indices, sm_scale, True)
    width = gather.numel() // (prefix_indptr.numel() - 1)
    lens = (prefix_indptr[1:] - prefix_indptr[:-1]).repeat_interleave(width)
    indices = torch.cat([prefix_indices[int(prefix_indptr[p // width]):
                                        int(prefix_indptr[p // width + 1])]
                         for p in range(gather.numel())])
    indptr = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    o_p, lse_p = decode_attention(q.index_select(0, gather.long()), k_buf, v_buf, indptr, indices,
                                  sm_scale, True)
    o, lse = merge_states(o_p, lse_p, o_s, lse_s, places.long(), grouped)
    return (o, lse) if return_lse else o


def copy_kv_rotated(k_buf: torch.Tensor, v_buf: torch.Tensor, src: torch.Tensor,
                    dst: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Copy K and V of slots ``src`` to slots ``dst`` (``[n]``), keys turned by ``shift``
    (``[n]``) positions: in each pair ``(j, j + head_dim/2)`` by the angle ``shift · inv_freq[j]``
    (RoPE's ``rotate_half`` convention), in fp32, cast to the buffer's dtype."""
    src, dst = src.long(), dst.long()
    angle = shift.float()[:, None, None] * inv_freq.float().to(k_buf.device)[None, None, :]
    k = k_buf[src].float()
    x1, x2 = k.chunk(2, dim=-1)
    cos, sin = angle.cos(), angle.sin()
    v = v_buf[src]
    k_buf[dst] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(k_buf.dtype)
    v_buf[dst] = v


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and HF Llama's RMSNorm: ``(out, residual_out)`` of ``x [T, hidden]``.

    ``residual_out = x + residual`` in x's dtype (``x`` itself when ``residual`` is None: the
    first layer); ``out = weight * (r * rsqrt(mean(r**2) + eps))``, normalised in fp32, cast to
    x's dtype, then multiplied by ``weight [hidden]`` in that dtype.
    """
    r = x if residual is None else x + residual
    rf = r.float()
    normed = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, r


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``gate_up [T, 2 * I]`` (gate, then up, along the last
    dim): ``[T, I]`` in gate_up's dtype, silu rounded to it before the product (torch's
    ``F.silu(gate) * up``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  out_slots: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """RoPE on the fused projection's q and k, and k, v stored: returns q ``[T, H, D]``.

    ``qkv``: ``[T, (H + 2 * KH) * D]`` (q heads, k heads, v heads); ``cos``, ``sin``:
    ``[T, 1, D]`` in qkv's dtype, ``cos`` twice and ``sin`` sign-folded ``[-sin, sin]``
    (`testbed.engine.model.rope_tables`). Rotation is ``x * cos + roll(x, D / 2) * sin`` in qkv's
    dtype (`testbed.engine.model.apply_rope`); rotated k and plain v go to rows ``out_slots`` of
    ``k_buf, v_buf`` (`store_kv`).
    """
    t, head_dim = qkv.shape[0], k_buf.shape[-1]
    qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1)
    qk = qk.reshape(t, num_heads + num_kv_heads, head_dim)
    qk = qk * cos + qk.roll(head_dim // 2, dims=-1) * sin
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    store_kv(k_buf, v_buf, out_slots, k, v.reshape(t, num_kv_heads, head_dim))
    return q.contiguous()
