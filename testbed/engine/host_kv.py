"""The engine's KV below the GPU: CPU tensors for each lower tier of the tiered radix cache, and the
copies between them and the GPU's KV buffers.

The tiered cache (`testbed.cache.tiers`) decides every move and logs it as a `Transfer` (tier and
slot ids on each side); `TieredEngineExecutor` applies the log in order, layer by layer, before
each step, so the step reads loaded KV and a demotion has saved a slot's KV before the step writes
a new token there. Each lower tier is one ``[slots + 1, kv_heads, head_dim]`` tensor per layer for
K and for V, like `KVCache` (row 0 unused), in pinned memory when the GPU is CUDA. The disk tier,
if configured, is held in CPU memory too: the engine checks the data path, not SSD speed.
"""

from __future__ import annotations

import numpy as np
import torch

from testbed.cache.tiers import Transfer, TieredRadixCache
from testbed.engine.kv_cache import KVCache
from testbed.scheduler.batch import Batch
from testbed.scheduler.batch import StepOutcome


class LowerKV:
    """K and V buffers of one lower tier, on the CPU."""

    def __init__(self, like: KVCache, num_slots: int, pin: bool) -> None:
        shape = (num_slots + 1, *like.k[0].shape[1:])
        dtype = like.k[0].dtype
        self.k = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in like.k]
        self.v = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in like.v]


class TieredEngineExecutor:
    """An engine executor whose cache has lower tiers: moves KV as the cache logged, then
    launches the step. The copy time is part of the step's launch. Everything else is the wrapped
    executor's (``runner``, forced-token counts, ...)."""

    reads_kv_in_place = True  # the wrapped engine's attention (`EngineExecutor`)

    def __init__(self, executor, cache: TieredRadixCache) -> None:
        if cache.transfers is None:
            raise ValueError("the engine needs a tiered cache built with record_transfers=True")
        self.executor = executor
        self.cache = cache
        gpu = executor.runner.kv_cache
        pin = executor.runner.device.type == "cuda"
        self.buffers: list[KVCache | LowerKV] = [gpu] + [
            LowerKV(gpu, tier.pool.capacity, pin) for tier in cache.tiers[1:]]
        self.copied_tokens = 0

    def __getattr__(self, name: str):
        return getattr(self.executor, name)

    def apply(self, transfers: list[Transfer]) -> None:
        """Carry out the copies in order, each layer by layer."""
        device = self.executor.runner.device
        for t in transfers:
            src, dst = self.buffers[t.src], self.buffers[t.dst]
            src_at = torch.from_numpy(t.src_slots.astype(np.int64))
            dst_at = torch.from_numpy(t.dst_slots.astype(np.int64))
            src_dev = device if t.src == 0 else torch.device("cpu")
            dst_dev = device if t.dst == 0 else torch.device("cpu")
            src_at, dst_at = src_at.to(src_dev), dst_at.to(dst_dev)
            for layer in range(len(src.k)):
                dst.k[layer][dst_at] = src.k[layer][src_at].to(dst_dev)
                dst.v[layer][dst_at] = src.v[layer][src_at].to(dst_dev)
            self.copied_tokens += len(t.src_slots)

    def launch(self, batch: Batch):
        """The copies the cache logged, then the wrapped executor's launch; the copy time is
        the launch's (the copies are synchronous: on CUDA the device is idle meanwhile)."""
        clock = self.executor.step_clock
        started = clock()
        self.apply(self.cache.drain_transfers())
        if self.executor.runner.device.type == "cuda":
            torch.cuda.synchronize(self.executor.runner.device)
        copy_s = clock() - started
        handle = self.executor.launch(batch)
        handle.launch_s += copy_s
        return handle

    def execute(self, batch: Batch) -> StepOutcome:
        return self.launch(batch).result()
