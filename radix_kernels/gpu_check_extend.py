"""The prefill (extend) kernel beside torch's SDPA on a GPU: its launch settings and where it
reads the new tokens' K and V, at 4 x 2,048 new tokens of Llama-2-7B's heads in bf16
(`radix_kernels.gpu_check`'s ``extend_sweep``; issue 61 asks for 1.3x SDPA).

Each setting is ``(source, block_m, block_n, num_warps, num_stages)``; ``source`` says where the
new tokens' K/V come from: ``contiguous`` (``k_new``/``v_new``, the step's own tensors, as SDPA
reads them), ``descriptors`` (the same through tensor descriptors: TMA where the GPU has it) or
``pool`` (the paged pool, what the engine passes today). Every source's default runs first, then
the fused-attention tutorial's tiles and pipeline depths, each for every source in turn, until
the budget is spent: the best of each source is reported beside SDPA.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from .extend import extend_attention

SOURCES = ("contiguous", "descriptors", "pool")
DEFAULT = (64, 64, 4, 2)
#: (block_m, block_n, num_warps, num_stages): the tutorial's forward tiles (128 x 64 or 128 x
#: 128 with 8 warps, 64 x 64 with 4) at 3-4 pipeline stages, then smaller and shallower ones
TUTORIAL = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 128, 8, 3),
            (64, 64, 4, 4), (128, 32, 4, 3), (64, 32, 4, 2)]


def sweep_configs(small: bool) -> list[tuple]:
    """The settings in the order they are tried (``small``: one tile per source, to run the
    code on a CPU)."""
    if small:
        return [(source, 16, 16, 4, 2) for source in SOURCES]
    return [(source, *DEFAULT) for source in SOURCES] + [
        (source, *tile) for tile in TUTORIAL for source in SOURCES]


def extend_sweep(device: str, small: bool, budget_s: float, make_batch: Callable,
                 bench: Callable, within: Callable, tol: dict, model: tuple) -> dict:
    """Each setting that compiles, checked against the first's output and timed; once
    ``budget_s`` has passed no setting after the sources' defaults is tried (``skipped``)."""
    t0 = time.time()
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    n = 2048 // (64 if small else 1)
    q, kb, vb, qo, kv, idx = make_batch([0] * 4, [n] * 4, *model[1:], dtype, device)
    k_new, v_new = kb[idx.long()], vb[idx.long()]  # the new tokens in q's order, contiguous
    out = {"case": f"prefill_4x{n}", "model": model[0], "dtype": str(dtype).removeprefix("torch."),
           "budget_s": None if math.isinf(budget_s) else budget_s, "configs": [], "skipped": 0}
    if device == "cuda":
        b, heads, kv_heads, dim = 4, *model[1:]
        qd = q.view(b, n, heads, dim).transpose(1, 2)
        kd = k_new.view(b, n, kv_heads, dim).transpose(1, 2)
        vd = v_new.view(b, n, kv_heads, dim).transpose(1, 2)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out["sdpa_ms"] = 1e3 * bench(lambda: sdpa(qd, kd, vd, is_causal=True,
                                                   enable_gqa=heads != kv_heads), device)
    base = None
    configs = sweep_configs(small)
    for i, (source, bm, bn, warps, stages) in enumerate(configs):
        if i >= len(SOURCES) and time.time() - t0 > budget_s:  # every source's default runs
            out["skipped"] = len(configs) - i
            break
        cfg = {"source": source, "block_m": bm, "block_n": bn, "num_warps": warps,
               "num_stages": stages}
        new = {} if source == "pool" else {"k_new": k_new, "v_new": v_new,
                                           "descriptors": source == "descriptors"}

        def run():
            return extend_attention(q, kb, vb, qo, kv, idx, max_new=n, block_m=bm, block_n=bn,
                                    num_warps=warps, num_stages=stages, **new)
        try:
            o = run()
        except Exception as e:  # out of shared memory, registers, or no descriptors here
            out["configs"].append({**cfg, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            continue
        base = o if base is None else base
        cfg["ok"] = within(o, base, tol[dtype])
        cfg["ms"] = 1e3 * bench(run, device, warmup=5, rep=25)
        out["configs"].append(cfg)
    keys = ("block_m", "block_n", "num_warps", "num_stages", "ms")
    out["best"] = {}
    for source in SOURCES:
        timed = [c for c in out["configs"] if c.get("ok") and c["source"] == source]
        if timed:
            best = min(timed, key=lambda c: c["ms"])
            out["best"][source] = {k: best[k] for k in keys} | (
                {"vs_sdpa": best["ms"] / out["sdpa_ms"]} if "sdpa_ms" in out else {})
    out["wall_s"] = time.time() - t0
    return out
