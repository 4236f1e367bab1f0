"""`VllmSchedulerConfig`: the ``scheduler=vllm`` config group, validated; `scheduler_config`
reads a ``scheduler`` group as vLLM's or SGLang's (`testbed.scheduler.build` builds either).

Keys are named as vLLM names them (``vllm/config/scheduler.py``, ``SchedulerConfig`` of vLLM
0.32); defaults are its class defaults. ``conf/scheduler/vllm.yaml`` says where each comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from testbed.errors import BadInput
from testbed.config.group_values import check_setting
from testbed.scheduler.config import SchedulerConfig

VLLM = "vllm"
#: the cache ``scheduler=vllm`` runs on: vLLM's hashed KV blocks (`testbed.cache.block_hash`)
VLLM_CACHE = "block_hash"


@dataclass(frozen=True)
class VllmSchedulerConfig:
    name: str = VLLM
    max_num_batched_tokens: int = 2048  # tokens scheduled per step (the token budget)
    max_num_seqs: int = 128  # running requests at most
    enable_chunked_prefill: bool = True  # False: a prompt that does not fit the budget waits
    long_prefill_token_threshold: int = 0  # > 0: a request takes at most this many per step
    scheduler_reserve_full_isl: bool = True  # admit only when the whole fill fits the free blocks

    @property
    def target(self) -> None:  # what run summaries read of a scheduler config (no custom class)
        return None

    @property
    def overlap(self) -> bool:  # vLLM's synchronous scheduler: results before the next step
        return False

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> "VllmSchedulerConfig":
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(cfg) - set(known))
        if unknown:
            raise BadInput(f"scheduler.{unknown[0]} is not a setting of scheduler=vllm; allowed: "
                           f"{', '.join(k for k in known if k != 'name')}")
        empty = [k for k, v in cfg.items() if v is None]
        if empty:
            raise BadInput(f"scheduler.{empty[0]} must be set for scheduler=vllm (vLLM's "
                           "SchedulerConfig takes no null there), got null")
        config = cls(**{k: check_setting(f"scheduler.{k}", known[k], v) for k, v in cfg.items()})
        config.validate()
        return config

    def validate(self) -> None:
        for key in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, key) < 1:
                raise BadInput(f"scheduler.{key} must be >= 1, got {getattr(self, key)}")
        if self.max_num_batched_tokens < self.max_num_seqs:  # SchedulerConfig.verify_max_model_len
            raise BadInput(f"scheduler.max_num_batched_tokens must be >= scheduler.max_num_seqs "
                           f"(vLLM refuses fewer), got {self.max_num_batched_tokens} < "
                           f"{self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise BadInput(f"scheduler.long_prefill_token_threshold must be >= 0 (0: off), got "
                           f"{self.long_prefill_token_threshold}")
        for key in ("enable_chunked_prefill", "scheduler_reserve_full_isl"):
            if not isinstance(getattr(self, key), bool):
                raise BadInput(f"scheduler.{key} must be true or false, got "
                               f"{getattr(self, key)!r}")


def scheduler_config(cfg: Any) -> SchedulerConfig | VllmSchedulerConfig:
    """The config of a ``scheduler`` group: vLLM's for ``name: vllm``, else SGLang's."""
    if isinstance(cfg, (SchedulerConfig, VllmSchedulerConfig)):
        return cfg
    if cfg.get("name") == VLLM and not cfg.get("target"):
        return VllmSchedulerConfig.from_mapping(cfg)
    return SchedulerConfig.from_mapping(cfg)


def check_vllm_cache(config: Any, cache_name: str | None, reuse_active: bool) -> None:
    """``scheduler=vllm`` runs on vLLM's block cache only, without reuse beyond prefixes."""
    if not isinstance(config, VllmSchedulerConfig):
        return
    if cache_name != VLLM_CACHE:
        raise BadInput(f"scheduler=vllm needs cache={VLLM_CACHE} (vLLM's hashed KV blocks, whose "
                       f"rules for when a block is cached and freed it follows); got "
                       f"cache={cache_name}")
    if reuse_active:
        raise BadInput("scheduler=vllm reuses exact prefixes only (cache.reuse / cache.match "
                       "need scheduler=fcfs, lpm, ...)")
