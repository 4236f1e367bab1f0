"""Model and hardware specs: the shapes and device numbers a cost model and a KV budget need.

The model is a `testbed.config.model_shape.ModelShape` (the one shape class, shared with the
engine), run with tensor parallelism ``tp``; a `HardwareSpec` is one GPU. Both are built from the
``model`` and ``hardware`` config groups by `model_spec` and `hardware_spec`, which say which key
is wrong and what is allowed. Numbers in the configs carry their sources.

>>> from testbed.config.model_shape import ModelShape
>>> m = ModelShape("llama3_70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
...                head_dim=128, intermediate_size=28672, vocab_size=128256, tp=4)
>>> h = HardwareSpec("h100", flops=989e12, mem_bw=3.35e12, memory_bytes=80 * 10**9)
>>> kv_capacity_tokens(m, h) // 1000  # (72 GB - 35.3 GB of weights) / 80 KiB per rank
448
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from testbed.config import group_values
from testbed.errors import BadInput
from testbed.config.model_shape import ModelShape


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator: dense bf16 (or the run dtype's) peak FLOP/s, HBM bandwidth in bytes/s,
    device memory in bytes, the per-direction bandwidth to its tensor-parallel peers in bytes/s
    (NVLink, or PCIe without it; None: unknown, fine at tp = 1), the host's per-step CPU and
    launch overhead in seconds (scheduling, input preparation, sampling, launch gaps), and the
    streaming multiprocessors, the programs a kernel's grid runs at once (None: no grid, a CPU;
    cascade decoding's rule reads it: `testbed.scheduler.cascade_rule`)."""

    name: str
    flops: float
    mem_bw: float
    memory_bytes: int
    interconnect_bw: float | None = None
    step_overhead_s: float = 0.0
    sm_count: int | None = None


def kv_capacity_tokens(model: ModelShape, hw: HardwareSpec, mem_fraction: float = 0.9) -> int:
    """Tokens of KV that fit on each rank once the weights are loaded (what SGLang calls
    ``max_total_num_tokens``): ``(memory × mem_fraction − weights per GPU) / KV bytes per token per
    GPU``, floored. Activations and CUDA graphs are taken out of ``1 − mem_fraction``."""
    if not 0 < mem_fraction <= 1:
        raise BadInput(f"hardware.mem_fraction must be in (0, 1], got {mem_fraction}")
    usable = hw.memory_bytes * mem_fraction
    free = usable - model.weight_bytes_per_gpu
    if free < 0:
        raise BadInput(
            f"model does not fit: weights {model.weight_bytes_per_gpu / 1e9:.2f} GB per GPU "
            f"({model.name}, tp={model.tp}) > memory × mem_fraction {usable / 1e9:.2f} GB "
            f"({hw.name}: {hw.memory_bytes / 1e9:.2f} GB × {mem_fraction}); raise model.tp or "
            f"pick a larger device")
    return math.floor(free / model.kv_bytes_per_token_per_gpu)


# ---- builders from the `model` and `hardware` config groups ----

def model_spec(cfg: Mapping[str, Any]) -> ModelShape:
    """The `ModelShape` of the ``model`` config group (``conf/model/*.yaml``):
    `ModelShape.from_group`. Extra keys such as ``path`` are the engine's and are ignored here."""
    return ModelShape.from_group(cfg)


def hardware_spec(cfg: Mapping[str, Any]) -> HardwareSpec:
    """A `HardwareSpec` from the ``hardware`` config group (``conf/hardware/*.yaml``). The group's
    ``mem_fraction`` is checked here too (read it with `mem_fraction`)."""
    g = "hardware"
    mem_fraction(cfg)
    for key, hint in _HARDWARE_HINTS.items():
        if group_values.value(cfg, key, g, None) is None:
            raise BadInput(f"{g}.{key} is required: {hint}")
    overhead = group_values.number(cfg, "step_overhead_s", g)
    if overhead < 0:
        raise BadInput(f"hardware.step_overhead_s must be >= 0, got {overhead:g}")
    return HardwareSpec(name=group_values.name(cfg, g),
                        flops=group_values.positive(cfg, "flops", g),
                        mem_bw=group_values.positive(cfg, "mem_bw", g),
                        memory_bytes=group_values.integer(cfg, "memory_bytes", g, minimum=1),
                        interconnect_bw=group_values.positive(cfg, "interconnect_bw", g),
                        step_overhead_s=overhead,
                        sm_count=None if cfg.get("sm_count") is None
                        else group_values.integer(cfg, "sm_count", g, minimum=1))


_HARDWARE_HINTS = {
    "interconnect_bw": "per-direction bytes/s from one GPU to its tensor-parallel peers "
                       "(A100 NVLink3 300.0e+9, H100 NVLink4 450.0e+9, PCIe 4.0 x16 31.5e+9)",
    "step_overhead_s": "the host's CPU and launch overhead per scheduler step in seconds, "
                       "e.g. 2.0e-3",
}


def mem_fraction(cfg: Mapping[str, Any]) -> float:
    """The ``hardware.mem_fraction`` share of device memory for weights plus KV (default 0.9)."""
    fraction = group_values.number(cfg, "mem_fraction", "hardware", default=0.9)
    if not 0 < fraction <= 1:
        raise BadInput(f"hardware.mem_fraction must be in (0, 1], got {fraction}")
    return fraction
