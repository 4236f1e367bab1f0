"""What every trace loader shares: the formats ``workload.format`` names, the options each
format's loader takes, and the error a malformed trace raises.

The loaders live in ``traces.py`` (tokens; ``load_trace`` dispatches on `TRACE_FORMATS`),
``production_traces.py`` (mooncake, bailian, azure) and ``sharegpt.py``; each imports this module,
and only ``traces.py`` imports the others (to dispatch to their loaders).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from testbed.errors import WorkloadRefused


class TraceError(WorkloadRefused):
    """A trace file that cannot be read; the message names file and line."""


@dataclass(frozen=True)
class TraceFormat:
    """One ``workload.format``: what its files hold, and the ``load_trace`` options (beyond the
    path) that its loader takes."""

    holds: str
    options: tuple[str, ...] = ()


# In the order the docs list them (traces.py's docstring has the details of each).
TRACE_FORMATS: dict[str, TraceFormat] = {
    "tokens": TraceFormat("JSONL token ids per call, read and written (any workload, saved)"),
    "mooncake": TraceFormat("Mooncake FAST'25 JSONL: lengths and 512-token block hashes"),
    "bailian": TraceFormat("Qwen/Alibaba Bailian ATC'25 JSONL: 16-token block hashes, "
                           "conversation links"),
    "azure": TraceFormat("Azure LLM inference 2023 CSV: arrival times and lengths only"),
    "sharegpt": TraceFormat("ShareGPT JSON conversations, tokenized with a local HF tokenizer",
                            options=("tokenizer",)),
}
# Every option some format takes; ``load_trace`` passes each loader only its own.
TRACE_OPTIONS: tuple[str, ...] = tuple(
    dict.fromkeys(o for f in TRACE_FORMATS.values() for o in f.options))


def require_file(path: Path) -> None:
    """Raise `TraceError` unless ``path`` is a file (``workload.path`` names it)."""
    if not path.is_file():
        raise TraceError(f"workload.path: no such file: {path}")
