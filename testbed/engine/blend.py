"""Blend prefill: one request's prefill that reuses KV of chunks computed elsewhere (CacheBlend).

A prefill entry may carry ``reuse``: spans of its new range ``[context, context + new)`` whose KV
the cache found computed for the same tokens at other positions or after other context (a
`ReusedSpan`: ``dst``, the first position it fills; ``src_slots``, the donor's KV slots, one per
token; ``src_start``, the position the donor's first key was rotated at; ``recompute``, how many of
its tokens to compute again). `blend_prefill` runs such an entry on its own:

1. **Load.** Each span's donor K/V is copied into the request's own slots at its positions, keys
   re-rotated by ``dst − src_start`` (`testbed.engine.rope_shift`): exact for the keys' position
   part, not for what the donor attended to.
2. **Layer 0, every new token.** The first layer is computed for all new tokens, fresh and reused
   alike, and its K/V written over the reused ones (layer 0's KV depends on nothing but the token
   and its position, so it is then exact), giving every token its exact input to layer 1.
3. **Selection at layer 1.** The second layer's Q/K/V are projected for all new tokens; each span
   token's deviation is ``‖K_fresh − K_reused‖² + ‖V_fresh − V_reused‖²`` (summed over KV heads
   and dims, fp32, keys after RoPE at the token's position) and the span's ``recompute`` tokens
   of highest deviation are picked (ties: the earlier position).
4. **Layers 1 .. L−1, fresh and picked tokens only.** Only fresh tokens (not in a span), picked
   tokens and the last position (its logits are the result) are carried on; their K/V are written
   over the reused ones in every layer from 1 on, and they attend under a causal mask *by
   position* to all of the request's KV at that layer: the cached prefix, reused, fresh and
   recomputed tokens (keys at positions ``<= `` the query's). Unpicked span tokens keep the reused
   K/V from layer 1 on.

The result is the last position's logits, as a normal prefill returns. (A one-layer model has
no layer 1: every token is computed, which is exact.)

Where this departs from the CacheBlend paper (Yao et al., EuroSys 2025): the paper filters
gradually — a somewhat larger share is picked at the first layers and narrowed layer by layer
among the previously picked tokens — while here one selection, made at layer 1, holds for every
later layer; the share is given per span by the cache (``recompute``), not as one ratio over the
whole input; the last position is always computed; layer 1's K/V projection is computed for all
span tokens (to measure the deviation) but written only for the picked ones; and nothing overlaps
loading KV with recomputing (the paper pipelines KV loads from slower storage with compute).

Exactness (tested): ``recompute`` equal to every span's length computes every token in every
layer, i.e. exact recomputation; donor KV computed for the same prompt at the same positions with
``recompute = 0`` also gives the exact logits (the reused KV is the exact KV).

Attention here is plain torch (SDPA with an explicit position mask, fp32 inside) whatever the
engine's backend: the Triton extend kernel assumes a request's new tokens are the contiguous tail
of its KV, which picked tokens are not. Only the donor load uses Triton (``use_triton``, the
runner's choice with ``attention=triton``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from testbed.engine.attention import EXTEND_QUERY_BLOCK
from testbed.engine.kv_cache import KVCache
from testbed.engine.layer_kernels import TORCH_KERNELS
from testbed.engine.model import LlamaModel
from testbed.engine.rope_shift import copy_kv


@dataclass
class BlendResult:
    logits: torch.Tensor  # [vocab] of the last position
    picked: np.ndarray  # positions of span tokens recomputed (from layer 1 on), ascending
    computed: np.ndarray  # positions carried through every layer: fresh, picked and the last


def check_spans(spans: Sequence[Any], context: int, slots: np.ndarray) -> list[Any]:
    """The spans sorted by ``dst``; each inside ``[context, len(slots))``, disjoint, with ``0 <=
    recompute <= length``, its donor slots none of the slots this prefill writes (the donor's KV
    stays as the cache holds it)."""
    out = sorted(spans, key=lambda s: s.dst)
    end, prev_end = len(slots), context
    written = slots[context:]
    for s in out:
        length = len(s.src_slots)
        if s.dst < prev_end or s.dst + length > end or length == 0:
            raise ValueError(f"reused spans must be non-empty, disjoint and inside the entry's new "
                             f"positions [{context}, {end}), got dst={s.dst} length={length}")
        if np.isin(np.asarray(s.src_slots), written).any():
            raise ValueError(f"a reused span's donor slots must not be among the slots the "
                             f"prefill writes (its positions {context}..{end - 1}): the span at "
                             f"dst={s.dst} reads some of them")
        if not 0 <= s.recompute <= length:
            raise ValueError(f"a span's recompute must be in 0..{length} (its length), "
                             f"got {s.recompute}")
        prev_end = s.dst + length
    return out


def attend_by_position(q: torch.Tensor, q_pos: np.ndarray, k_buf: torch.Tensor,
                       v_buf: torch.Tensor, slots: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Attention of queries ``q [t, heads, dim]`` at ascending positions ``q_pos [t]`` (host)
    over the KV of ``slots [N]`` (slot ``j`` holds position ``j``), each query seeing keys at
    positions ``<= `` its own; fp32 inside, GQA as in HF. Returns ``[t, heads, dim]`` in q's dtype.

    Queries go in blocks of `EXTEND_QUERY_BLOCK`, each against keys up to its last position (as
    the torch backend's prefill does), so the masked-out tail is mostly not computed."""
    k = k_buf.index_select(0, slots).float().transpose(0, 1)[None]  # [1, KH, N, D]
    v = v_buf.index_select(0, slots).float().transpose(0, 1)[None]
    qh = q.float().transpose(0, 1)[None]  # [1, H, t, D]
    pos = torch.as_tensor(q_pos, device=q.device)
    outs = []
    for start in range(0, len(q_pos), EXTEND_QUERY_BLOCK):
        end = min(start + EXTEND_QUERY_BLOCK, len(q_pos))
        keys = int(q_pos[end - 1]) + 1
        mask = torch.arange(keys, device=q.device)[None, :] <= pos[start:end, None]
        o = F.scaled_dot_product_attention(qh[:, :, start:end], k[:, :, :keys], v[:, :, :keys],
                                           attn_mask=mask, scale=sm_scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


def pick_by_deviation(deviation: torch.Tensor, spans: Sequence[Any], context: int) -> np.ndarray:
    """Per span, the positions of its ``recompute`` tokens of highest ``deviation`` (indexed by
    new-token row: position − context); ties go to the earlier position."""
    dev = deviation.cpu()
    picked = []
    for s in spans:
        if s.recompute == 0:
            continue
        start = s.dst - context
        rows = dev[start:start + len(s.src_slots)]
        order = torch.argsort(rows, descending=True, stable=True)[: s.recompute]
        picked.append(s.dst + order.numpy())
    return np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)


@torch.inference_mode()
def blend_prefill(model: LlamaModel, kv_cache: KVCache, tokens: np.ndarray, slots: np.ndarray,
                  context: int, spans: Sequence[Any], use_triton: bool = False) -> BlendResult:
    """One request's prefill of positions ``context .. len(slots) − 1`` reusing ``spans``.

    ``tokens``: the request's tokens of positions ``0 .. len(slots) − 1`` (at least); ``slots``:
    its KV slots of those positions (the first ``context`` hold its exact cached prefix; the rest
    are written here). ``spans``: `ReusedSpan`-shaped records (``dst``, ``src_slots``,
    ``src_start``, ``recompute``) inside the new range; ``use_triton``: load the donors' KV with
    the Triton copy kernel (`copy_kv`). See the module docstring for the method.
    """
    end = len(slots)
    if not 0 <= context < end:
        raise ValueError(f"a blend prefill needs 0 <= context < len(slots), got context={context} "
                         f"with {end} slots")
    spans = check_spans(spans, context, np.asarray(slots))
    device = model.device
    slots_d = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=device)
    for s in spans:  # 1. load each donor's KV at the span's positions
        copy_kv(kv_cache, s.src_slots, slots[s.dst:s.dst + len(s.src_slots)], s.dst - s.src_start,
                model.inv_freq, use_triton)

    new = end - context
    in_span = np.zeros(new, dtype=bool)
    for s in spans:
        in_span[s.dst - context:s.dst - context + len(s.src_slots)] = True
    positions = torch.arange(context, end, device=device)
    ids = torch.as_tensor(np.asarray(tokens[context:end], dtype=np.int64), device=device)
    h = model.embed_tokens(ids)
    cos, sin = model.rope(positions, h.dtype)
    rows_host = np.arange(new)  # new-token rows carried on (all, until layer 1)
    rows = torch.as_tensor(rows_host, device=device)
    picked = np.zeros(0, dtype=np.int64)
    residual = None  # the model's residual stream (`DecoderLayer`): each norm adds to it
    norm = TORCH_KERNELS.add_rmsnorm
    for i, layer in enumerate(model.layers):  # 2. layer 0 for all; 4. then the carried rows
        attn, k_buf, v_buf = layer.self_attn, kv_cache.k[i], kv_cache.v[i]
        x, residual = norm(h, residual, layer.input_layernorm.weight, layer.input_layernorm.eps)
        q, k, v = attn.project(x, cos[rows], sin[rows])
        if i == 1 and in_span.any():  # 3. select, then carry only fresh + picked + last
            span_rows = torch.as_tensor(np.flatnonzero(in_span), device=device)
            span_slots = slots_d[context + span_rows]
            dk = (k[span_rows].float() - k_buf[span_slots].float()).pow(2).sum((1, 2))
            dv = (v[span_rows].float() - v_buf[span_slots].float()).pow(2).sum((1, 2))
            deviation = torch.zeros(new, device=device).index_put_((span_rows,), dk + dv)
            picked = pick_by_deviation(deviation, spans, context)
            keep = ~in_span
            keep[picked - context] = True
            keep[-1] = True
            rows_host = np.flatnonzero(keep)
            rows = torch.as_tensor(rows_host, device=device)
            residual, q, k, v = residual[rows], q[rows], k[rows], v[rows]
        out_slots = slots_d[context + rows]
        k_buf[out_slots] = k.to(k_buf.dtype)
        v_buf[out_slots] = v.to(v_buf.dtype)
        o = attend_by_position(q, context + rows_host, k_buf, v_buf, slots_d, attn.sm_scale)
        x, residual = norm(attn.o_proj(o.reshape(len(rows), attn.q_size)), residual,
                           layer.post_attention_layernorm.weight,
                           layer.post_attention_layernorm.eps)
        h = layer.mlp(x, TORCH_KERNELS)
    h, _ = norm(h[-1:], residual[-1:], model.norm.weight, model.norm.eps)
    logits = model.lm_head_of(h)[0]
    return BlendResult(logits=logits, picked=picked, computed=context + rows_host)
