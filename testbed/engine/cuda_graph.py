"""CUDA-graph decode: a decode step's forward captured once per batch-size bucket and replayed.

An eager decode step launches a thousand small kernels, and on a GPU the host's launching them
costs more than their work (`docs/design.md` §6). A captured graph launches them all at once.
A graph replays fixed addresses and shapes, so:

- a decode step of ``n`` requests is padded to its bucket ``b >= n`` (1, 2, 4, 8, then steps of
  8 to 64 and of 16 beyond, up to ``engine.cuda_graph_max_batch``): the extra rows read and write
  only the padding slot (slot-table row 0, `testbed.engine.slot_table.PAD_ROW`) and their logits
  are dropped;
- its inputs live in static tensors, shared by every graph (`StaticDecodeInputs`), into which each
  step's inputs are copied on the device before the replay: token ids, positions, the slots its
  new K/V go to and the KV index arrays its attention reads (the plan), the cascade plan's too;
- the split-KV decode kernel runs a fixed number of chunks (`MAX_KV_SPLITS`): the KV lengths
  vary from replay to replay, the grid may not;
- a cascade step (requests sharing prefixes, `testbed.engine.cascade`) is captured per
  ``(b, groups, width)``, the two padded up to powers of two, on first use (at most
  `MAX_CASCADE_GRAPHS` of them); the plain buckets are captured when the engine starts.

Prefill and mixed steps run eagerly. The attention backend must plan decode steps with shapes
fixed by the batch (``graphable``: Triton's paged kernels; the torch backend pads to the longest
KV). Capture time and the graphs' memory are reported (`summary`); a capture that happens during
a run is not counted in its step's time (`EngineExecutor`).

On a device without CUDA graphs (``emulate``: the CPU, in tests) "capture" keeps the static
inputs and "replay" calls the forward on them: every step of the graph path but the graph itself
runs, so the padding and the static inputs are checked on the CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from testbed.engine.attention import MAX_KV_SPLITS, FlatKV
from testbed.engine.cascade import MAX_PREFIX_SPLITS, CascadePlan
from testbed.engine.metadata import AttentionMetadata, StepInputs


MAX_CASCADE_GRAPHS = 64  # cascade shapes captured on first use, then replayed; beyond: eager


def graph_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes captured: 1, 2, 4, 8, steps of 8 to 64, steps of 16 beyond (SGLang's
    and vLLM's shape), and ``max_batch`` itself."""
    if max_batch < 1:
        raise ValueError(f"engine.cuda_graph_max_batch must be >= 1, got {max_batch}")
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def plan_parts(plan: Any) -> tuple[FlatKV, ...]:
    """The flat KV parts of a decode plan: its requests', or a cascade's suffixes and prefixes."""
    return tuple(plan[1:]) if isinstance(plan, tuple) else (plan,)


@dataclass(frozen=True)
class GraphKey:
    """A captured shape: ``batch`` rows; ``groups`` x ``width`` cascade member places (0: plain
    decode)."""

    batch: int
    groups: int = 0
    width: int = 0


class StaticDecodeInputs:
    """The tensors every graph reads, sized once for the largest bucket; ``kv_capacity`` KV
    slots of index space per plan part (grown, and every graph dropped, if a step needs more)."""

    def __init__(self, max_batch: int, kv_capacity: int, device: torch.device) -> None:
        self.max_batch, self.kv_capacity, self.device = max_batch, kv_capacity, device
        z = lambda n: torch.zeros(n, dtype=torch.int64, device=device)  # noqa: E731
        rows = max_batch + 1
        self.input_ids, self.positions, self.out_slots = z(max_batch), z(max_batch), z(max_batch)
        self.kv_indptr = z(rows)
        self.kv_indices = torch.zeros(kv_capacity, dtype=torch.int32, device=device)
        self.prefix_indptr = z(rows)
        self.prefix_indices = torch.zeros(kv_capacity, dtype=torch.int32, device=device)
        self.gather = z(2 * max_batch * max_batch)  # groups x width (each at most 2 x batch)
        self.places = z(max_batch)
        self.grouped = torch.zeros(max_batch, dtype=torch.bool, device=device)
        self.reset()

    def reset(self) -> None:
        """Inputs a warm-up or capture may run on: every row one token at position 0 reading and
        writing only the padding slot. (The last step's inputs would have it write its
        made-up K/V over the slots of requests still running.)"""
        for t in (self.input_ids, self.positions, self.out_slots, self.kv_indices,
                  self.prefix_indices, self.gather, self.places, self.grouped):
            t.zero_()
        for t in (self.kv_indptr, self.prefix_indptr):
            torch.arange(len(t), out=t)

    def step_inputs(self, key: GraphKey) -> tuple[Any, ...]:
        """(ids, positions, meta) of a graph of shape ``key``, as views of these tensors."""
        b = key.batch
        ones = np.ones(b, dtype=np.int64)
        kv = FlatKV(self.kv_indptr[:b + 1], self.kv_indices, MAX_KV_SPLITS)
        meta = AttentionMetadata(qo_indptr=None, kv=None, table=None,
                                 out_slots=self.out_slots[:b], last_token_index=None,
                                 qo_lens=ones, kv_lens=ones, rows=np.zeros(b, dtype=np.int64),
                                 num_kv_splits=MAX_KV_SPLITS)
        if key.groups:
            g, w = key.groups, key.width
            plan = CascadePlan(suffix=None, prefix=None, gather=self.gather[:g * w],
                               places=self.places[:b], grouped=self.grouped[:b],
                               num_groups=g, width=w)
            prefix = FlatKV(self.prefix_indptr[:g + 1], self.prefix_indices, MAX_PREFIX_SPLITS)
            meta.cascade, meta.plan = plan, (plan, kv, prefix)
        else:
            meta.plan = kv
        return self.input_ids[:b], self.positions[:b], meta

    def fits(self, plan: Any) -> bool:
        return all(len(p.indices) <= self.kv_capacity for p in plan_parts(plan))

    def load(self, key: GraphKey, inputs: StepInputs) -> None:
        """Copy a step's inputs (padded to ``key.batch`` rows) in, on the device."""
        b = key.batch
        self.input_ids[:b].copy_(inputs.input_ids)
        self.positions[:b].copy_(inputs.positions)
        self.out_slots[:b].copy_(inputs.meta.out_slots)
        plan = inputs.meta.plan
        kv = plan[1] if key.groups else plan
        self.kv_indptr[:b + 1].copy_(kv.indptr)
        self.kv_indices[:len(kv.indices)].copy_(kv.indices)
        if key.groups:
            cascade, prefix = plan[0], plan[2]
            g, w = key.groups, key.width
            self.prefix_indptr[:g + 1].copy_(prefix.indptr)
            self.prefix_indices[:len(prefix.indices)].copy_(prefix.indices)
            self.gather[:g * w].copy_(cascade.gather)
            self.places[:b].copy_(cascade.places)
            self.grouped[:b].copy_(cascade.grouped)


@dataclass
class Captured:
    graph: Any  # torch.cuda.CUDAGraph, or None when emulated
    inputs: Any  # the StepInputs the graph reads
    logits: torch.Tensor | None  # what the graph writes


class DecodeGraphs:
    """The runner's captured decode steps (module docstring)."""

    def __init__(self, runner: Any, max_batch: int, emulate: bool = False,
                 kv_capacity: int | None = None) -> None:
        """``kv_capacity``: KV index space per plan part (default: the pool plus a slot per row,
        or 2,048 tokens a row if more); a step that needs more grows it."""
        self.runner = runner  # a ModelRunner (which imports this module): its model, KV
        #                       buffers, attention and kernels run the forward
        self.buckets = graph_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.emulate = emulate or runner.device.type != "cuda"
        if kv_capacity is None:
            kv_capacity = max(runner.num_slots + self.max_batch, self.max_batch * 2048)
        self.static = StaticDecodeInputs(self.max_batch, kv_capacity, runner.device)
        self.graphs: dict[GraphKey, Captured] = {}
        self.pool = None if self.emulate else torch.cuda.graph_pool_handle()
        self.capture_s = 0.0  # every capture, warm-up included
        self.memory_bytes = 0  # the graphs' pool, as the allocator reserved it
        self.replays = 0
        self.recaptures = 0
        self.failed: dict[GraphKey, str] = {}  # shapes whose capture failed: eager, and why  # graphs dropped because a step outgrew the static KV index space

    # ------------------------------------------------------------------ which steps
    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def key(self, n: int, groups: list[tuple[int, list[int]]]) -> GraphKey | None:
        """The graph a decode step of ``n`` requests (cascade ``groups``) replays, or None: it
        runs eagerly (too many requests, or too many cascade shapes captured already)."""
        b = self.bucket(n)
        if b is None:
            return None
        if not groups:
            return GraphKey(b)
        key = GraphKey(b, next_power_of_two(len(groups)),
                       max(2, next_power_of_two(max(len(m) for _, m in groups))))
        cascades = sum(1 for k in self.graphs if k.groups)
        if key not in self.graphs and cascades >= MAX_CASCADE_GRAPHS:
            return None
        return key

    # ------------------------------------------------------------------ capture and replay
    @torch.inference_mode()
    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        r = self.runner
        return r.model(inputs.input_ids, inputs.positions, inputs.meta, r.kv_cache, r.attention,
                       r.kernels)

    def capture_buckets(self) -> None:
        """Capture every plain bucket, largest first (later, smaller graphs reuse the pool)."""
        for b in reversed(self.buckets):
            self._capture(GraphKey(b))

    def _capture(self, key: GraphKey) -> Captured:

        started = time.perf_counter()
        self.static.reset()
        ids, positions, meta = self.static.step_inputs(key)
        inputs = StepInputs(input_ids=ids, positions=positions, meta=meta)
        if self.emulate:  # the warm-up a capture runs, so that the CPU checks what it writes
            self._forward(inputs)
            captured = Captured(None, inputs, None)
        else:
            # what the allocator holds once its unused cache is let go (torch.cuda.graph lets
            # it go on entry): the growth is the graph pool's
            torch.cuda.synchronize(self.runner.device)
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved(self.runner.device)
            stream = torch.cuda.Stream(self.runner.device)
            stream.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(stream):  # compile and warm up outside the capture
                for _ in range(2):
                    self._forward(inputs)
            torch.cuda.current_stream(self.runner.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._forward(inputs)
            torch.cuda.synchronize(self.runner.device)
            torch.cuda.empty_cache()
            self.memory_bytes += torch.cuda.memory_reserved(self.runner.device) - reserved
            captured = Captured(graph, inputs, logits)
        self.graphs[key] = captured
        self.capture_s += time.perf_counter() - started
        return captured

    def run(self, key: GraphKey, inputs: StepInputs, n: int) -> torch.Tensor | None:
        """Logits ``[n, vocab]`` of a decode step planned for ``key`` (padded to its batch), by
        replaying its graph; None if the step's KV index arrays outgrew the static ones (they
        are grown, every graph dropped, and the step runs eagerly)."""
        if not self.static.fits(inputs.meta.plan):
            need = max(len(p.indices) for p in plan_parts(inputs.meta.plan))
            capacity = self.static.kv_capacity
            while capacity < need:
                capacity *= 2
            self.static = StaticDecodeInputs(self.max_batch, capacity, self.runner.device)
            self.recaptures += len(self.graphs)
            self.graphs.clear()
            return None
        captured = self.graphs.get(key)
        if captured is None:
            if key in self.failed:
                return None
            try:
                captured = self._capture(key)
            except Exception as e:  # noqa: BLE001 - this shape runs eagerly from now on
                self.failed[key] = f"{type(e).__name__}: {e}"[:500]
                return None
        self.static.load(key, inputs)
        self.replays += 1
        if captured.graph is None:
            return self._forward(captured.inputs)[:n]
        captured.graph.replay()
        return captured.logits[:n]

    def summary(self) -> dict[str, Any]:
        return {"cuda_graph": not self.emulate, "graph_buckets": len(self.buckets),
                "graph_max_batch": self.max_batch,
                "graphs_captured": len(self.graphs), "graph_capture_s": self.capture_s,
                "graph_memory_bytes": self.memory_bytes, "graph_replays": self.replays,
                "graph_recaptures": self.recaptures,
                **({"graph_capture_failures": {f"{k.batch}x{k.groups}x{k.width}": why
                                               for k, why in self.failed.items()}}
                   if self.failed else {})}

