"""Shared helpers for the test suite."""

import os

# Triton kernels run in the CPU interpreter unless a GPU session says otherwise. Triton fixes the
# mode when it is first imported, so this must precede any import of torch/triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import numpy as np
import pytest

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def toks(*ids: int) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


@pytest.fixture
def mooncake_conversation() -> Path:
    path = SHARED_TRACES / "mooncake_conversation_trace.jsonl"
    if not path.is_file():
        pytest.skip(f"real trace not present: {path}")
    return path


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
    (`testbed.assembly.compose_config`), without progress bars."""
    from testbed.assembly import compose_config

    return lambda *overrides: compose_config(["progress=false", *overrides])


@pytest.fixture
def examples_on_path(monkeypatch):
    """``examples/`` on the import path, as ``PYTHONPATH=examples`` puts it (docs/extending.md)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
