"""Moving stored KV to other positions: RoPE re-rotation of keys in the KV pool.

A Llama key at position ``p`` is ``R(p·θ) k₀``: its pre-RoPE projection ``k₀`` turned, in each
frequency pair ``(i, i + dim/2)`` (the model's ``rotate_half`` convention), by the angle
``p · inv_freq[i]``. Rotations by angles compose by adding them, so turning a stored key by
``Δ · inv_freq`` gives the key the model would have computed at ``p + Δ`` — exactly, up to
rounding, for any rope scaling whose angle is linear in the position (the default, ``linear`` and
``llama3`` scalings all are: they only change ``inv_freq``, which is the model's own
`testbed.engine.model.rope_inv_freq`). Values carry no position and are copied unchanged.

What this does *not* make exact is the rest of a moved chunk's KV: every layer's K and V past
the first depend on the tokens the chunk attended to where it was computed, which is what the
blend prefill (`testbed.engine.blend`) recomputes for a share of the tokens.

The rotation is computed in fp32 and cast to the buffer's dtype (the model casts cos/sin to the
activations' dtype before rotating; in fp32 the two agree). The copy is a gather, a rotation and a
scatter per layer in torch, or (``use_triton``) one `radix_kernels.copy_kv_rotated` launch a layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from testbed.engine.model import apply_rope, rope_tables

if TYPE_CHECKING:
    from testbed.engine.kv_cache import KVCache

Ints = np.ndarray | torch.Tensor | list[int]


def rotate_keys(k: torch.Tensor, delta: int | Ints, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys ``k [n, kv_heads, head_dim]`` turned by ``delta`` positions (an int, or one per key
    ``[n]``, negative allowed), in the keys' dtype: the keys the model computes at ``p + delta``
    from keys it computed at ``p``."""
    n = k.shape[0]
    delta_t = torch.as_tensor(delta, device=k.device).reshape(-1).to(torch.float32)
    delta_t = delta_t.expand(n) if delta_t.numel() == 1 else delta_t
    if delta_t.numel() != n:
        raise ValueError(f"delta must be an int or one per key ({n}), got {delta_t.numel()}")
    cos, sin = rope_tables(delta_t, inv_freq.to(k.device, torch.float32), torch.float32)
    return apply_rope(k.float(), cos, sin).to(k.dtype)


def _slots(slots: Ints, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(slots, dtype=np.int64) if not isinstance(slots, torch.Tensor)
                           else slots, device=device).long().reshape(-1)


def copy_kv(kv_cache: KVCache, src_slots: Ints, dst_slots: Ints, shift: int | Ints,
            inv_freq: torch.Tensor, use_triton: bool = False) -> None:
    """For every layer: K and V of ``src_slots`` written to ``dst_slots`` (one to one), keys
    turned by ``shift`` positions. ``src`` and ``dst`` may overlap (or be equal: re-rotation in
    place): all sources are read before any destination is written.

    ``use_triton``: one `radix_kernels.copy_kv_rotated` launch a layer instead of torch's gather,
    rotate and scatter (same result to rounding), except where a destination is another token's
    source (the kernel's programs run in no fixed order), which takes the torch path."""
    device = kv_cache.k[0].device
    src, dst = _slots(src_slots, device), _slots(dst_slots, device)
    if src.numel() != dst.numel():
        raise ValueError(f"a KV copy needs as many destination slots as sources, got "
                         f"{src.numel()} -> {dst.numel()}")
    if src.numel() == 0:
        return
    if use_triton and not _crossing(src_slots, dst_slots):
        import radix_kernels

        shifts = torch.as_tensor(np.asarray(shift.cpu() if isinstance(shift, torch.Tensor)
                                            else shift, dtype=np.int64), device=device)
        shifts = shifts.reshape(-1).expand(src.numel()).contiguous()
        for k_buf, v_buf in zip(kv_cache.k, kv_cache.v):
            radix_kernels.copy_kv_rotated(k_buf, v_buf, src, dst, shifts, inv_freq)
        return
    for k_buf, v_buf in zip(kv_cache.k, kv_cache.v):
        k = k_buf.index_select(0, src)  # index_select copies: overlap is safe
        v = v_buf.index_select(0, src)
        k_buf[dst] = rotate_keys(k, shift, inv_freq) if _nonzero(shift) else k
        v_buf[dst] = v


def rerotate(kv_cache: KVCache, slots: Ints, delta: int | Ints, inv_freq: torch.Tensor) -> None:
    """Turn the keys stored at ``slots`` by ``delta`` positions in place, in every layer."""
    copy_kv(kv_cache, slots, slots, delta, inv_freq)


def _nonzero(shift: int | Ints) -> bool:
    """Skip the rotation for a zero shift (then a copy is bit-exact)."""
    if isinstance(shift, (int, np.integer)):
        return int(shift) != 0
    return bool(np.any(np.asarray(shift.cpu() if isinstance(shift, torch.Tensor) else shift)))


def _crossing(src_slots: Ints, dst_slots: Ints) -> bool:
    """Whether some destination slot is the source of another token (not of its own)."""
    src, dst = (np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x).reshape(-1)
                for x in (src_slots, dst_slots))
    shared = np.isin(dst, src)
    return bool((shared & (dst != src)).any())
