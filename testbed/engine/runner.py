"""`ModelRunner`: runs one scheduler `Batch` through the model (vLLM's name).

It owns the model, the KV buffers, the slot table and the attention backend. `prepare` is the
only place a step's inputs are built: the new tokens of every entry concatenated
(``entry.input_ids()``), their positions ``context .. context + new - 1``, the slot-table writes
that bring each entry's row up to its KV slots (``entry.kv_slots()``: positions ``0 .. context +
new - 1``, of which the last ``new`` are written in this step), and the `AttentionMetadata` —
all in one host-to-device transfer; the index arrays the kernels read are gathered on the device.
The slots come from the prefix cache; the runner only checks the new ones exist. Entries that
reuse chunks' KV (``reuse``) run through `testbed.engine.blend` instead, and a batch's
``kv_copies`` after the forward (`run`).

On CUDA without a given ``num_slots`` the KV pool takes what the device's free memory leaves
once the weights are loaded (`kv_slots_for_free_memory`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from testbed.engine.attention import AttentionBackend, make_attention
from testbed.engine.blend import blend_prefill
from testbed.engine.cascade import CascadePlan
from testbed.engine.kv_cache import KVCache
from testbed.engine.metadata import AttentionMetadata
from testbed.engine.model import LlamaModel
from testbed.engine.rope_shift import copy_kv
from testbed.engine.slot_table import SlotTable
from testbed.scheduler.batch import Batch
from testbed.scheduler.decode_groups import DecodeGroups


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata


def kv_slots_for_free_memory(free_bytes: int, total_bytes: int, mem_fraction: float,
                             bytes_per_token: int, cap: int | None = None) -> int:
    """KV slots for what a device has free after the weights loaded, keeping ``1 −
    mem_fraction`` of its whole memory for activations (SGLang's ``mem_fraction_static``):
    ``(free − (1 − mem_fraction) × total) / bytes_per_token``, at most ``cap``."""
    budget = free_bytes - (1 - mem_fraction) * total_bytes
    slots = math.floor(budget / bytes_per_token)
    if slots < 1:
        raise ValueError(f"no device memory left for KV: {free_bytes / 2**30:.2f} GiB free of "
                         f"{total_bytes / 2**30:.2f} GiB, {1 - mem_fraction:.0%} of it kept back "
                         f"(hardware.mem_fraction={mem_fraction}); set cache.capacity_tokens")
    return min(slots, cap) if cap is not None else slots


def kv_pool_slots(model: LlamaModel, mem_fraction: float, max_slots: int | None = None) -> int:
    """KV slots for ``model`` on its CUDA device from what is free there now (weights loaded)."""
    if model.device.type != "cuda":
        raise ValueError(f"the KV pool is sized from free memory on CUDA only; on "
                         f"{model.device.type} give num_slots (cache.capacity_tokens)")
    free, total = torch.cuda.mem_get_info(model.device)
    return kv_slots_for_free_memory(free, total, mem_fraction,
                                    KVCache.bytes_per_token(model.config, model.dtype), max_slots)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_slots: int | None,
                 attention: str | AttentionBackend = "torch", mem_fraction: float = 0.9,
                 max_slots: int | None = None, cascade_min_saved: int = 0) -> None:
        """``num_slots`` None (CUDA only): size the KV pool from free device memory now,
        at most ``max_slots``. ``cascade_min_saved``: see `DecodeGroups`."""
        self.model = model
        self.device = model.device
        self.attention = (make_attention(attention, model.config.num_kv_heads, self.device)
                          if isinstance(attention, str) else attention)
        if num_slots is None:
            num_slots = kv_pool_slots(model, mem_fraction, max_slots)
        self.kv_cache = KVCache.for_model(model.config, num_slots, model.dtype, self.device)
        self.slots = SlotTable(self.device)
        # cascade decoding: who shares a cached prefix
        self.decode_groups = DecodeGroups(min_saved=cascade_min_saved)
        self.triton_copies = getattr(self.attention, "name", "") == "triton"  # KV moves: its kernel

    @property
    def num_slots(self) -> int:
        return self.kv_cache.num_slots

    def prepare(self, batch: Batch) -> StepInputs:
        """The step's flat inputs and attention metadata (built once, used by every layer)."""
        entries = batch.entries
        if not entries:
            raise ValueError("cannot run an empty batch")
        ids, positions = [], []
        for e in entries:
            if e.new < 1 or len(e.kv_slots()) != e.context + e.new:
                raise ValueError(f"request {e.req.id}: {len(e.kv_slots())} KV slots for context "
                                 f"{e.context} + new {e.new}")
            ids.append(e.input_ids())
            positions.append(np.arange(e.context, e.context + e.new))
        rows, writes = self.slots.update(entries)
        written = writes[2]
        if len(written) and (written.min() < 1 or written.max() > self.num_slots):
            raise ValueError(f"KV slot ids must be in 1..{self.num_slots} (the engine's KV slots), "
                             f"got {written.min()}..{written.max()}: the cache's capacity "
                             f"must not exceed the engine's num_slots")
        qo_lens = np.array([e.new for e in entries])
        kv_lens = np.array([e.context + e.new for e in entries])
        window = self.model.config.sliding_window
        if window is not None and kv_lens.max() > window:
            raise NotImplementedError(f"a sequence of {kv_lens.max()} tokens exceeds the model's "
                                      f"sliding_window={window}, which the engine does not implement")
        tokens = np.concatenate(ids + positions)
        groups = self.decode_groups(entries) if getattr(self.attention, "cascade", False) else []
        cascade, sizes = CascadePlan.host_arrays(groups, kv_lens, rows) if groups else ([], None)
        meta, extra = AttentionMetadata.from_table(qo_lens, kv_lens, rows, self.slots.table,
                                                   [*writes, tokens, *cascade])
        self.slots.apply(*extra[:3])
        if groups:
            meta.cascade = CascadePlan.from_device(extra[4:], sizes)
        meta.plan = self.attention.plan(meta)
        input_ids, pos = extra[3].split([len(tokens) // 2, len(tokens) // 2])
        return StepInputs(input_ids=input_ids, positions=pos, meta=meta)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache,
                          self.attention)

    def run(self, batch: Batch) -> torch.Tensor:
        """Logits ``[len(batch.entries), vocab]`` of each entry's last new token; the entries'
        new K/V are written into their slots.

        A prefill entry with a non-empty ``reuse`` (spans of donor KV, `testbed.engine.blend`)
        runs as its own forward through `blend_prefill`, after the step's other entries have run
        together; then the batch's ``kv_copies`` are executed (`copy_kv`, every layer, keys
        re-rotated by each copy's ``shift``)."""
        reuse = [e.reuse for e in batch.entries]
        if any(reuse):
            logits = self._run_blended(batch, reuse)
        else:
            logits = self.forward(self.prepare(batch))
        for c in batch.kv_copies:
            copy_kv(self.kv_cache, c.src_slots, c.dst_slots, c.shift, self.model.inv_freq,
                    self.triton_copies)
        return logits

    def _run_blended(self, batch: Batch, reuse: list) -> torch.Tensor:
        out: list[torch.Tensor | None] = [None] * len(batch.entries)
        plain = [i for i, r in enumerate(reuse) if not r]
        if plain:
            logits = self.forward(self.prepare(replace(batch, entries=[batch.entries[i]
                                                                       for i in plain])))
            for row, i in enumerate(plain):
                out[i] = logits[row]
        for i, spans in enumerate(reuse):
            if spans:
                e = batch.entries[i]
                slots = e.kv_slots()
                if len(slots) != e.context + e.new or slots.min(initial=1) < 1 \
                        or slots.max(initial=1) > self.num_slots:
                    raise ValueError(f"request {e.req.id}: blend prefill needs context + new = "
                                     f"{e.context + e.new} KV slots in 1..{self.num_slots}")
                out[i] = blend_prefill(self.model, self.kv_cache, e.req.fill(), slots,
                                       e.context, spans, self.triton_copies).logits
        return torch.stack(out)
