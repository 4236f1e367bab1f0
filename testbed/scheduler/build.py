"""`build_scheduler`: the scheduler a ``scheduler`` group asks for, SGLang's
(`testbed.scheduler.scheduler`) or vLLM V1's (`testbed.scheduler.vllm`), over a built cache."""

from __future__ import annotations

from typing import Any, Collection

from testbed.cache.base import PrefixCache
from testbed.scheduler.decode_groups import DecodeGroups
from testbed.scheduler.scheduler import Scheduler
from testbed.scheduler.speculative import SpeculativeConfig
from testbed.scheduler.vllm import VllmScheduler
from testbed.scheduler.vllm_config import VllmSchedulerConfig, scheduler_config


def build_scheduler(cache: PrefixCache, config: Any, seed: int = 0,
                    eos_token_ids: Collection[int] = (), eos_for_all: bool = False, reuse=None,
                    check_invariants: bool = False, decode_groups: DecodeGroups | None = None,
                    speculative: SpeculativeConfig | None = None) -> Scheduler | VllmScheduler:
    """The scheduler a config asks for over ``cache``: vLLM V1's (`testbed.scheduler.vllm`) or
    SGLang's (`testbed.scheduler.scheduler`). ``decode_groups``: with cascade decoding, who
    shares which prefix in each formed batch (``Batch.decode_groups``). ``speculative``: the
    checked ``speculative`` block (SGLang's scheduler only; `check_speculative`)."""
    config = scheduler_config(config)
    if isinstance(config, VllmSchedulerConfig):
        scheduler = VllmScheduler(cache, config, eos_token_ids=eos_token_ids,
                                  eos_for_all=eos_for_all, check_invariants=check_invariants)
    else:
        scheduler = Scheduler(cache, config, seed=seed, eos_token_ids=eos_token_ids,
                              eos_for_all=eos_for_all, reuse=reuse,
                              check_invariants=check_invariants, speculative=speculative)
    scheduler.decode_groups = decode_groups
    return scheduler
