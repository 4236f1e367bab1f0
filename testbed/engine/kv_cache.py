"""Per-layer KV buffers: ``[num_slots + 1, num_kv_heads, head_dim]`` each for K and V.

Row ``s`` holds the K (or V) of whichever token the cache gave slot ``s``; row 0 is the padding
slot (`testbed.cache.pool` never hands it out). Which slots are used, shared or freed is decided
by the prefix cache and the scheduler, never here: this is only storage.
"""

from __future__ import annotations

import torch

from testbed.errors import BadInput
from testbed.config.model_shape import ModelShape


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if num_slots < 1:
            raise BadInput(f"the engine needs >= 1 KV slot (cache.capacity_tokens), got "
                           f"{num_slots}")
        self.num_slots = num_slots
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, config: ModelShape, num_slots: int, dtype: torch.dtype,
                  device: torch.device | str) -> KVCache:
        return cls(config.num_layers, num_slots, config.num_kv_heads, config.head_dim, dtype, device)

    @staticmethod
    def bytes_per_token(config: ModelShape, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes (docs/design.md §6)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
