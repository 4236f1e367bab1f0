"""The ``engine:`` config block, read once into an `EngineConfig` (no torch needed).

The engine's keys live under ``engine.`` (conf/config.yaml). Until the next release the old
top-level keys (``device``, ``dtype``, ``attention``, ``cascade_min_saved``, ``forced``,
``temperature``, ``top_p``) still work as aliases: a top-level key that is set (not null) gives
the engine key its value, and one that contradicts an engine key set to something other than its
default is refused, naming both. ``attention`` and ``cascade_min_saved`` are read by the
simulator too (it prices the kernels the engine runs); ``forced``, ``temperature`` and ``top_p``
by backend=server (what each call asks of the server).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from testbed.errors import BadInput, check_choice
from testbed.scheduler.cascade_rule import CASCADE_RULES
from testbed.scheduler.decode_groups import ATTENTION_BACKENDS

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
#: the engine's CPU kernels: native (oneDNN linear on weights prepared once, decode attention
#: reading the KV pool in place), or torch's (linear, gathered attention), as before issue 46
CPU_KERNELS = ("native", "torch")
#: the top-level keys that alias engine keys (docs/reference.md)
ALIASES = ("device", "dtype", "attention", "cascade_min_saved", "forced", "temperature", "top_p")


@dataclass(frozen=True)
class EngineConfig:
    device: str | None = None  # cpu | cuda[:N]; None: cuda if present, else cpu
    dtype: str | None = None  # None: float32 on cpu, bf16 on cuda for 2-byte models
    attention: str | None = None  # None: the device's default kernels
    cascade_min_saved: int = 0
    cascade_rule: str = "auto"  # which shared nodes cascade reads once (CASCADE_RULES)
    cuda_graph: bool = True  # decode steps replay CUDA graphs (CUDA only; ignored elsewhere)
    cuda_graph_max_batch: int = 256  # the largest decode batch captured
    cpu_kernels: str = "native"  # the CPU's linear and decode kernels (CPU_KERNELS)
    cpu_kv_cache_gib: float = 2.0  # a server's KV pool on a CPU without cache.capacity_tokens
    forced: bool = True  # replay the workload's output tokens (False: the model generates)
    temperature: float = 0.0
    top_p: float = 1.0

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> EngineConfig:
        """From a run config's ``engine`` block and the top-level aliases, every value checked."""
        block = config.get("engine") or {}
        if not isinstance(block, Mapping):
            raise BadInput(f"engine must be a mapping of {', '.join(cls.keys())}, got {block!r}")
        unknown = sorted(set(block) - set(cls.keys()))
        if unknown:
            raise BadInput(f"engine.{unknown[0]} is not an engine key; allowed: "
                           f"{', '.join(cls.keys())}")
        default = cls()
        values = {k: block.get(k, getattr(default, k)) for k in cls.keys()}
        named = {k: f"engine.{k}" for k in cls.keys()}  # as the user wrote it, for messages
        for key in ALIASES:
            alias = config.get(key)
            if alias is None:
                continue
            set_here = block.get(key)
            if set_here is not None and set_here != getattr(default, key) and set_here != alias:
                raise BadInput(f"{key}={alias!r} and engine.{key}={set_here!r} disagree ({key} is "
                               f"the old name of engine.{key}): set one")
            values[key], named[key] = alias, key
        for key in ("cascade_min_saved", "cuda_graph_max_batch", "temperature", "top_p",
                    "cpu_kv_cache_gib"):
            if values[key] is None:
                values[key] = getattr(default, key)
        return cls(**values).checked(named)

    def checked(self, named: Mapping[str, str] | None = None) -> EngineConfig:
        """Every value in range; messages name each key as ``named`` says (an alias, or
        ``engine.KEY``)."""
        named = named or {k: f"engine.{k}" for k in self.keys()}
        device = self.device
        if device is not None and (not isinstance(device, str)
                                   or device.split(":")[0] not in DEVICES):
            raise BadInput(f"{named['device']} must be cpu, cuda or cuda:N (or null: cuda if "
                           f"present, else cpu), got {device!r}")
        check_choice(named["dtype"], self.dtype, DTYPES, null=True)
        check_choice(named["attention"], self.attention, ATTENTION_BACKENDS, null=True)
        check_choice(named["cascade_rule"], self.cascade_rule, CASCADE_RULES)
        check_choice(named["cpu_kernels"], self.cpu_kernels, CPU_KERNELS)
        for key, least, unit in (("cascade_min_saved", 0, " (KV tokens)"),
                                 ("cuda_graph_max_batch", 1, " (requests)")):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise BadInput(f"{named[key]} must be an integer >= {least}{unit}, got {value!r}")
        value = self.cpu_kv_cache_gib
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                or value == float("inf"):
            raise BadInput(f"{named['cpu_kv_cache_gib']} must be a number > 0 (GiB of KV a "
                           f"server's pool holds on a CPU), got {value!r}")
        for key in ("cuda_graph", "forced"):
            if not isinstance(getattr(self, key), bool):
                raise BadInput(f"{named[key]} must be true or false, got {getattr(self, key)!r}")
        for key, low, high in (("temperature", 0.0, None), ("top_p", 0.0, 1.0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low \
                    or (high is not None and value > high):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise BadInput(f"{named[key]} must be a number {bound}, got {value!r}")
        return self


def check_kernels_run_here(attention: str | None, device: str, head_dim: int) -> None:
    """Triton's kernels (``triton``, ``cascade_triton``) run on CUDA, or on a CPU in Triton's
    interpreter (``TRITON_INTERPRET=1`` set before the run starts: slow, for tests), on a
    ``head_dim`` that is a power of two of at least 16 (a ``tl.dot`` dimension); anywhere else
    the engine would stop at its first step, so the run is refused before anything loads."""
    if attention is None or not attention.endswith("triton"):
        return
    if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise BadInput(f"engine.attention={attention} runs Triton kernels, which need a CUDA "
                       f"device, not {device}: use torch, cascade or cascade_torch there (or set "
                       f"TRITON_INTERPRET=1, Triton's interpreter, slow)")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise BadInput(f"engine.attention={attention} runs Triton kernels, which need "
                       f"model.head_dim a power of two >= 16 (a tl.dot dimension), got "
                       f"{head_dim}: use torch or cascade_torch")
