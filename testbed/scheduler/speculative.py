"""The ``speculative`` block, checked (`SpeculativeConfig`), and the drafter it names.

Speculative decoding (docs/design.md §4, "Speculative decoding"): a decode step may carry, for
each running request, up to ``num_tokens`` drafted tokens, which the executor verifies in the
same forward (queries: the request's last token, then its drafts, causal among them, against its
whole prefix). The scheduler drafts (the drafter sees only the request's own context, so the
simulator and the engine draft alike), takes KV slots for the drafts for the step, and when the
step's results apply keeps the verified tokens' slots and gives the rejected ones back.

``method``: ``none`` (plain decoding, the default), ``ngram`` (prompt lookup,
`testbed.scheduler.ngram`), ``draft`` (the served model's first ``draft_layers`` layers as a
self-speculative draft model, run by the engine: `testbed.engine.draft_model`; the scheduler
takes room for ``num_tokens`` placeholder drafts a step, which the engine fills).
``acceptance`` is the simulator's: ``exact`` compares the drafts with the workload's output (what
the engine accepts when it replays that output), ``geometric`` accepts each draft with
probability ``accept_rate`` until the first rejection (a configured distribution), ``recorded``
replays the accepted counts a run recorded (``acceptance_path``: its directory or its
``requests.jsonl``), request by request, step by step (`testbed.sim.acceptance`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

import numpy as np

from testbed.errors import BadInput, check_choice
from testbed.config.group_values import check_setting
from testbed.scheduler.ngram import NO_DRAFT, ngram_branches, ngram_draft

METHODS = ("none", "ngram", "draft")
ACCEPTANCE = ("exact", "geometric", "recorded")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "none"
    num_tokens: int = 4  # drafts per request per step (k)
    tree_width: int = 1  # branches of the token tree under the last token (1: a chain)
    ngram_min: int = 1  # prompt lookup: the shortest suffix matched
    ngram_max: int = 3  # ... and the longest (tried first)
    acceptance: str = "exact"  # the simulator's: exact | geometric | recorded
    accept_rate: float = 0.7  # geometric: each draft accepted with this probability
    acceptance_path: str | None = None  # recorded: a speculative run's directory or requests.jsonl
    draft_layers: int = 8  # draft: the served model's first layers that draft

    @property
    def active(self) -> bool:
        return self.method != "none"

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any] | None) -> "SpeculativeConfig":
        cfg = dict(cfg or {})
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(cfg) - set(known))
        if unknown:
            raise BadInput(f"speculative.{unknown[0]} is not a setting of speculative; allowed: "
                           f"{', '.join(known)}")
        config = cls(**{k: check_setting(f"speculative.{k}", known[k], v)
                        for k, v in cfg.items() if v is not None})
        config.validate()
        return config

    def validate(self) -> None:
        check_choice("speculative.method", self.method, METHODS)
        check_choice("speculative.acceptance", self.acceptance, ACCEPTANCE)
        for key in ("num_tokens", "ngram_min", "ngram_max", "tree_width", "draft_layers"):
            if getattr(self, key) < 1:
                raise BadInput(f"speculative.{key} must be >= 1, got {getattr(self, key)}")
        if self.ngram_max < self.ngram_min:
            raise BadInput(f"speculative.ngram_max ({self.ngram_max}) must be >= "
                           f"speculative.ngram_min ({self.ngram_min})")
        if self.acceptance == "recorded" and not self.acceptance_path:
            raise BadInput("speculative.acceptance=recorded needs speculative.acceptance_path (a "
                           "speculative run's directory or its requests.jsonl)")
        if self.acceptance_path is not None and not isinstance(self.acceptance_path, str):
            raise BadInput(f"speculative.acceptance_path must be a path, got "
                           f"{self.acceptance_path!r}")
        if not 0.0 <= self.accept_rate <= 1.0:
            raise BadInput(f"speculative.accept_rate must be in [0, 1], got {self.accept_rate}")

    def drafter(self) -> Callable[[np.ndarray, int], np.ndarray] | None:
        """``draft(context, k)``: at most ``k`` drafted tokens after ``context`` (None: plain
        decoding)."""
        if self.method == "ngram":
            lo, hi = self.ngram_min, self.ngram_max
            return lambda context, k: ngram_draft(context, k, lo, hi)
        if self.method == "draft":  # placeholders the engine's draft model fills
            return lambda context, k: np.full(k, -1, dtype=NO_DRAFT.dtype)
        return None

    def tree_drafter(self) -> Callable[[np.ndarray, int, int], list[np.ndarray]] | None:
        """``branches(context, k, width)``: a token tree's branches (`ngram_branches`)."""
        if self.method == "ngram":
            lo, hi = self.ngram_min, self.ngram_max
            return lambda context, k, width: ngram_branches(context, k, lo, hi, width)
        return None

    def summary(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_speculative(config: SpeculativeConfig, scheduler: Any, backend: str,
                      replicas: int = 1) -> None:
    """The combinations speculative decoding does not serve, refused in one line: it needs
    SGLang's scheduler without overlap (a step's drafts are read from its request's applied
    output), a backend with steps (sim or engine) and one replica."""
    if not config.active:
        return
    if getattr(scheduler, "overlap", None) is None:
        raise BadInput(f"speculative.method={config.method} needs SGLang's scheduler (any "
                       "scheduler option but vllm)")
    if scheduler.overlap:
        raise BadInput(f"speculative.method={config.method} needs scheduler.overlap=false (a "
                       "request is drafted from its applied output)")
    if backend not in ("sim", "engine"):
        raise BadInput(f"speculative.method={config.method} needs backend=sim or "
                       f"backend=engine; got backend={backend}")
    if replicas != 1:
        raise BadInput(f"speculative.method={config.method} needs replicas=1; got {replicas}")
    if config.method == "draft" and backend == "sim" and config.acceptance == "exact":
        raise BadInput("speculative.method=draft on the simulator needs "
                       "speculative.acceptance=geometric (the simulator runs no draft model)")


def check_draft_layers(config: SpeculativeConfig, layers: int | None) -> None:
    """``method=draft`` drafts with the served model's first ``draft_layers`` of its ``layers``:
    at least one, and fewer than all (refused before the workload is generated; None: the
    model's depth is not known yet)."""
    if config.method != "draft" or layers is None:
        return
    if not 1 <= config.draft_layers < layers:
        raise BadInput(f"speculative.draft_layers must be in 1..{layers - 1} (the model has "
                       f"{layers} layers); got {config.draft_layers}")


def check_tree(config: SpeculativeConfig, cache: str | None, page_size: int,
               attention: str | None, temperature: float) -> None:
    """A token tree (``tree_width`` > 1) moves its accepted branch's slots next to the last
    token's: a radix cache of page 1 only (block_hash and pages place a token's KV by its
    position); the engine masks it with torch attention only; greedy only (the multi-branch
    rejection rule is not built)."""
    if not config.active or config.tree_width == 1:
        return
    what = f"speculative.tree_width={config.tree_width}"
    if config.method != "ngram":
        raise BadInput(f"{what} needs speculative.method=ngram (the draft model drafts one "
                       f"chain); got {config.method}")
    if cache != "radix" or page_size != 1:
        raise BadInput(f"{what} needs cache=radix with cache.page_size=1; got cache={cache} "
                       f"page_size={page_size}")
    if attention is not None and attention.endswith("triton"):
        raise BadInput(f"{what} needs engine.attention=torch (or cascade_torch): the tree mask "
                       f"is not in the Triton kernels; got {attention}")
    if temperature > 0:
        raise BadInput(f"{what} is greedy only (engine.temperature=0); got {temperature}")
