"""Workloads: request records, synthetic generators and trace loaders.

`build_workload` turns the ``workload`` config group into a list of requests in arrival order.
"""

from __future__ import annotations

from typing import Any, Mapping

from testbed.workloads.generators import shared_prefix
from testbed.workloads.request import Request, arrival_order
from testbed.workloads.traces import TRACE_FORMATS, TraceError, load_trace, save_tokens

GENERATORS = {"shared_prefix": shared_prefix}
WORKLOADS = (*GENERATORS, "trace")

__all__ = ["Request", "TraceError", "WORKLOADS", "build_workload", "save_tokens"]


def build_workload(cfg: Mapping[str, Any], seed: int = 0) -> list[Request]:
    """Requests of the configured workload, in arrival order (ties in generation/file order)."""
    params = dict(cfg)
    name = params.pop("name", None)
    if name == "trace":
        path, fmt = params.get("path"), params.get("format", "tokens")
        if not path:
            raise ValueError("workload.path must name a trace file for workload=trace")
        if fmt not in TRACE_FORMATS:
            raise ValueError(f"workload.format must be one of {', '.join(TRACE_FORMATS)}; got {fmt!r}")
        return arrival_order(load_trace(path, fmt))
    if name not in GENERATORS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    try:
        return arrival_order(GENERATORS[name](**params, seed=seed))
    except TypeError as e:  # an unknown override such as workload.sytem_prompt_len=...
        raise ValueError(f"workload={name}: {e}") from None
