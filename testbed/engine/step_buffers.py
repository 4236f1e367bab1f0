"""`StepBuffers`: the one host-to-device transfer of a step's integer inputs, into memory that
lives as long as the engine.

Every integer a step's forward needs (token ids, positions, the slot-table writes, the requests'
rows and lengths, a cascade plan's arrays) is packed on the host into one staging buffer (pinned
on CUDA, so the copy is asynchronous) and moved in one copy into a device buffer that is reused
step after step; the step's device tensors are views into it. Both grow (doubling) only when a
step needs more than any step before, so a run allocates them a handful of times, not per step.

The copy is asynchronous, and on CUDA there are two staging buffers, used in turn: the next
step's inputs are staged while the last step's copy may still wait its turn on the stream (the
serving loop launches a step before the one before it has ended, `testbed.serving.step_cycle`).
Before the host writes a staging buffer again it waits for the copy out of it two steps ago to
finish (an event; long done by then). The device buffer is rewritten by the next step's copy,
which the stream orders after this step's forward. Views of the device buffer are valid until
the next `transfer`: a step's metadata must not outlive its step (a captured CUDA graph reads its
own static inputs, `testbed.engine.cuda_graph`).
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
        self._turn = 0  # the staging buffer the next transfer writes
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.grown += 1
        stages = 2 if self.pinned else 1
        self._hosts = [torch.empty(capacity, dtype=torch.int64, pin_memory=self.pinned)
                       for _ in range(stages)]
        self._host_np = [h.numpy() for h in self._hosts]  # host memory: views, no copy
        self._done: list[torch.cuda.Event | None] = [None] * stages  # the last copy out of each
        self.host = self._hosts[0]
        # on the CPU the staging buffer is the step's memory: no copy at all
        self.dev = self.host if self.device.type == "cpu" else \
            torch.empty(capacity, dtype=torch.int64, device=self.device)

    def transfer(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """``arrays`` (integers, any shape: flattened) as int64 device tensors, in one copy."""
        sizes = [int(np.size(a)) for a in arrays]
        total = sum(sizes)
        if total > self.capacity:
            for done in self._done:  # the old buffers are copied out before they go
                if done is not None:
                    done.synchronize()
            capacity = self.capacity
            while capacity < total:
                capacity *= 2
            self._allocate(capacity)
        turn = self._turn
        self._turn = (turn + 1) % len(self._hosts)
        if self._done[turn] is not None:
            self._done[turn].synchronize()  # this staging buffer is free again
        host, host_np = self._hosts[turn], self._host_np[turn]
        self.host = host
        at = 0
        for a, n in zip(arrays, sizes):
            host_np[at:at + n] = np.asarray(a).reshape(-1)
            at += n
        if self.dev is not host:
            self.dev[:total].copy_(host[:total], non_blocking=True)
            self._done[turn] = torch.cuda.Event()
            self._done[turn].record()
        return list(self.dev[:total].split(sizes))
