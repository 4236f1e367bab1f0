"""Per-layer KV buffers: ``[num_slots + 1, num_kv_heads, head_dim]`` each for K and V.

Row ``s`` holds the K (or V) of whichever token the cache gave slot ``s``; row 0 is the padding
slot (`testbed.cache.pool` never hands it out). Which slots are used, shared or freed is decided
by the prefix cache and the scheduler, never here: this is only storage.

On the CPU the buffers are zero pages the kernel hands out as they are first written (`_zeros`):
a server's pool sized from memory (``engine.cpu_kv_cache_gib``, 2 GiB by default) costs the
memory its tokens use, not the whole pool at start-up.
"""

from __future__ import annotations

import numpy as np
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
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]

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


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor; on the CPU backed by numpy's zeroed allocation (calloc: large ones are
    fresh zero pages, resident only once written), where ``torch.zeros`` writes every byte at
    once. Zero bits are 0.0 in every float dtype, so an integer array of the same width, viewed
    as ``dtype``, is the same tensor."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    ints = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[dtype.itemsize]
    return torch.from_numpy(np.zeros(shape, dtype=ints)).view(dtype)
