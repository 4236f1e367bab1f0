"""`SchedulerConfig`: the ``scheduler`` config group, validated. Defaults are SGLang's.

``name`` (or ``target``, an import path: ``scheduler=custom``) picks the queue policy from
`QUEUE_POLICIES`; the group's keys that are not fields here are that policy's own settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from testbed.errors import BadInput, check_choice
from testbed.config.group_values import check_setting
from testbed.config.registry import Resolved
from testbed.scheduler.policy import QUEUE_POLICIES, SGLANG_RELEASES

RETRACT_ORDERS = ("newest", "longest_prompt", "most_remaining")


@dataclass(frozen=True)
class SchedulerConfig:
    name: str = "fcfs"  # the queue policy
    target: str | None = None  # scheduler=custom: the queue policy's import path
    policy_settings: dict[str, Any] = field(default_factory=dict)  # the policy's own keys
    max_running_requests: int | None = None  # None: min(KV capacity // 2, 4096), as SGLang
    max_prefill_tokens: int = 16384  # new tokens per prefill batch
    chunked_prefill_size: int | None = 8192  # None disables chunking
    lpm_fallback_threshold: int = 128
    in_batch_prefix_caching: bool = True
    in_batch_check_threshold: int = 32
    in_batch_deprioritize_threshold: int = 32
    in_batch_hold: bool = False  # beyond SGLang: deprioritized requests sit the step out
    lpm_aging: float = 0.0  # beyond SGLang: LPM key tokens gained per second of waiting
    overlap: bool = False  # SGLang's overlap schedule: results applied after the next batch forms
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    clip_max_new_tokens: int = 4096
    retract_decode_steps: int = 20
    retract_order: str = "newest"  # who goes first when decode runs out of KV
    sglang: str = "0.5.23"  # whose rules apply where SGLang releases differ (docs/design.md §4)
    enable_priority_scheduling: bool = False  # SGLang's --enable-priority-scheduling
    disable_priority_preemption: bool = False  # ... without preempting running requests
    priority_preemption_threshold: int = 10  # --priority-scheduling-preemption-threshold

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> "SchedulerConfig":
        known = {f.name: f.type for f in fields(cls) if f.name != "policy_settings"}
        config = cls(**{k: check_setting(f"scheduler.{k}", known[k], v)
                        for k, v in cfg.items() if k in known},
                     policy_settings={k: v for k, v in cfg.items() if k not in known})
        config.validate()
        return config

    @classmethod
    def of(cls, cfg: "SchedulerConfig | Mapping[str, Any]") -> "SchedulerConfig":
        """``cfg`` itself, or the config of a ``scheduler`` group mapping."""
        return cfg if isinstance(cfg, SchedulerConfig) else cls.from_mapping(cfg)

    def queue_policy(self) -> Resolved:
        """The queue policy's entry and settings, checked (`testbed.config.registry`); build it with
        ``.build(cache=..., rng=..., **config.settings())``."""
        return QUEUE_POLICIES.resolve({"name": self.name, "target": self.target,
                                       **self.policy_settings}, run_keys=tuple(self.settings()))

    def settings(self) -> dict[str, Any]:
        """The scheduler's settings by name, as offered to the queue policy."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("name", "target", "policy_settings")}

    def validate(self) -> None:
        check_choice("scheduler.sglang", self.sglang, SGLANG_RELEASES)
        self.queue_policy()
        check_choice("scheduler.retract_order", self.retract_order, RETRACT_ORDERS)
        positive = ["max_prefill_tokens", "clip_max_new_tokens", "new_token_ratio_decay_steps",
                    "lpm_fallback_threshold", "retract_decode_steps"]
        optional_positive = ["max_running_requests", "chunked_prefill_size"]
        for key in positive + optional_positive:
            value = getattr(self, key)
            if (value is not None or key in positive) and (value is None or value < 1):
                raise BadInput(f"scheduler.{key} must be >= 1{' or null' if key in optional_positive else ''}, got {value}")
        if self.lpm_aging < 0:
            raise BadInput(f"scheduler.lpm_aging must be >= 0, got {self.lpm_aging}")
        for key in ["in_batch_prefix_caching", "in_batch_hold", "overlap",
                    "enable_priority_scheduling", "disable_priority_preemption"]:
            if not isinstance(getattr(self, key), bool):
                raise BadInput(f"scheduler.{key} must be true or false, got {getattr(self, key)!r}")
        for key in ["init_new_token_ratio", "min_new_token_ratio_factor"]:
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise BadInput(f"scheduler.{key} must be in [0, 1], got {getattr(self, key)}")
