"""`StepBuffers`: the one host-to-device transfer of a step's integer inputs, into memory that
lives as long as the engine.

Every integer a step's forward needs (token ids, positions, the slot-table writes, the requests'
rows and lengths, a cascade plan's arrays) is packed on the host into one staging buffer (pinned
on CUDA, so the copy is asynchronous) and moved in one copy into a device buffer that is reused
step after step; the step's device tensors are views into it. Both grow (doubling) only when a
step needs more than any step before, so a run allocates them a handful of times, not per step.

The copy is asynchronous: before the host writes the staging buffer again it waits for the last
copy out of it to finish (an event; normally long done, since every step reads its tokens back).
Views of the device buffer are valid until the next `transfer`: a step's metadata must not
outlive its step (a captured CUDA graph reads its own static inputs, `testbed.engine.cuda_graph`).
"""

from __future__ import annotations

import numpy as np
import torch


class StepBuffers:
    def __init__(self, device: torch.device | str, capacity: int = 4096) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.capacity = 0
        self.grown = 0  # times the buffers were (re)allocated
        self._done: torch.cuda.Event | None = None  # the last copy out of the staging buffer
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.grown += 1
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=self.pinned)
        self.host_np = self.host.numpy()
        # on the CPU the staging buffer is the step's memory: no copy at all
        self.dev = self.host if self.device.type == "cpu" else \
            torch.empty(capacity, dtype=torch.int64, device=self.device)

    def transfer(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """``arrays`` (integers, any shape: flattened) as int64 device tensors, in one copy."""
        sizes = [int(np.size(a)) for a in arrays]
        total = sum(sizes)
        if self._done is not None:
            self._done.synchronize()  # the staging buffer is free again
        if total > self.capacity:
            capacity = self.capacity
            while capacity < total:
                capacity *= 2
            self._allocate(capacity)
        at = 0
        for a, n in zip(arrays, sizes):
            self.host_np[at:at + n] = np.asarray(a).reshape(-1)
            at += n
        if self.dev is not self.host:
            self.dev[:total].copy_(self.host[:total], non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        return list(self.dev[:total].split(sizes))
