"""Workloads: programs of calls (requests), generators, trace loaders and arrival processes.

`build_workload` turns the ``workload`` and ``arrival`` config groups into the list of requests
every backend consumes, in arrival order (ties in generation/file order). `WORKLOADS` holds the
generators and loaders by name; ``workload=custom workload.target=module.function`` takes any
function of the group's other keys (and ``seed``) that returns a list of `Request`.
"""

from __future__ import annotations

from typing import Any, Mapping

from testbed.errors import BadInput, check_choice
from testbed.config.registry import Registry
from testbed.workloads.arrivals import Arrival
from testbed.workloads.beam_search import beam_search
from testbed.workloads.beyond_prefix import paraphrase, rag
from testbed.workloads.checks import check_workload
from testbed.workloads.mixed import mix
from testbed.workloads.paper import (chat, chat_tenants, few_shot, self_consistency,
                                     tree_of_thought)
from testbed.workloads.request import OutputRef, Request, arrival_order
from testbed.workloads.rag_text import paraphrase_text, rag_text
from testbed.workloads.text import few_shot_text, sharegpt, sharegpt_chat
from testbed.workloads.copy_text import copy_text
from testbed.workloads.synthetic import multimodal, random_tree, shared_prefix
from testbed.workloads.traces import TRACE_FORMATS, TraceError, load_trace, save_tokens

WORKLOADS = Registry("workload", run_keys=("max_in_flight",), context_keys=("seed",),
                     what="a workload (a function returning a list of Request)")
for _name, _generator in (("few_shot", few_shot), ("chat", chat),
                          ("chat_long", chat),  # long answers: conf/workload/chat_long.yaml
                          ("chat_tenants", chat_tenants),
                          ("self_consistency", self_consistency),
                          ("tree_of_thought", tree_of_thought), ("multimodal", multimodal),
                          ("shared_prefix", shared_prefix), ("random_tree", random_tree),
                          ("beam_search", beam_search),
                          ("rag", rag), ("paraphrase", paraphrase),
                          # text through a tokenizer and chat template (text.py, rag_text.py)
                          ("sharegpt", sharegpt), ("sharegpt_chat", sharegpt_chat),
                          ("few_shot_text", few_shot_text), ("rag_text", rag_text),
                          ("paraphrase_text", paraphrase_text), ("copy_text", copy_text)):
    WORKLOADS.register(_name, _generator)


@WORKLOADS.register("mixed")
def mixed(components: Mapping[str, Mapping[str, Any]] | None = None,
          weights: Mapping[str, float] | None = None, num_programs: int | None = None,
          seed: int = 0) -> list[Request]:
    """Whole programs of each component workload (each its own group), drawn ∝ weight."""
    generated = {c: generate({"name": c, **dict(sub)}, seed=seed + i)
                 for i, (c, sub) in enumerate(sorted((components or {}).items()))}
    return mix(generated, weights or {}, num_programs, seed)


@WORKLOADS.register("trace")
def trace(path: str | None = None, format: str | None = None,
          tokenizer: str | None = None) -> list[Request]:
    """A recorded trace file, or ``data:NAME`` (docs/design.md §3)."""
    if not path:
        raise BadInput("workload.path must name a trace file (or data:NAME) for workload=trace")
    check_choice("workload.format", format, TRACE_FORMATS, null=True)
    return load_trace(path, format, **({"tokenizer": tokenizer} if tokenizer else {}))


__all__ = ["OutputRef", "Request", "TraceError", "WORKLOADS", "build_workload", "generate",
           "save_tokens"]


def generate(cfg: Mapping[str, Any], seed: int = 0) -> list[Request]:
    """The requests of the configured workload, in generation/file order, before arrivals."""
    resolved = WORKLOADS.resolve(cfg)
    requests = resolved.build(seed=seed)
    if not isinstance(requests, list) or not all(isinstance(r, Request) for r in requests):
        raise BadInput(f"workload={resolved.label} must return a list of "
                       "testbed.workloads.Request")
    return requests


def build_workload(cfg: Mapping[str, Any], seed: int = 0,
                   arrival: Mapping[str, Any] | Arrival | None = None) -> list[Request]:
    """Generate or load the workload, apply the arrival process, check it (`check_workload`:
    ids, ``after``, prompts) and sort by arrival."""
    if not isinstance(arrival, Arrival):  # checked before anything is generated
        arrival = Arrival.from_mapping(arrival, is_trace=cfg.get("name") == "trace")
    requests = arrival.apply(generate(cfg, seed=seed), seed=seed)
    check_workload(requests)  # every backend alike, before anything runs
    return arrival_order(requests)
