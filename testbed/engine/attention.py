"""Paged attention over KV slots: the backends that read a step's `AttentionMetadata`.

FlashInfer's shape: the `ModelRunner` builds one `AttentionMetadata` per step
(`testbed.engine.metadata`), the backend ``plan``s it once — every size a kernel launch needs is
read there from the host's copies, so no layer asks the device anything — and every layer calls
``forward`` with it. New token ``j`` of a request with a cached prefix of ``P`` tokens sees KV
positions ``<= P + j``: a causal mask aligned to the lower right (SDPA's ``is_causal`` is top-left
aligned, which is wrong once a prefix is cached).

Backends (``attention=``):

- ``torch``: gathers KV head-major, fp32 inside, GQA without repeating K/V: decode steps padded to
  the longest KV (on the CPU one fused flash-attention call that also returns the LSE; elsewhere
  two batched matmuls), prefill steps per request with fused SDPA under the lower-right mask; the
  reference and the CPU's kernels (the CPU default, ``cascade``, runs them in cascade). Given
  the CPU's in-place kernels (`testbed.engine.cpu_attention`, ``engine.cpu_kernels=native``,
  fp32), its decode and prefill steps read each request's slots where they lie instead of
  gathering them (a speculative token tree's own mask still goes through SDPA).
- ``triton``: `radix_kernels.extend_attention` and, when every request has one new token,
  ``decode_attention``. Imported only when chosen.

A layer's new K/V are in the buffers before its attention runs (the layer's fused RoPE-and-store
step, `testbed.engine.layer_kernels`).

Both run a decode step as `decode_part` calls — one query group per KV head and sequence over a
`KVRanges` of KV. Cascade decoding (`testbed.engine.cascade`) is each backend's
``decode_cascade``: the torch backend composes the same two primitives with ``merge``
(`cascade_decode`); the Triton backend runs both passes and their merge in two launches, as
many as plain decode (`radix_kernels.cascade`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from testbed.engine.metadata import AttentionMetadata, KVRanges
from testbed.errors import BadInput, check_choice
from testbed.scheduler.decode_groups import ATTENTION_BACKENDS  # the names, shared with the sim


#: PyTorch's CPU flash-attention kernel, which returns the log-sum-exp with the output (the public
#: SDPA does not): a decode part on the CPU is then one call instead of matmul, scale, mask,
#: softmax, matmul and the LSE's three ops (per layer and part: what a small model's CPU decode
#: step is mostly made of). None if this torch lacks it: the matmul path is used.
FUSED_CPU_DECODE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class AttentionBackend(Protocol):
    name: str

    def plan(self, meta: AttentionMetadata) -> Any:
        """Once per step: whatever the backend wants precomputed (stored as ``meta.plan``)."""

    def forward(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
        """The attention output ``[T, heads, dim]`` of ``q`` over each request's slots (the
        step's new K/V are in the buffers already: the layer's RoPE-and-store step)."""

    def plan_part(self, kv: KVRanges, table: torch.Tensor, num_kv_splits: int | None = None
                  ) -> Any:
        """Once per step: a `decode_part`'s view of ``kv`` (``num_kv_splits``: the split-KV
        chunks a kernel that splits must use, fixed for a CUDA graph; None: its choice)."""

    def decode_part(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, part: Any,
                    sm_scale: float, want_lse: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``q [n, kv_heads, R, dim]``: ``R`` queries of sequence ``i`` per KV head, each over the
        KV of sequence ``i`` of the planned part, no mask. Returns ``o`` of q's shape and (with
        ``want_lse``) the natural-log LSE ``[n, kv_heads, R]`` fp32."""

    def merge(self, o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
              lse_b: torch.Tensor, places: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Attention over the union of two disjoint key sets (``[n, heads, dim]``, LSEs
        ``[n, heads]``) where ``keep[i]``, side a's row of token ``i`` being ``places[i]``;
        side b as it is elsewhere: `radix_kernels.merge_states`."""

    def decode_cascade(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                planned: tuple[Any, Any, Any], sm_scale: float) -> torch.Tensor:
        """Decode attention of ``q [n, heads, dim]`` with shared prefixes read once per group
        (``planned``: `CascadePlan.planned`'s plan and its two parts)."""


def decode(backend: AttentionBackend, q: torch.Tensor, k_buf: torch.Tensor,
           v_buf: torch.Tensor, part: Any, sm_scale: float) -> torch.Tensor:
    """Plain decode, one query per sequence: ``q [n, heads, dim]``, GQA groups as in HF."""
    n, heads, dim = q.shape
    kv_heads = k_buf.shape[1]
    o, _ = backend.decode_part(q.reshape(n, kv_heads, heads // kv_heads, dim), k_buf, v_buf,
                               part, sm_scale, want_lse=False)
    return o.reshape(n, heads, dim)


@dataclass
class FlatKV:
    """The Triton backend's (and the CPU kernel's) view of a `KVRanges`: flat indices and how
    many split-KV chunks."""

    indptr: torch.Tensor
    indices: torch.Tensor
    num_kv_splits: int


@dataclass
class PaddedKV:
    """The torch backend's view of a `KVRanges`: padded to its longest run."""

    kv_rows: torch.Tensor  # [n * KH * longest] int64 rows of a ``[-1, head_dim]`` view of a KV
    #                        buffer: sequence i's KV head h at key j (some valid slot past its end)
    mask: torch.Tensor  # [n, 1, 1, longest] bool: key j < len_i
    bias: torch.Tensor | None = None  # the mask as 0 / -inf (fp32), for the fused CPU kernel


@dataclass
class FlatExtend:
    """The CPU kernel's plan for a prefill step: every request's slots where they lie."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    indices: torch.Tensor


@dataclass
class ExtendLayout:
    """The torch backend's plan for a prefill (extend) step: each request on its own, unpadded."""

    kv_rows: list[torch.Tensor]  # per request [KH * kv_len] rows, head-major (see PaddedKV)
    q_splits: list[int]  # qo_lens
    blocks: list[list[tuple[int, int, int, torch.Tensor | None]]]  # per request, see `plan`


EXTEND_QUERY_BLOCK = 256  # torch backend: query rows per SDPA call behind a cached prefix


def head_major_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows of a ``[-1, head_dim]`` view of a ``[slots, KH, D]`` buffer that gather ``slots``
    (any shape ``[..., L]``) as ``[..., KH, L, D]``: slot s, head h is row ``s * KH + h``."""
    head = torch.arange(num_kv_heads, device=slots.device)
    return (slots.long()[..., None, :] * num_kv_heads + head[:, None]).reshape(-1)


def plan_decode(backend: AttentionBackend, meta: AttentionMetadata) -> Any:
    """A decode step's plan: the cascade's parts when it has one, else the requests' KV."""
    if meta.cascade is not None:
        return meta.cascade.planned(backend, meta.table, meta.num_kv_splits)
    return backend.plan_part(meta.kv, meta.table, meta.num_kv_splits)


def forward_decode(backend: AttentionBackend, q: torch.Tensor, k_buf: torch.Tensor,
                   v_buf: torch.Tensor, meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
    if meta.cascade is not None:
        return backend.decode_cascade(q, k_buf, v_buf, meta.plan, sm_scale)
    return decode(backend, q, k_buf, v_buf, meta.plan, sm_scale)


def cascade_decode(backend: Any, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                   planned: tuple[Any, Any, Any], sm_scale: float) -> torch.Tensor:
    """Decode attention of ``q [n, heads, dim]`` (one query per request), prefixes shared."""
    plan, suffix, prefix = planned
    n, heads, dim = q.shape
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    o, lse = backend.decode_part(q.reshape(n, kv_heads, group, dim), k_buf, v_buf, suffix,
                                 sm_scale)
    o, lse = o.reshape(n, heads, dim), lse.reshape(n, heads)
    g, w = plan.num_groups, plan.width
    shared = q.index_select(0, plan.gather).view(g, w, kv_heads, group, dim)
    shared = shared.transpose(1, 2).reshape(g, kv_heads, w * group, dim)
    o_p, lse_p = backend.decode_part(shared, k_buf, v_buf, prefix, sm_scale)
    o_p = o_p.view(g, kv_heads, w, group, dim).transpose(1, 2).reshape(g * w, heads, dim)
    lse_p = lse_p.view(g, kv_heads, w, group).transpose(1, 2).reshape(g * w, heads)
    return backend.merge(o_p, lse_p, o, lse, plan.places, plan.grouped)



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
    graphable = False  # a decode plan's shape follows the longest KV: no CUDA graph

    def __init__(self, num_kv_heads: int, cascade: bool = False, kernel: Any = None) -> None:
        self.num_kv_heads = num_kv_heads  # of the KV buffers: the gather's row arithmetic needs it
        self.cascade = cascade  # decode steps read shared prefixes once (the runner plans it)
        # the CPU's in-place decode kernel (`testbed.engine.cpu_attention`, fp32): decode parts
        # read the KV pool where it lies instead of gathering it; None: the gather
        self.kernel = kernel

    def plan(self, meta: AttentionMetadata) -> Any:
        if meta.is_decode:
            return plan_decode(self, meta)
        heads, table = self.num_kv_heads, meta.table
        masks = meta.query_masks or [None] * meta.batch_size
        if self.kernel is not None and all(mask is None for mask in masks):
            return FlatExtend(meta.qo_indptr, meta.kv_indptr, meta.kv.indices(table))
        blocks = [self.query_blocks(q_len, kv_len, table.device) if mask is None
                  else [(0, q_len, kv_len, mask)]  # a token tree: its own mask, one call
                  for q_len, kv_len, mask in zip(meta.qo_lens.tolist(), meta.kv_lens.tolist(),
                                                 masks)]
        rows = [head_major_rows(table[row, :kv_len], heads)
                for row, kv_len in zip(meta.rows.tolist(), meta.kv_lens.tolist())]
        return ExtendLayout(kv_rows=rows, q_splits=meta.qo_lens.tolist(), blocks=blocks)

    def plan_part(self, kv: KVRanges, table: torch.Tensor, num_kv_splits: int | None = None
                  ) -> PaddedKV | FlatKV:
        if self.kernel is not None:  # the slots themselves, no padding: the kernel walks them
            return FlatKV(kv.indptr, kv.indices(table), 1)
        slots, mask = kv.padded(table)
        mask = mask[:, None, None, :]
        bias = None
        if FUSED_CPU_DECODE is not None and table.device.type == "cpu":
            bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, -math.inf)
        return PaddedKV(kv_rows=head_major_rows(slots, self.num_kv_heads), mask=mask, bias=bias)

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

    def decode_part(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                    part: PaddedKV | FlatKV, sm_scale: float, want_lse: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(part, FlatKV):
            return self.kernel(q, k_buf, v_buf, part.indptr, part.indices, sm_scale, want_lse)
        n, heads, rows, dim = q.shape
        shape = (n, heads, part.mask.shape[3], dim)
        kp = k_buf.view(-1, dim).index_select(0, part.kv_rows).view(shape).float()
        vp = v_buf.view(-1, dim).index_select(0, part.kv_rows).view(shape).float()
        if part.bias is not None:  # one kernel instead of eight ops; same math, LSE included
            o, lse = FUSED_CPU_DECODE(q.float(), kp, vp, attn_mask=part.bias, scale=sm_scale)
            return o.to(q.dtype), lse
        scores = torch.matmul(q.float(), kp.transpose(-1, -2)).mul_(sm_scale)
        scores.masked_fill_(~part.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, vp).to(q.dtype)
        if not want_lse:
            return o, None
        # log Σ exp(s) = s_j − log p_j for any key j; at the largest score p_j >= 1 / keys, so
        # this is exact to rounding and cheaper than a second pass of exponentials
        return o, scores.amax(dim=-1) - probs.amax(dim=-1).log()

    def merge(self, o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
              lse_b: torch.Tensor, places: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """`radix_kernels.reference.merge_states`' weights ``exp(lse_x) / Σ``, as one sigmoid
        and one lerp (``o_b + σ(lse_a − lse_b) · (o_a − o_b)``): a side without keys (-inf)
        weighs 0; both sides have keys here (a prefix, and at least the request's own token)."""
        o_a, lse_a = o_a.index_select(0, places), lse_a.index_select(0, places)
        weight = torch.sigmoid(lse_a.float() - lse_b.float())[..., None]
        merged = torch.lerp(o_b.float(), o_a.float(), weight).to(o_a.dtype)
        return torch.where(keep[:, None, None], merged, o_b)

    def decode_cascade(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                planned: tuple[Any, Any, Any], sm_scale: float) -> torch.Tensor:
        return cascade_decode(self, q, k_buf, v_buf, planned, sm_scale)

    def forward(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
        if isinstance(meta.plan, FlatExtend):
            plan: FlatExtend = meta.plan
            return self.kernel.extend(q, k_buf, v_buf, plan.qo_indptr, plan.kv_indptr,
                                      plan.indices, sm_scale)
        if not isinstance(meta.plan, ExtendLayout):
            return forward_decode(self, q, k_buf, v_buf, meta, sm_scale)
        head_dim = q.shape[2]
        k_rows, v_rows = k_buf.view(-1, head_dim), v_buf.view(-1, head_dim)
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


KERNEL_FUNCTIONS = ("extend_attention", "decode_attention", "merge_states",
                    "cascade_decode_attention")
DECODE_KEYS_PER_SPLIT = 256  # triton decode: KV positions per split-KV chunk, at most 8 chunks
MAX_KV_SPLITS = 8  # ... and a CUDA graph's decode uses all 8 (its KV lengths vary per replay)


class TritonAttention:
    """The Triton kernels of `radix_kernels` (``radix_kernels/``): store, then extend or decode."""

    name = "triton"
    graphable = True  # a decode plan's tensors have shapes fixed by the batch (and groups)

    def __init__(self, cascade: bool = False) -> None:
        self.cascade = cascade
        try:
            import radix_kernels
        except ImportError as e:
            raise BadInput("attention=triton needs the radix_kernels package (radix_kernels/, "
                           "installed with this project); use attention=torch") from e
        missing = [f for f in KERNEL_FUNCTIONS if not hasattr(radix_kernels, f)]
        if missing:
            raise BadInput(f"attention=triton: radix_kernels does not provide "
                           f"{', '.join(missing)}; use attention=torch")
        self.kernels = radix_kernels

    def plan(self, meta: AttentionMetadata) -> Any:
        if meta.is_decode:
            return plan_decode(self, meta)
        if meta.query_masks is not None and any(m is not None for m in meta.query_masks):
            raise NotImplementedError("a token tree's mask is not in the Triton extend kernel; "
                                      "use engine.attention=torch")
        meta.kv_indices = meta.kv.indices(meta.table)
        return meta.max_qo  # the extend kernel's grid, known here: no device query per layer

    def plan_part(self, kv: KVRanges, table: torch.Tensor, num_kv_splits: int | None = None
                  ) -> FlatKV:
        splits = num_kv_splits or min(MAX_KV_SPLITS,
                                      max(1, math.ceil(kv.longest / DECODE_KEYS_PER_SPLIT)))
        return FlatKV(kv.indptr, kv.indices(table), splits)

    def decode_part(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                    part: FlatKV, sm_scale: float, want_lse: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, heads, rows, dim = q.shape  # query head h * rows + r reads KV head h: GQA group rows
        out = self.kernels.decode_attention(q.reshape(n, heads * rows, dim), k_buf, v_buf,
                                            part.indptr, part.indices, sm_scale,
                                            num_kv_splits=part.num_kv_splits,
                                            return_lse=want_lse)
        o, lse = out if want_lse else (out, None)
        return o.view(q.shape), None if lse is None else lse.view(n, heads, rows)

    def merge(self, o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
              lse_b: torch.Tensor, places: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.kernels.merge_states(o_a, lse_a, o_b, lse_b, places, keep)[0]

    def decode_cascade(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                planned: tuple[Any, Any, Any], sm_scale: float) -> torch.Tensor:
        """Both passes in one launch, their merge folded into the split-KV reduction: two
        launches a layer, as plain decode (`radix_kernels.cascade`)."""
        plan, suffix, prefix = planned
        return self.kernels.cascade_decode_attention(
            q, k_buf, v_buf, suffix.indptr, suffix.indices, prefix.indptr, prefix.indices,
            plan.gather, plan.places, plan.grouped, sm_scale,
            suffix_splits=suffix.num_kv_splits, prefix_splits=prefix.num_kv_splits)

    def forward(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
        if not isinstance(meta.plan, int):
            return forward_decode(self, q, k_buf, v_buf, meta, sm_scale)
        return self.kernels.extend_attention(q, k_buf, v_buf, meta.qo_indptr, meta.kv_indptr,
                                             meta.kv_indices, sm_scale, max_new=meta.plan)


def make_attention(name: str, num_kv_heads: int, device: torch.device | str = "cpu",
                   kernel: Any = None) -> AttentionBackend:
    """The backend ``name`` for KV buffers of ``num_kv_heads`` heads on ``device``; ``kernel``:
    the torch backends' in-place decode kernel (`testbed.engine.cpu_attention`), or None."""
    check_choice("attention", name, ATTENTION_BACKENDS)
    cascade = name.startswith("cascade")
    if name == "cascade":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name.endswith("torch"):
        return TorchAttention(num_kv_heads, cascade=cascade, kernel=kernel)
    return TritonAttention(cascade=cascade)
