"""Paged attention over KV slots: the step's metadata and the backends that read it.

FlashInfer's shape: the `ModelRunner` builds one `AttentionMetadata` per step (on the host, one
transfer), the backend ``plan``s it once, and every layer calls ``forward`` with it. Request ``i``
of the batch has ``qo_len_i`` new tokens (``q[qo_indptr[i]:qo_indptr[i+1]]``) and reads the KV
slots ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``: its cached prefix first, then its new tokens,
whose K/V each layer writes (at ``out_slots``) before attending. New token ``j`` sees KV positions
``<= prefix_i + j``: a causal mask aligned to the lower right (SDPA's ``is_causal`` is top-left
aligned, which is wrong once a prefix is cached).

Backends (``attention=``):

- ``torch``: gathers KV head-major, fp32 inside, GQA without repeating K/V: decode steps padded to
  the longest KV (two batched matmuls), prefill steps per request with fused SDPA under the
  lower-right mask; the reference and the CPU default.
- ``triton``: `radix_kernels.store_kv`, ``extend_attention`` and, when every request has one new
  token, ``decode_attention``. Imported only when chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("torch", "triton")


@dataclass
class AttentionMetadata:
    """One step's layout, shared by every layer. Device tensors are int32 unless noted."""

    qo_indptr: torch.Tensor  # [B + 1]
    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor  # [sum kv_len] slot ids: each request's prefix, then its new tokens
    out_slots: torch.Tensor  # [T] where the new tokens' K/V are written
    prefix_lens: torch.Tensor  # [B] kv_len - qo_len
    last_token_index: torch.Tensor  # [B] (int64) row of each request's last new token in [T]
    qo_lens: np.ndarray  # host copies, for planning
    kv_lens: np.ndarray
    plan: Any = None  # what the backend's ``plan`` precomputed for this step

    @property
    def batch_size(self) -> int:
        return len(self.qo_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_lens.sum())

    @property
    def is_decode(self) -> bool:
        """Every request has exactly one new token."""
        return bool((self.qo_lens == 1).all())

    @classmethod
    def build(cls, qo_lens: np.ndarray, kv_lens: np.ndarray, kv_indices: np.ndarray,
              device: torch.device | str) -> AttentionMetadata:
        """From per-request new-token counts, KV lengths (prefix + new) and the concatenated slot
        ids of each request; the last ``qo_len`` slots of each request are written."""
        qo_lens = np.asarray(qo_lens, dtype=np.int64)
        kv_lens = np.asarray(kv_lens, dtype=np.int64)
        if len(qo_lens) == 0:
            raise ValueError("an attention step needs at least one request")
        if (qo_lens < 1).any() or (kv_lens < qo_lens).any():
            raise ValueError(f"each request needs >= 1 new token and kv_len >= qo_len, got "
                             f"qo_lens={qo_lens.tolist()} kv_lens={kv_lens.tolist()}")
        if len(kv_indices) != kv_lens.sum():
            raise ValueError(f"kv_indices has {len(kv_indices)} slots, kv_lens sum to {kv_lens.sum()}")
        b, t = len(qo_lens), int(qo_lens.sum())
        qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
        kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)])
        # token k of the step is new token (k - qo_start) of its request, at KV index kv_end - qo_len + that
        within = np.arange(t) - np.repeat(qo_indptr[:-1], qo_lens)
        out_slots = np.asarray(kv_indices)[np.repeat(kv_indptr[1:] - qo_lens, qo_lens) + within]
        packed = np.concatenate([qo_indptr, kv_indptr, kv_indices, out_slots, kv_lens - qo_lens,
                                 qo_indptr[1:] - 1]).astype(np.int32)
        dev = torch.from_numpy(packed).to(device)
        sizes = [b + 1, b + 1, len(kv_indices), t, b, b]
        qo_p, kv_p, idx, out, prefix, last = torch.split(dev, sizes)
        return cls(qo_indptr=qo_p, kv_indptr=kv_p, kv_indices=idx, out_slots=out,
                   prefix_lens=prefix, last_token_index=last.long(), qo_lens=qo_lens,
                   kv_lens=kv_lens)


class AttentionBackend(Protocol):
    name: str

    def plan(self, meta: AttentionMetadata) -> Any:
        """Once per step: whatever the backend wants precomputed (stored as ``meta.plan``)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor,
                v_buf: torch.Tensor, meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
        """Write ``k, v`` (``[T, kv_heads, dim]``) at ``meta.out_slots``, then return the attention
        output ``[T, heads, dim]`` of ``q`` over each request's slots."""


@dataclass
class DecodeLayout:
    """The torch backend's plan for a decode step: the batch padded to its longest KV."""

    kv_rows: torch.Tensor  # [B * KH * max_kv] int64 rows of a ``[-1, head_dim]`` view of a KV
    #                        buffer: request b's KV head h at key j (padding slot 0 past kv_len)
    mask: torch.Tensor  # [B, 1, 1, max_kv] bool: key j < kv_len


@dataclass
class ExtendLayout:
    """The torch backend's plan for a prefill (extend) step: each request on its own, unpadded."""

    kv_rows: list[torch.Tensor]  # per request [KH * kv_len] rows, head-major (see DecodeLayout)
    q_splits: list[int]  # qo_lens
    blocks: list[list[tuple[int, int, int, torch.Tensor | None]]]  # per request, see `plan`


EXTEND_QUERY_BLOCK = 256  # torch backend: query rows per SDPA call behind a cached prefix


def head_major_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows of a ``[-1, head_dim]`` view of a ``[slots, KH, D]`` buffer that gather ``slots``
    (any shape ``[..., L]``) as ``[..., KH, L, D]``: slot s, head h is row ``s * KH + h``."""
    head = torch.arange(num_kv_heads, device=slots.device)
    return (slots.long()[..., None, :] * num_kv_heads + head[:, None]).reshape(-1)


class TorchAttention:
    """Reference attention in plain PyTorch, fp32 inside.

    K and V are gathered straight into head-major ``[B, KH, L, D]`` (one ``index_select`` each,
    no transposing copy), so query head ``h`` reads KV head ``h // group`` without repeating K/V.
    A decode step pads the batch to its longest KV and runs two batched matmuls (each KV head's
    query group as one ``[group, D]`` block, the Triton decode kernel's grouping). A prefill step
    runs fused SDPA per request, unpadded: requests of one prefill batch differ a lot in length,
    and padding them to the longest made the attention cost the padded area instead of the
    attended pairs, which is neither what ragged kernels (FlashInfer, ours in Triton) do nor what
    the simulator's cost model counts.
    """

    name = "torch"

    def __init__(self, num_kv_heads: int) -> None:
        self.num_kv_heads = num_kv_heads  # of the KV buffers: the gather's row arithmetic needs it

    def plan(self, meta: AttentionMetadata) -> DecodeLayout | ExtendLayout:
        heads, device = self.num_kv_heads, meta.kv_indices.device
        kv = meta.kv_lens
        if meta.is_decode:
            b, max_kv = len(kv), int(kv.max())
            valid = torch.from_numpy(np.arange(max_kv)[None, :] < kv[:, None]).to(device)
            kv_slots = torch.zeros((b, max_kv), dtype=torch.int64, device=device)
            kv_slots[valid] = meta.kv_indices.long()  # row-major order = concatenation order
            return DecodeLayout(kv_rows=head_major_rows(kv_slots, heads),
                                mask=valid[:, None, None, :])
        slots = torch.split(meta.kv_indices, kv.tolist())
        blocks = [self.query_blocks(q_len, kv_len, device)
                  for q_len, kv_len in zip(meta.qo_lens.tolist(), kv.tolist())]
        return ExtendLayout(kv_rows=[head_major_rows(s, heads) for s in slots],
                            q_splits=meta.qo_lens.tolist(), blocks=blocks)

    @staticmethod
    def query_blocks(q_len: int, kv_len: int, device: torch.device
                     ) -> list[tuple[int, int, int, torch.Tensor | None]]:
        """One request's SDPA calls: ``(q_start, q_end, keys, mask)``, queries ``q_start..q_end-1``
        against keys ``0..keys-1`` under ``mask`` (None: SDPA's own causal mask).

        Without a prefix the chunk is plainly causal. Behind a prefix the mask is causal from the
        lower right, which SDPA's ``is_causal`` is not, and an explicit mask makes it compute
        every query-key pair: query blocks that each stop at their last visible key skip most of
        the masked triangle, so the step costs the attended pairs (as ragged kernels and the cost
        model count them), not the rectangle.
        """
        if q_len == kv_len:
            return [(0, q_len, kv_len, None)]
        prefix, out = kv_len - q_len, []
        for start in range(0, q_len, EXTEND_QUERY_BLOCK):
            end = min(start + EXTEND_QUERY_BLOCK, q_len)
            keys = prefix + end
            query = torch.arange(start, end, device=device)
            mask = torch.arange(keys, device=device)[None, :] <= prefix + query[:, None]
            out.append((start, end, keys, mask))
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor,
                v_buf: torch.Tensor, meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
        slots = meta.out_slots.long()
        k_buf[slots] = k.to(k_buf.dtype)
        v_buf[slots] = v.to(v_buf.dtype)
        num_heads, head_dim = q.shape[1], q.shape[2]
        k_rows, v_rows = k_buf.view(-1, head_dim), v_buf.view(-1, head_dim)
        if isinstance(meta.plan, DecodeLayout):
            layout = meta.plan
            b = layout.mask.shape[0]
            shape = (b, self.num_kv_heads, layout.mask.shape[3], head_dim)
            kp = k_rows.index_select(0, layout.kv_rows).view(shape).float()
            vp = v_rows.index_select(0, layout.kv_rows).view(shape).float()
            qg = q.float().view(b, self.num_kv_heads, num_heads // self.num_kv_heads, head_dim)
            scores = torch.matmul(qg, kp.transpose(-1, -2)).mul_(sm_scale)
            probs = torch.softmax(scores.masked_fill_(~layout.mask, float("-inf")), dim=-1)
            return torch.matmul(probs, vp).view(b, num_heads, head_dim).to(q.dtype)
        layout: ExtendLayout = meta.plan
        outs = []
        for qi, rows, blocks in zip(q.split(layout.q_splits), layout.kv_rows, layout.blocks):
            shape = (1, self.num_kv_heads, len(rows) // self.num_kv_heads, head_dim)
            ki = k_rows.index_select(0, rows).view(shape).float()
            vi = v_rows.index_select(0, rows).view(shape).float()
            qh = qi.float().transpose(0, 1)[None]  # [1, H, qo_len, D]
            for start, end, keys, mask in blocks:
                o = F.scaled_dot_product_attention(
                    qh[:, :, start:end], ki[:, :, :keys], vi[:, :, :keys], attn_mask=mask,
                    is_causal=mask is None, scale=sm_scale, enable_gqa=True)
                outs.append(o[0].transpose(0, 1))  # [end - start, H, D]
        return torch.cat(outs).to(q.dtype)


KERNEL_FUNCTIONS = ("store_kv", "extend_attention", "decode_attention")


class TritonAttention:
    """The Triton kernels of `radix_kernels` (``kernels/``): store, then extend or decode."""

    name = "triton"

    def __init__(self) -> None:
        try:
            import radix_kernels
        except ImportError as e:
            raise ImportError("attention=triton needs the radix_kernels package (kernels/, "
                              "installed with this project); use attention=torch") from e
        missing = [f for f in KERNEL_FUNCTIONS if not hasattr(radix_kernels, f)]
        if missing:
            raise ImportError(f"attention=triton: radix_kernels does not provide "
                              f"{', '.join(missing)}; use attention=torch")
        self.kernels = radix_kernels

    def plan(self, meta: AttentionMetadata) -> bool:
        return meta.is_decode

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor,
                v_buf: torch.Tensor, meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
        kn = self.kernels
        kn.store_kv(k_buf, v_buf, meta.out_slots, k, v)
        if meta.plan:  # one query per request
            return kn.decode_attention(q, k_buf, v_buf, meta.kv_indptr, meta.kv_indices, sm_scale)
        return kn.extend_attention(q, k_buf, v_buf, meta.qo_indptr, meta.kv_indptr,
                                   meta.kv_indices, sm_scale)


def make_attention(name: str, num_kv_heads: int) -> AttentionBackend:
    """The backend ``name`` for KV buffers of ``num_kv_heads`` heads."""
    if name == "torch":
        return TorchAttention(num_kv_heads)
    if name == "triton":
        return TritonAttention()
    raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}")
