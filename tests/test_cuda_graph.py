"""CUDA-graph decode against the eager path it replaces: on the CPU the graph path (static
inputs, batches padded to their bucket, fixed split-KV, cascade plans padded to their shape, a
warm-up at each capture) without the graph itself (``emulate``: the replay calls the forward on
the static inputs); on a GPU with real graphs, captured on first use."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not torch.cuda.is_available()
                                 and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the graph path runs Triton kernels: no GPU and "
                                        "TRITON_INTERPRET unset")]

from testbed.cache import RadixCache  # noqa: E402
from testbed.cache.base import Lease  # noqa: E402
from testbed.engine import slot_table  # noqa: E402
from testbed.engine.cuda_graph import DecodeGraphs, GraphKey, graph_buckets  # noqa: E402
from testbed.engine.executor import EngineExecutor  # noqa: E402
from testbed.engine.loader import build_model, tiny_config  # noqa: E402
from testbed.engine.runner import ModelRunner  # noqa: E402
from testbed.scheduler.batch import Batch, BatchEntry  # noqa: E402
from testbed.scheduler.request_state import Req  # noqa: E402
from testbed.serving.serve import serve  # noqa: E402
from testbed.workloads.request import Request  # noqa: E402


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EMULATE = DEVICE == "cpu"


@pytest.fixture(scope="module")
def tiny():
    return build_model(tiny_config(), seed=0, device=DEVICE)


def test_buckets_are_powers_of_two_to_8_then_steps_of_8_then_16_and_the_maximum():
    assert graph_buckets(1) == [1]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    with pytest.raises(ValueError, match=r"^engine.cuda_graph_max_batch must be >= 1, got 0$"):
        graph_buckets(0)


def branching_requests(n: int = 11, seed: int = 0) -> list[Request]:
    """A tree of prompts (a shared system prompt cut at three depths, each request its own
    tail) arriving in waves 4 ms (steps) apart: decode batches of 1 to 11 requests that share
    prefixes."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 24)
    return [Request(f"r{i}", np.concatenate([system[:8 + 2 * (i % 3)],
                                             rng.integers(0, 256, 3 + i % 4)]).astype(np.int32),
                    np.zeros(6 + i % 5, dtype=np.int32), arrival_s=0.004 * (i // 5))
            for i in range(n)]


def served(model, attention: str, capacity: int, graphs: dict | None, n: int = 11, **scheduler):
    """Greedy generation through the scheduler; every step takes 1 ms of the executor's clock,
    so the eager and graph runs make the same scheduling decisions. ``graphs``: `DecodeGraphs`'
    settings (emulated), None: eager."""
    runner = ModelRunner(model, capacity, attention=attention)
    if graphs is not None:
        runner.graphs = DecodeGraphs(runner, emulate=EMULATE, **graphs)
    executor = EngineExecutor(runner)
    elapsed = [0.0]  # the clock moves 1 ms inside each step's forward, and nowhere else
    executor.clock = lambda: elapsed[0]
    step = runner.step
    runner.step = lambda batch: (elapsed.__setitem__(0, elapsed[0] + 1e-3), step(batch))[1]
    state, result = serve(branching_requests(n), RadixCache(capacity),
                          {"name": "lpm", **scheduler}, executor, generate=True,
                          record_steps=True)
    outputs = [(r.id, list(r.output), r.cached_tokens, r.preemptions) for r in result.reqs]
    return runner, state, result, outputs


@pytest.mark.parametrize("attention", ["triton", "cascade_triton"])
def test_the_graph_path_gives_the_eager_tokens_and_hits_across_buckets(tiny, attention,
                                                                        monkeypatch):
    """Buckets 1, 2, 4 (batches of 3 pad to 4); batches over 4 run eagerly; a pool of 80 with
    admission reserving one output token a request (clip_max_new_tokens=1): prefixes hit, are
    evicted, and decoding outgrows the pool (SGLang's retract_decode); a slot table that starts
    at 2 rows x 16 columns grows under the graphs (no graph reads it)."""
    capacity, scheduler = 80, {"clip_max_new_tokens": 1}
    _, _, _, eager = served(tiny, attention, capacity, None, **scheduler)
    monkeypatch.setattr(slot_table.SlotTable.__init__, "__defaults__", (2, 16))
    runner, state, result, graphed = served(tiny, attention, capacity,
                                            {"max_batch": 4}, **scheduler)
    assert graphed == eager
    decodes = [len(s.ids) for s in result.steps if s.kind == "decode"]
    assert {3} & set(decodes) and max(decodes) > 4  # padded, and too large for a graph
    graphs = runner.graphs
    assert graphs.replays == sum(1 for n in decodes if n <= 4) > 0
    assert {k.batch for k in graphs.graphs} >= {4}
    assert any(k.groups for k in graphs.graphs) == attention.startswith("cascade")
    assert runner.slots.rows > 2 and runner.slots.width > 16
    assert sum(o[2] or 0 for o in graphed) > 0  # hits
    assert sum(r.evicted_tokens for r in result.reqs) > 0 and state.preemptions > 0


def make_req(rid: str, prompt: list[int], slots: np.ndarray) -> Req:
    request = Request(rid, np.asarray(prompt, dtype=np.int32), np.zeros(4, dtype=np.int32))
    req = Req(request=request, prompt=request.prompt, submitted_s=0.0, seq=0)
    req.lease = Lease(hit=0, slots=np.asarray(slots, dtype=np.int32))
    return req


def test_padded_rows_write_only_the_padding_slot_and_their_logits_are_dropped(tiny):
    """Three requests padded to a bucket of 4: the step writes the three new tokens' slots and
    (the padding row's) slot 0, nothing else, and returns three rows equal to the eager
    step's."""
    def step(graphs: bool):
        runner = ModelRunner(tiny, 40, attention="triton", cuda_graph_max_batch=4,
                             **({"emulate_graphs": True} if graphs and EMULATE else
                                {"cuda_graph": graphs}))
        reqs = [make_req(f"r{i}", list(range(3 + i, 8 + i)), np.arange(1 + 8 * i, 8 + 8 * i))
                for i in range(3)]
        runner.run(Batch("prefill", [BatchEntry(r, 0, 5, True) for r in reqs]))
        for r in reqs:
            r.output.append(7)
        before = [t.clone() for t in runner.kv_cache.k]
        logits = runner.run(Batch("decode", [BatchEntry(r, 5, 1, True) for r in reqs]))
        changed = sorted(set().union(*[set(torch.nonzero((a != b).any(-1).any(-1)).flatten()
                                           .tolist()) for a, b in zip(before, runner.kv_cache.k)]))
        return logits, changed, runner

    eager, eager_changed, _ = step(False)
    graphed, changed, runner = step(True)
    assert eager_changed == [6, 14, 22] and set(changed) - {0} == {6, 14, 22}
    assert runner.graphs.replays == 1 and GraphKey(4) in runner.graphs.graphs
    assert graphed.shape == eager.shape == (3, 256)
    torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-4)


def sharing_steps(runner, steps: int = 2, cascade: bool = True):
    """Three requests on the same 4 prefix slots, each with its own, prefilled, then decoded for
    ``steps`` steps (the first plain, the others grouped when ``cascade``); the logits."""
    reqs = [make_req(f"r{i}", [5, 6, 7, 8, 9 + i], [1, 2, 3, 4, 5 + 4 * i, 6 + 4 * i,
                                                      7 + 4 * i, 8 + 4 * i]) for i in range(3)]
    runner.run(Batch("prefill", [BatchEntry(r, 0, 5, True) for r in reqs]))
    out = []
    for step in range(steps):
        for r in reqs:
            r.output.append(7 + step)
        decode = Batch("decode", [BatchEntry(r, 5 + step, 1, True) for r in reqs])
        decode.decode_groups = [(4, [0, 1, 2])] if cascade and step else []
        out.append(runner.run(decode))
    return out


def graphed_runner(tiny, attention: str, **graphs) -> ModelRunner:
    runner = ModelRunner(tiny, 40, attention=attention)
    runner.graphs = DecodeGraphs(runner, emulate=EMULATE, **{"max_batch": 4, **graphs})
    return runner


def test_a_step_that_outgrows_the_static_kv_index_space_grows_it_and_recaptures(tiny):
    """Static KV index space for 8 slots: the first decode step (18 KV slots) runs eagerly
    while the space grows (every graph dropped), the next ones replay; the same logits."""
    eager = sharing_steps(ModelRunner(tiny, 40, attention="cascade_triton"), steps=3)
    runner = graphed_runner(tiny, "cascade_triton", kv_capacity=8)
    graphed = sharing_steps(runner, steps=3)
    assert runner.graphs.static.kv_capacity == 32 and runner.graphs.replays == 2
    for a, b in zip(graphed, eager):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_capture_mid_run_warms_up_on_inputs_that_touch_only_the_padding_slot(tiny,
                                                                              monkeypatch):
    """A cascade shape is captured on first use, after a plain step's inputs were copied in:
    the warm-up and the capture run the forward on the static inputs, which must not hold the
    last step's (that would write made-up K/V into the slots of requests still running): every
    row writes and reads slot 0."""
    seen, capturing = [], []
    forward, capture = DecodeGraphs._forward, DecodeGraphs._capture

    def recording(self, inputs):  # (reading back inside a CUDA graph's capture is not allowed)
        if capturing and not (DEVICE == "cuda" and torch.cuda.is_current_stream_capturing()):
            plan = inputs.meta.plan
            parts = plan[1:] if isinstance(plan, tuple) else (plan,)
            seen.append((inputs.meta.out_slots.tolist(),
                         [p.indices[:int(p.indptr[-1])].tolist() for p in parts]))
        return forward(self, inputs)

    def flagged(self, key):
        capturing.append(key)
        try:
            return capture(self, key)
        finally:
            capturing.pop()

    monkeypatch.setattr(DecodeGraphs, "_forward", recording)
    monkeypatch.setattr(DecodeGraphs, "_capture", flagged)
    eager = sharing_steps(ModelRunner(tiny, 40, attention="cascade_triton"))
    runner = graphed_runner(tiny, "cascade_triton")
    graphed = sharing_steps(runner)
    assert [bool(k.groups) for k in runner.graphs.graphs] == [False, True]
    assert len(seen) == 2 * (1 if EMULATE else 2)  # the warm-ups
    for out_slots, indices in seen:
        assert set(out_slots) == {0} and all(set(i) <= {0} for i in indices)
    for a, b in zip(graphed, eager):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)

def test_a_shape_whose_capture_fails_runs_eagerly_and_the_failure_is_reported(tiny, monkeypatch):
    def broken(self, key):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "_capture", broken)
    runner = ModelRunner(tiny, 40, attention="triton", emulate_graphs=True,
                         cuda_graph_max_batch=4)
    reqs = [make_req(f"r{i}", list(range(3 + i, 8 + i)), np.arange(1 + 8 * i, 8 + 8 * i))
            for i in range(3)]
    runner.run(Batch("prefill", [BatchEntry(r, 0, 5, True) for r in reqs]))
    for r in reqs:
        r.output.append(7)
    logits = runner.run(Batch("decode", [BatchEntry(r, 5, 1, True) for r in reqs]))
    assert logits.shape == (3, 256) and runner.graphs.replays == 0
    assert runner.graphs.summary()["graph_capture_failures"] == {
        "4x0x0": "RuntimeError: operation not permitted when stream is capturing"}


def test_triton_layer_kernels_that_fail_here_give_way_to_their_torch_references(tiny,
                                                                               monkeypatch):
    import radix_kernels

    def broken(gate_up):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(radix_kernels, "silu_and_mul", broken, raising=False)
    with pytest.warns(UserWarning, match=r"the Triton layer kernels failed here \(RuntimeError: "
                                         r"PassManager::run failed\)"):
        runner = ModelRunner(tiny, 40, attention="triton")
    assert runner.kernels.name == "torch"
    assert EngineExecutor(runner).graph_summary()["layer_kernels_error"] == \
        "RuntimeError: PassManager::run failed"


# operators that read a tensor back to the host, or make one from host values (a copy from the
# host: neither may run inside a captured graph), or size their output by the data
READ_BACK_OR_HOST_MADE = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique",
                          "_unique2", "lift_fresh", "lift_fresh_copy", "scalar_tensor", "tensor",
                          "arange", "full", "zeros", "ones", "randn", "rand", "randint",
                          "repeat_interleave", "bincount", "_to_cpu"}


@pytest.mark.parametrize("attention", ["triton", "cascade_triton"])
def test_a_decode_forward_makes_nothing_from_the_host_and_reads_nothing_back(tiny, attention):
    """Dispatch mode over the graph path's forward (the replay, emulated): every operator
    dispatched is listed, and none reads back, makes a tensor from host values or sizes its
    output by the data; the only allocations are kernel outputs (``empty``), which a captured
    graph takes from its pool. (Inside a Triton launch the interpreter's own copies are left
    out: on a GPU the launch is one kernel.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    import triton.runtime.interpreter as interpreter

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.in_triton = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.in_triton:
                self.ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    seen = Seen()
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        seen.in_triton += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            seen.in_triton -= 1

    runner = ModelRunner(tiny, 40, attention=attention, cuda_graph_max_batch=4,
                         **({"emulate_graphs": True} if EMULATE else {"cuda_graph": True}))
    # three requests on the same 4 prefix slots, each with its own: cascade groups them
    reqs = [make_req(f"r{i}", [5, 6, 7, 8, 9 + i], [1, 2, 3, 4, 5 + 2 * i, 6 + 2 * i])
            for i in range(3)]
    runner.run(Batch("prefill", [BatchEntry(r, 0, 5, True) for r in reqs]))
    for r in reqs:
        r.output.append(7)
    decode = Batch("decode", [BatchEntry(r, 5, 1, True) for r in reqs])
    decode.decode_groups = [(4, [0, 1, 2])]
    runner.run(decode)  # captured (emulated: on first use), replayed once
    (key, captured), = [(k, c) for k, c in runner.graphs.graphs.items() if k.batch == 4
                        and bool(k.groups) == attention.startswith("cascade")]
    inputs = captured.inputs
    interpreter.InterpretedFunction.run = counted
    try:
        with seen:
            runner.graphs._forward(inputs)
    finally:
        interpreter.InterpretedFunction.run = run
    assert seen.ops and not set(seen.ops) & READ_BACK_OR_HOST_MADE
    assert {op for op in seen.ops if op.startswith("empty")} <= {"empty", "empty_like"}
