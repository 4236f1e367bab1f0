"""Model and hardware specs: the shapes and device numbers a cost model and a KV budget need.

A `ModelSpec` is a Llama-family decoder (RMSNorm, grouped-query attention, SwiGLU MLP, untied
embedding and LM head) run with tensor parallelism ``tp``; a `HardwareSpec` is one GPU. Both are
built from the ``model`` and ``hardware`` config groups by `model_spec` and `hardware_spec`, which
say which key is wrong and what is allowed. Numbers in the configs carry their sources.

>>> m = ModelSpec("llama3_70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
...               head_dim=128, intermediate_size=28672, vocab_size=128256, tp=4)
>>> m.kv_bytes_per_token // 1024, m.kv_bytes_per_token_per_gpu // 1024
(320, 80)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder's shape. ``dtype_bytes`` is the size of one weight / KV element
    (2 for bf16/fp16); ``tp`` is the tensor-parallel degree (heads and weights split over ``tp``
    GPUs; each rank holds ``num_kv_heads / tp`` KV heads, or one replicated head if fewer)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tp: int = 1

    @property
    def layer_linear_params(self) -> int:
        """Matmul weights of one layer: q, k, v, o projections and the SwiGLU gate, up, down."""
        q_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q_o + k_v + mlp

    @property
    def linear_params(self) -> int:
        """Parameters multiplied per token: every layer's matmuls plus the LM head (not the
        embedding table, which is a gather)."""
        return self.num_layers * self.layer_linear_params + self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        """All parameters: matmuls, embedding table (untied from the LM head) and RMSNorm weights
        (two per layer and a final one)."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.linear_params + self.vocab_size * self.hidden_size + norms

    @property
    def weight_bytes_per_gpu(self) -> int:
        """Bytes of weights each tensor-parallel rank holds (all of them split evenly over tp)."""
        return self.params * self.dtype_bytes // self.tp

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across the whole model (all layers, all ranks)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_heads_per_gpu(self) -> int:
        """KV heads on one rank: ``num_kv_heads / tp``, or 1 (replicated) when tp exceeds them."""
        return max(1, self.num_kv_heads // self.tp)

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        """Bytes of K and V one token occupies on each rank (the KV pool is per rank)."""
        return 2 * self.num_layers * self.kv_heads_per_gpu * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator: dense bf16 (or the run dtype's) peak FLOP/s, HBM bandwidth in bytes/s,
    device memory in bytes, the per-direction bandwidth to its tensor-parallel peers in bytes/s
    (NVLink, or PCIe without it; None: unknown, fine at tp = 1), and the host's per-step CPU and
    launch overhead in seconds (scheduling, input preparation, sampling, launch gaps)."""

    name: str
    flops: float
    mem_bw: float
    memory_bytes: int
    interconnect_bw: float | None = None
    step_overhead_s: float = 0.0


def kv_capacity_tokens(model: ModelSpec, hw: HardwareSpec, mem_fraction: float = 0.9) -> int:
    """Tokens of KV that fit on each rank once the weights are loaded (what SGLang calls
    ``max_total_num_tokens``): ``(memory × mem_fraction − weights per GPU) / KV bytes per token per
    GPU``, floored. Activations and CUDA graphs are taken out of ``1 − mem_fraction``."""
    if not 0 < mem_fraction <= 1:
        raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    usable = hw.memory_bytes * mem_fraction
    free = usable - model.weight_bytes_per_gpu
    if free < 0:
        raise ValueError(
            f"model does not fit: weights {model.weight_bytes_per_gpu / 1e9:.2f} GB per GPU "
            f"({model.name}, tp={model.tp}) > memory × mem_fraction {usable / 1e9:.2f} GB "
            f"({hw.name}: {hw.memory_bytes / 1e9:.2f} GB × {mem_fraction}); raise model.tp or "
            f"pick a larger device")
    return math.floor(free / model.kv_bytes_per_token_per_gpu)


# ---- builders from the `model` and `hardware` config groups ----

_MODEL_INTS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
               "intermediate_size", "vocab_size")


def model_spec(cfg: Mapping[str, Any]) -> ModelSpec:
    """A `ModelSpec` from the ``model`` config group (``conf/model/*.yaml``); extra keys such as
    ``path`` are the engine's and are ignored here."""
    g = "model"
    values = {k: _int(cfg, k, g, minimum=1) for k in _MODEL_INTS}
    dtype_bytes = _int(cfg, "dtype_bytes", g, minimum=1, default=2)
    if dtype_bytes not in (1, 2, 4):
        raise ValueError(f"model.dtype_bytes must be one of 1, 2, 4, got {dtype_bytes}")
    tp = _int(cfg, "tp", g, minimum=1, default=1)
    heads, kv_heads = values["num_heads"], values["num_kv_heads"]
    if heads % kv_heads:
        raise ValueError(f"model.num_heads ({heads}) must be a multiple of model.num_kv_heads "
                         f"({kv_heads})")
    if heads % tp:
        raise ValueError(f"model.tp must divide model.num_heads ({heads}), got {tp}")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"model.tp must divide model.num_kv_heads ({kv_heads}) or be a multiple "
                         f"of it, got {tp}")
    return ModelSpec(name=_name(cfg, g), dtype_bytes=dtype_bytes, tp=tp, **values)


def hardware_spec(cfg: Mapping[str, Any]) -> HardwareSpec:
    """A `HardwareSpec` from the ``hardware`` config group (``conf/hardware/*.yaml``). The group's
    ``mem_fraction`` is checked here too (read it with `mem_fraction`)."""
    g = "hardware"
    mem_fraction(cfg)
    for key, hint in _HARDWARE_HINTS.items():
        if _get(cfg, key, g, None) is None:
            raise ValueError(f"{g}.{key} is required: {hint}")
    overhead = _number(cfg, "step_overhead_s", g)
    if overhead < 0:
        raise ValueError(f"hardware.step_overhead_s must be >= 0, got {overhead:g}")
    return HardwareSpec(name=_name(cfg, g), flops=_positive(cfg, "flops", g),
                        mem_bw=_positive(cfg, "mem_bw", g),
                        memory_bytes=_int(cfg, "memory_bytes", g, minimum=1),
                        interconnect_bw=_positive(cfg, "interconnect_bw", g),
                        step_overhead_s=overhead)


_HARDWARE_HINTS = {
    "interconnect_bw": "per-direction bytes/s from one GPU to its tensor-parallel peers "
                       "(A100 NVLink3 300.0e+9, H100 NVLink4 450.0e+9, PCIe 4.0 x16 31.5e+9)",
    "step_overhead_s": "the host's CPU and launch overhead per scheduler step in seconds, "
                       "e.g. 2.0e-3",
}


def mem_fraction(cfg: Mapping[str, Any]) -> float:
    """The ``hardware.mem_fraction`` share of device memory for weights plus KV (default 0.9)."""
    value = _number(cfg, "mem_fraction", "hardware", default=0.9)
    if not 0 < value <= 1:
        raise ValueError(f"hardware.mem_fraction must be in (0, 1], got {value}")
    return value


_MISSING = object()


def _get(cfg: Mapping[str, Any], key: str, group: str, default: Any) -> Any:
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{group} config must be a mapping, got {type(cfg).__name__}")
    value = cfg.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise ValueError(f"{group}.{key} is required")
        return default
    return value


def _name(cfg: Mapping[str, Any], group: str) -> str:
    value = _get(cfg, "name", group, _MISSING)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{group}.name must be a non-empty string, got {value!r}")
    return value


def _number(cfg: Mapping[str, Any], key: str, group: str, default: Any = _MISSING) -> float:
    value = _get(cfg, key, group, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        hint = " (YAML reads 312e12 as a string: write 312.0e+12)" if isinstance(value, str) else ""
        raise ValueError(f"{group}.{key} must be a number, got {value!r}{hint}")
    return float(value)


def _positive(cfg: Mapping[str, Any], key: str, group: str) -> float:
    value = _number(cfg, key, group)
    if value <= 0:
        raise ValueError(f"{group}.{key} must be > 0, got {value:g}")
    return value


def _int(cfg: Mapping[str, Any], key: str, group: str, minimum: int,
         default: Any = _MISSING) -> int:
    value = _get(cfg, key, group, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{group}.{key} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{group}.{key} must be >= {minimum}, got {value}")
    return value
