"""Shared helpers for the test suite."""

import os

# Triton kernels run in the CPU interpreter unless a GPU session says otherwise. Triton fixes the
# mode when it is first imported, so this must precede any import of torch/triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import numpy as np
import pytest

#: the development machine's copies of the public data beside the repository: read only where
#: the data folder lacks a file (a user has the data folder, which `make test` fills)
SHARED = Path(__file__).resolve().parents[2] / "shared"
SHARED_TRACES = SHARED / "traces"


def toks(*ids: int) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


def fetch_hint(name: str) -> str:
    from testbed.data import data_dir

    return (f"{name} is not in the data folder {data_dir()}: python -m testbed.data fetch {name} "
            "(make test fetches it where its source is reachable)")


def data_file(name: str) -> Path:
    """The registered trace ``name``'s file: in the data folder (``make test`` fetches it there),
    else the copy in ``../shared/traces``; else the test skips, saying how to fetch it."""
    from testbed.data import TRACES, local_path

    trace = TRACES[name]
    for path in (local_path(trace), SHARED_TRACES / trace.filename):
        if path.is_file():
            return path
    pytest.skip(fetch_hint(name))


def data_folder(name: str, shared: Path) -> Path:
    """The registered folder ``name`` (all its files): in the data folder, else ``shared``;
    else the test skips, saying how to fetch it."""
    from testbed.data import FOLDERS, is_here, local_path

    entry = FOLDERS[name]
    if is_here(entry):
        return local_path(entry)
    if all((shared / file).is_file() for file, _, _ in entry.files):
        return shared
    pytest.skip(fetch_hint(name))


def vidur_profile() -> Path:
    """Vidur's A100 CodeLlama-34B TP2 profile (`testbed.data` ``vidur_a100_codellama34b_tp2``)."""
    return data_folder("vidur_a100_codellama34b_tp2", SHARED / "vidur" / "a100_codellama34b_tp2")


@pytest.fixture
def mooncake_conversation() -> Path:
    return data_file("mooncake_conversation")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny shapes: intra-op threads only add contention (several-fold slower on a busy host).
    Engine test modules use it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


@pytest.fixture
def compose():
    """``compose(*overrides)``: the run config composed as ``python -m testbed.run`` composes it
    (`testbed.config.assembly.compose_config`), without progress bars."""
    from testbed.config.assembly import compose_config

    return lambda *overrides: compose_config(["progress=false", *overrides])


@pytest.fixture
def examples_on_path(monkeypatch):
    """``examples/`` on the import path, as ``PYTHONPATH=examples`` puts it (docs/extending.md)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
