"""`ModelRunner`: runs one scheduler `Batch` through the model (vLLM's name).

It owns the model, the KV buffers and the attention backend. `prepare` is the only place a step's
inputs are built: the new tokens of every entry concatenated (``entry.input_ids()``), their
positions ``context .. context + new - 1``, and the `AttentionMetadata` from each entry's KV slots
(``entry.kv_slots()``: positions ``0 .. context + new - 1``, of which the last ``new`` are written
in this step). The slots come from the prefix cache; the runner only checks they exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from testbed.engine.attention import AttentionBackend, AttentionMetadata, make_attention
from testbed.engine.kv_cache import KVCache
from testbed.engine.model import LlamaModel
from testbed.scheduler.batch import Batch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata


class ModelRunner:
    def __init__(self, model: LlamaModel, num_slots: int,
                 attention: str | AttentionBackend = "torch") -> None:
        self.model = model
        self.device = model.device
        self.attention = (make_attention(attention, model.config.num_kv_heads)
                          if isinstance(attention, str) else attention)
        self.kv_cache = KVCache.for_model(model.config, num_slots, model.dtype, self.device)

    @property
    def num_slots(self) -> int:
        return self.kv_cache.num_slots

    def prepare(self, batch: Batch) -> StepInputs:
        """The step's flat inputs and attention metadata (built once, used by every layer)."""
        entries = batch.entries
        if not entries:
            raise ValueError("cannot run an empty batch")
        ids, positions, slots = [], [], []
        for e in entries:
            kv = e.kv_slots()
            if e.new < 1 or len(kv) != e.context + e.new:
                raise ValueError(f"request {e.req.id}: {len(kv)} KV slots for context {e.context} "
                                 f"+ new {e.new}")
            ids.append(e.input_ids())
            positions.append(np.arange(e.context, e.context + e.new))
            slots.append(kv)
        kv_indices = np.concatenate(slots)
        if kv_indices.min() < 1 or kv_indices.max() > self.num_slots:
            raise ValueError(f"KV slot ids must be in 1..{self.num_slots} (the engine's KV slots), "
                             f"got {kv_indices.min()}..{kv_indices.max()}: the cache's capacity "
                             f"must not exceed the engine's num_slots")
        qo_lens = np.array([e.new for e in entries])
        kv_lens = np.array([e.context + e.new for e in entries])
        window = self.model.config.sliding_window
        if window is not None and kv_lens.max() > window:
            raise NotImplementedError(f"a sequence of {kv_lens.max()} tokens exceeds the model's "
                                      f"sliding_window={window}, which the engine does not implement")
        meta = AttentionMetadata.build(qo_lens, kv_lens, kv_indices, self.device)
        meta.plan = self.attention.plan(meta)
        flat = torch.from_numpy(np.concatenate(ids + positions).astype(np.int64)).to(self.device)
        input_ids, pos = flat.split([len(flat) // 2, len(flat) // 2])
        return StepInputs(input_ids=input_ids, positions=pos, meta=meta)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache,
                          self.attention)

    def run(self, batch: Batch) -> torch.Tensor:
        """Logits ``[len(batch.entries), vocab]`` of each entry's last new token; the entries'
        new K/V are written into their slots."""
        return self.forward(self.prepare(batch))
