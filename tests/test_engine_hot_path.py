"""The engine's per-step hot path: the slot table on the device is appended, not rebuilt; no layer
reads anything back from the device; on CUDA the KV pool is sized from free memory."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

from testbed.cache import RadixCache  # noqa: E402
from testbed.engine.executor import EngineExecutor  # noqa: E402
from testbed.engine.kv_cache import KVCache  # noqa: E402
from testbed.engine.loader import build_model, tiny_config  # noqa: E402
from testbed.engine.runner import (ModelRunner, kv_pool_slots,  # noqa: E402
                                   kv_slots_for_free_memory)
from testbed.engine.slot_table import SlotTable  # noqa: E402
from testbed.serving.serve import serve  # noqa: E402
from testbed.workloads.request import Request  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    return build_model(tiny_config(), seed=0)


def sharing_requests(n_out: int = 6, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 40)
    return [Request(f"r{i}", np.concatenate([system, rng.integers(0, 256, 5 + i)]).astype(np.int32),
                    np.zeros(n_out, dtype=np.int32), arrival_s=10.0 * (i // 3))
            for i in range(6)]


class Recording(SlotTable):
    """A slot table that records how many columns each step writes and checks its rows."""

    def __init__(self, device) -> None:
        super().__init__(device, rows=2, width=16)  # small: rows and columns must grow
        self.written: list[tuple[int, int]] = []  # per step: (columns written, new tokens)

    def update(self, entries):
        rows, writes = super().update(entries)
        self.written.append((len(writes[0]), sum(e.new for e in entries)))
        self.last = (entries, rows)
        return rows, writes

    def apply(self, *writes) -> None:
        super().apply(*writes)
        entries, rows = self.last
        for e, row in zip(entries, rows):  # the device row holds the entry's slots
            kv = e.kv_slots()
            assert self.table[row, :len(kv)].tolist() == kv.tolist(), e.req.id


def test_the_slot_table_is_appended_each_step_and_follows_the_caches_slots(tiny):
    runner = ModelRunner(tiny, num_slots=300)
    runner.slots = table = Recording(runner.device)
    _, result = serve(sharing_requests(), RadixCache(300), {"name": "lpm"},
                      EngineExecutor(runner))
    assert all(r.output and r.cached_tokens is not None for r in result.reqs)
    assert sum(r.cached_tokens for r in result.reqs) >= 40 * 3
    decodes = [(w, new) for w, new in table.written if w <= new]
    assert len(decodes) >= 0.7 * len(table.written)  # most steps write only their new tokens
    total_written = sum(w for w, _ in table.written)
    total_new = sum(new for _, new in table.written)
    # each request's row is filled once from its first admission (cached prefix included) and
    # rewritten only where the cache replaced duplicate slots: far from a rebuild per step
    prompts = sum(len(r.prompt) for r in result.reqs)
    assert total_written <= total_new + prompts
    assert table.rows >= 4 and table.width >= 64  # grew from 2 x 16
    # rows are given back at the next step after a request finishes: only the last ones remain
    assert all(r.finished for r in table.row_of) and len(table.row_of) <= 3


SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__",
                "__index__")


@pytest.fixture
def sync_spy(monkeypatch):
    """Counts calls that read a tensor back to the host (a device sync on CUDA) made from the
    project's own code (the engine, the kernels' wrappers), while ``spy.armed``."""
    spy = SimpleNamespace(armed=False, calls=[])
    ours = (str(REPO / "testbed"), str(REPO / "radix_kernels"), "radix_kernels")

    def wrap(name, original):
        def method(self, *args, **kwargs):
            if spy.armed:
                caller = sys._getframe(1).f_code.co_filename
                if "site-packages" not in caller and any(p in caller for p in ours):
                    spy.calls.append(f"{name} from {caller}:{sys._getframe(1).f_lineno}")
            return original(self, *args, **kwargs)
        return method

    for name in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    return spy


@pytest.mark.parametrize("attention", ["torch", "triton", "cascade_torch", "cascade_triton"])
def test_no_layer_reads_from_the_device(tiny, sync_spy, monkeypatch, attention):
    """Prefill behind a cached prefix and decode steps (cascaded too): `forward` (every layer)
    makes no call that needs the device's values on the host; the maxima come from the step's
    metadata."""
    if attention.endswith("triton") and not torch.cuda.is_available() \
            and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET unset")
    if attention.endswith("triton") and torch.cuda.is_available():
        tiny = build_model(tiny_config(), seed=0, device="cuda")
    runner = ModelRunner(tiny, num_slots=300, attention=attention)
    forward = runner.forward

    def armed_forward(inputs):
        sync_spy.armed = True
        try:
            return forward(inputs)
        finally:
            sync_spy.armed = False

    monkeypatch.setattr(runner, "forward", armed_forward)
    requests = sharing_requests(n_out=3)[:4]
    _, result = serve(requests, RadixCache(300), {"name": "lpm"}, EngineExecutor(runner),
                      record_steps=True)
    kinds = {s.kind for s in result.steps}
    assert kinds == {"prefill", "decode"} and any(max(s.context) > 0 for s in result.steps
                                                  if s.kind == "prefill")
    assert sync_spy.calls == []


def test_the_spy_sees_a_host_read_in_a_kernel_wrapper(sync_spy):
    """The spy is not blind: the extend kernel's wrapper without ``max_new`` reads it back."""
    from radix_kernels import reference

    q = torch.randn(3, 4, 16)
    buf = torch.randn(9, 2, 16)
    sync_spy.armed = True
    reference.extend_attention(q, buf, buf, torch.tensor([0, 3]), torch.tensor([0, 5]),
                               torch.tensor([1, 2, 3, 4, 5]))
    sync_spy.armed = False
    assert any(c.startswith("tolist") for c in sync_spy.calls)


# ---------------------------------------------------------------------------- KV pool size
def test_the_kv_pool_takes_what_free_memory_leaves_after_the_weights(monkeypatch, tiny):
    per_token = KVCache.bytes_per_token(tiny.config, torch.float32)
    assert per_token == 2 * 2 * 2 * 16 * 4
    gib = 2**30
    assert kv_slots_for_free_memory(60 * gib, 80 * gib, 0.9, 512) == (60 - 8) * gib // 512
    assert kv_slots_for_free_memory(60 * gib, 80 * gib, 0.9, 512, cap=1000) == 1000
    with pytest.raises(ValueError, match="no device memory left for KV.*cache.capacity_tokens"):
        kv_slots_for_free_memory(7 * gib, 80 * gib, 0.9, 512)

    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 30 * gib, 40 * gib

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    on_cuda = SimpleNamespace(device=torch.device("cuda:0"), config=tiny.config,
                              dtype=torch.bfloat16)
    want = int((30 - 0.1 * 40) * gib // (per_token // 2))
    assert kv_pool_slots(on_cuda, 0.9) == want and asked == [torch.device("cuda:0")]
    assert kv_pool_slots(on_cuda, 0.9, max_slots=5000) == 5000
    with pytest.raises(ValueError, match="on CUDA only; on cpu give num_slots"):
        ModelRunner(tiny, num_slots=None)


def decode_slots(in_place: bool, tiny) -> tuple[list[list[int]], dict[str, list[int]]]:
    """Four requests decoding 40 tokens together on the engine: each one's output, and the slots
    its decoded tokens took (the pool keeping runs, or handing slots out in turn)."""
    rng = np.random.default_rng(1)
    requests = [Request(f"r{i}", rng.integers(0, 256, 12 + i).astype(np.int32),
                        np.zeros(40, dtype=np.int32)) for i in range(4)]
    executor = EngineExecutor(ModelRunner(tiny, num_slots=600))
    executor.reads_kv_in_place = in_place
    decoded: dict[str, list[int]] = {}
    launch = executor.launch

    def keeping(batch):
        if batch.kind == "decode":
            for e in batch.entries:
                decoded.setdefault(e.req.id, []).append(int(e.kv_slots()[-1]))
        return launch(batch)

    executor.launch = keeping
    _, result = serve(requests, RadixCache(600), {"name": "lpm"}, executor, generate=True)
    return [list(r.output) for r in sorted(result.reqs, key=lambda r: r.id)], decoded


def test_the_engines_pool_keeps_each_requests_decoded_tokens_in_runs_and_the_tokens_agree(tiny):
    outputs, runs = decode_slots(True, tiny)
    same, in_turn = decode_slots(False, tiny)
    assert outputs == same  # where the KV lies changes no token
    jumps = {r: int(np.count_nonzero(np.diff(s) != 1)) for r, s in runs.items()}
    # 39 decode steps each (the first token comes from the prefill): in runs of 32, the last
    # request's straight on after its prompt (where the others' next slots are taken)
    assert all(len(s) == 39 for s in runs.values()) and max(jumps.values()) <= 2
    assert all(np.count_nonzero(np.diff(s) != 1) == 38 for s in in_turn.values())


def test_the_servers_engine_keeps_runs_and_the_simulators_pool_does_not():
    from testbed.config.assembly import assemble, compose_config
    from testbed.backends.engine_assembly import build_engine_parts
    from testbed.serving.serve import keep_runs_for
    from testbed.sim.executor import SimExecutor

    run = assemble(compose_config(["backend=engine", "model=tiny", "hardware=cpu",
                                   "progress=false"]))
    assert build_engine_parts(run, 2000, []).cache.pool.keep_runs  # testbed.serve's assembly
    cache = RadixCache(2000)
    keep_runs_for(SimExecutor(run.build_cost_model()), cache)
    assert not cache.pool.keep_runs
