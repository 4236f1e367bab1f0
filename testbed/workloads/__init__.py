"""Workloads: programs of calls (requests), generators, trace loaders and arrival processes.

`build_workload` turns the ``workload`` and ``arrival`` config groups into the list of requests
every backend consumes, in arrival order (ties in generation/file order).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from testbed.workloads.arrivals import apply_arrivals
from testbed.workloads.mixed import mix
from testbed.workloads.paper import chat, few_shot, self_consistency, tree_of_thought
from testbed.workloads.request import OutputRef, Request, arrival_order
from testbed.workloads.synthetic import multimodal, random_tree, shared_prefix
from testbed.workloads.traces import TRACE_FORMATS, TraceError, load_trace, save_tokens

GENERATORS: dict[str, Callable[..., list[Request]]] = {
    "few_shot": few_shot,
    "chat": chat,
    "chat_long": chat,  # the same sessions with long answers (conf/workload/chat_long.yaml)
    "self_consistency": self_consistency,
    "tree_of_thought": tree_of_thought,
    "multimodal": multimodal,
    "shared_prefix": shared_prefix,
    "random_tree": random_tree,
}
WORKLOADS = (*GENERATORS, "mixed", "trace")

__all__ = ["GENERATORS", "OutputRef", "Request", "TraceError", "WORKLOADS", "build_workload",
           "generate", "save_tokens"]


def generate(cfg: Mapping[str, Any], seed: int = 0) -> list[Request]:
    """The requests of the configured workload, in generation/file order, before arrivals."""
    params = dict(cfg)
    name = params.pop("name", None)
    params.pop("max_in_flight", None)  # the benchmark client's concurrency: the driver's business
    if name == "trace":
        path, fmt = params.pop("path", None), params.pop("format", None)
        if not path:
            raise ValueError("workload.path must name a trace file (or data:NAME) for "
                             "workload=trace")
        if fmt is not None and fmt not in TRACE_FORMATS:
            raise ValueError(f"workload.format must be one of {', '.join(TRACE_FORMATS)}; "
                             f"got {fmt!r}")
        options = {k: v for k, v in params.items() if v is not None}
        return load_trace(path, fmt, **options)
    if name == "mixed":
        components = params.get("components") or {}
        generated = {c: generate({"name": c, **dict(sub)}, seed=seed + i)
                     for i, (c, sub) in enumerate(sorted(components.items()))}
        return mix(generated, params.get("weights") or {}, params.get("num_programs"), seed)
    if name not in GENERATORS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    try:
        return GENERATORS[name](**params, seed=seed)
    except TypeError as e:  # an unknown key, e.g. workload.sytem_prompt_len=...
        raise ValueError(f"workload={name}: {e}") from None


def build_workload(cfg: Mapping[str, Any], seed: int = 0,
                   arrival: Mapping[str, Any] | None = None) -> list[Request]:
    """Generate or load the workload, apply the arrival process, and sort by arrival."""
    requests = generate(cfg, seed=seed)
    arrival = dict(arrival or {})
    requests = apply_arrivals(requests, kind=arrival.pop("kind", "auto"),
                              is_trace=cfg.get("name") == "trace", seed=seed, **arrival)
    return arrival_order(requests)
