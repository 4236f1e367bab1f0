"""Public traces on demand: a registry pinned by URL and SHA-256, and a data folder to fetch into.

``python -m testbed.data list`` shows the registry and what is already here; ``python -m
testbed.data fetch NAME...`` downloads. ``workload.path=data:NAME`` in any run resolves to the
file in the data folder (fetching it on first use) and sets ``workload.format`` from the entry
(docs/design.md §3).
"""

from testbed.data.fetch import (PREFIX, DataError, Fetched, data_dir, describe_fetch, download,
                                fetch, local_path, lookup, resolve_trace, sha256_of)
from testbed.data.registry import TRACES, Trace

__all__ = ["PREFIX", "TRACES", "DataError", "Fetched", "Trace", "data_dir", "describe_fetch",
           "download", "fetch", "local_path", "lookup", "resolve_trace", "sha256_of"]
