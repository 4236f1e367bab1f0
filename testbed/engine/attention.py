"""Paged attention over KV slots: the step's metadata and the backends that read it.

FlashInfer's shape: the `ModelRunner` builds one `AttentionMetadata` per step (on the host, one
transfer), the backend ``plan``s it once, and every layer calls ``forward`` with it. Request ``i``
of the batch has ``qo_len_i`` new tokens (``q[qo_indptr[i]:qo_indptr[i+1]]``) and reads the KV
slots ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``: its cached prefix first, then its new tokens,
whose K/V each layer writes (at ``out_slots``) before attending. New token ``j`` sees KV positions
``<= prefix_i + j``: a causal mask aligned to the lower right (SDPA's ``is_causal`` is top-left
aligned, which is wrong once a prefix is cached).

Backends (``attention=``):

- ``torch``: gathers each request's KV into a padded head-major batch and runs fused SDPA (fp32,
  GQA without repeating K/V) under the lower-right mask; the reference and the CPU default.
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
class DenseLayout:
    """The torch backend's plan: the step as a padded ``[B, L]`` batch."""

    kv_rows: torch.Tensor  # [B * KH * max_kv] int64 rows of a ``[-1, head_dim]`` view of a KV
    #                        buffer: request b's KV head h at its key j (padding slot 0 past kv_len)
    q_rows: torch.Tensor  # [T] request of each new token
    q_cols: torch.Tensor  # [T] its index among the request's new tokens
    mask: torch.Tensor  # [B, 1, max_qo, max_kv] bool: key visible to query


class TorchAttention:
    """Reference attention in plain PyTorch, fp32 inside, vectorised over the batch.

    Each layer gathers every request's K and V straight into head-major ``[B, KH, max_kv, D]``
    (one ``index_select`` each, no transposing copy), so query head ``h`` reads KV head
    ``h // group`` without repeating K/V: fused SDPA with ``enable_gqa`` for prefill chunks, two
    batched matmuls for decode steps. Gathering the paged KV is most of a CPU decode step, hence
    the single pass.
    """

    name = "torch"

    def __init__(self, num_kv_heads: int) -> None:
        self.num_kv_heads = num_kv_heads  # of the KV buffers: the gather's row arithmetic needs it

    def plan(self, meta: AttentionMetadata) -> DenseLayout:
        qo, kv = meta.qo_lens, meta.kv_lens
        b, max_qo, max_kv, heads = len(qo), int(qo.max()), int(kv.max()), self.num_kv_heads
        device = meta.kv_indices.device
        kv_valid = np.arange(max_kv)[None, :] < kv[:, None]
        q_rows = np.repeat(np.arange(b), qo)
        q_cols = np.arange(len(q_rows)) - np.repeat(np.cumsum(qo) - qo, qo)
        packed = torch.from_numpy(np.concatenate([kv_valid.ravel(), q_rows, q_cols])).to(device)
        valid, rows, cols = torch.split(packed, [b * max_kv, len(q_rows), len(q_rows)])
        valid = valid.view(b, max_kv).bool()
        kv_slots = torch.zeros((b, max_kv), dtype=torch.int64, device=device)
        kv_slots[valid] = meta.kv_indices.long()  # row-major order = concatenation order
        head = torch.arange(heads, device=device)
        kv_rows = (kv_slots[:, None, :] * heads + head[None, :, None]).reshape(-1)
        key = torch.arange(max_kv, device=device)
        query = torch.arange(max_qo, device=device)
        last_visible = meta.prefix_lens.long()[:, None] + query[None, :]  # [B, max_qo]
        mask = (key[None, None, :] <= last_visible[:, :, None]) & valid[:, None, :]
        # padded query rows (j >= qo_len) see some valid key too, so no row is all -inf
        return DenseLayout(kv_rows=kv_rows, q_rows=rows, q_cols=cols, mask=mask[:, None])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor,
                v_buf: torch.Tensor, meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
        layout: DenseLayout = meta.plan
        slots = meta.out_slots.long()
        k_buf[slots] = k.to(k_buf.dtype)
        v_buf[slots] = v.to(v_buf.dtype)
        b, max_qo, max_kv = layout.mask.shape[0], layout.mask.shape[2], layout.mask.shape[3]
        num_heads, head_dim = q.shape[1], q.shape[2]
        shape = (b, self.num_kv_heads, max_kv, head_dim)
        kp = k_buf.view(-1, head_dim).index_select(0, layout.kv_rows).view(shape).float()
        vp = v_buf.view(-1, head_dim).index_select(0, layout.kv_rows).view(shape).float()
        if max_qo == 1:
            # Decode: each KV head's query group is one [group, D] block against its keys (the
            # Triton decode kernel's grouping), two batched matmuls; faster here than SDPA,
            # whose CPU kernel tiles over queries and has one.
            qg = q.float().view(b, self.num_kv_heads, num_heads // self.num_kv_heads, head_dim)
            scores = torch.matmul(qg, kp.transpose(-1, -2)).mul_(sm_scale)
            probs = torch.softmax(scores.masked_fill_(~layout.mask, float("-inf")), dim=-1)
            return torch.matmul(probs, vp).view(b, num_heads, head_dim).to(q.dtype)
        qp = q.new_zeros((b, max_qo, num_heads, head_dim), dtype=torch.float32)
        qp[layout.q_rows, layout.q_cols] = q.float()
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), kp, vp, attn_mask=layout.mask,
                                           scale=sm_scale, enable_gqa=True)  # [B, H, max_qo, D]
        return o.transpose(1, 2)[layout.q_rows, layout.q_cols].to(q.dtype)


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
