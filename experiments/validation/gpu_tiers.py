"""The engine's KV tier copies beside the link they cross, on a GPU (gpu_engine's ``tiers``).

The tiered cache's copies (`testbed.engine.host_kv.TieredEngineExecutor.apply`: the KV of
``tokens`` slots, layer by layer, between the GPU's pool and pinned host memory) are timed each
way and set beside the host link's bandwidth measured in the same run (one pinned copy of
``link_mib`` each way): ``efficiency`` is the share of the link's bandwidth a copy reached. The
disk tier is host memory too in the engine (it checks the data path, not SSD speed), so one
direction pair covers both.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from testbed.cache.tier_state import Transfer
from testbed.cache.tiers import TieredRadixCache
from testbed.engine.executor import EngineExecutor
from testbed.engine.host_kv import TieredEngineExecutor
from testbed.engine.runner import ModelRunner


def link_bandwidth(device: torch.device, mib: int = 1024, repeats: int = 5) -> dict[str, float]:
    """Bytes a second one pinned host-to-device and device-to-host copy moves, best of
    ``repeats``."""
    host = torch.empty(mib * 2**20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d_bytes_per_s", dev, host), ("d2h_bytes_per_s", host, dev)):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        out[name] = mib * 2**20 / best
    return out


def copy_report(tokens: int, kv_bytes_per_token: int, seconds: float,
                bandwidth: float) -> dict[str, Any]:
    """One direction's copy beside the link: bytes, seconds, bytes a second and the share of
    the link's measured bandwidth it reached."""
    moved = tokens * kv_bytes_per_token
    rate = moved / seconds if seconds > 0 else None
    return {"tokens": tokens, "bytes": moved, "seconds": seconds, "bytes_per_s": rate,
            "efficiency": rate / bandwidth if rate and bandwidth else None}


def tier_copies(model, kv_bytes_per_token: int, tokens: int = 4096,
                repeats: int = 3) -> dict[str, Any]:
    """``tokens`` slots' KV copied GPU -> host and back through the engine's own copy path,
    the best of ``repeats`` each way, beside the link's bandwidth."""
    device = model.device
    runner = ModelRunner(model, num_slots=tokens + 1, cuda_graph=False)
    cache = TieredRadixCache(tokens, host_tokens=tokens, record_transfers=True)
    tiered = TieredEngineExecutor(EngineExecutor(runner), cache)
    slots = np.arange(1, tokens + 1, dtype=np.int64)
    link = link_bandwidth(device)
    out: dict[str, Any] = {"link": link}
    for name, transfer, bandwidth in (
            ("gpu_to_host", Transfer(0, slots, 1, slots), link["d2h_bytes_per_s"]),
            ("host_to_gpu", Transfer(1, slots, 0, slots), link["h2d_bytes_per_s"])):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            tiered.apply([transfer])
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        out[name] = copy_report(tokens, kv_bytes_per_token, best, bandwidth)
    del tiered, runner
    torch.cuda.empty_cache()
    return out
