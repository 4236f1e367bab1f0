"""`ModelRunner`: runs one scheduler `Batch` through the model (vLLM's name).

It owns the model, the KV buffers, the slot table (and its token table) and the attention
backend. `prepare` is the only place a step's inputs are built: the new tokens of every entry
concatenated (``entry.input_ids()``; a decode step's are read on the device from the token
table, where each request's last step left its token: `store_tokens`), their positions ``context .. context + new - 1``, the slot-table writes
that bring each entry's row up to its KV slots (``entry.kv_slots()``: positions ``0 .. context +
new - 1``, of which the last ``new`` are written in this step), and the `AttentionMetadata` —
all in one host-to-device transfer into the runner's persistent `StepBuffers`; the index arrays
the kernels read are gathered on the device before the forward runs. A decode step replays a
CUDA graph when the runner has them (`testbed.engine.cuda_graph`), padded to its bucket.
The slots come from the prefix cache; the runner only checks the new ones exist. Entries that
reuse chunks' KV (``reuse``) run through `testbed.engine.blend` instead, and a batch's
``kv_copies`` after the forward (`run`).

On CUDA without a given ``num_slots`` the KV pool takes what the device's free memory leaves
once the weights are loaded (`kv_slots_for_free_memory`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import numpy as np
import torch

from testbed.engine.attention import MAX_KV_SPLITS, AttentionBackend, make_attention
from testbed.engine.blend import blend_prefill
from testbed.engine.cascade import CascadePlan, device_slots, split_wide
from testbed.engine.cpu_attention import load_kernel
from testbed.engine.cpu_layers import native_or_torch
from testbed.engine.cuda_graph import DecodeGraphs, GraphKey
from testbed.engine.kv_cache import KVCache
from testbed.engine.layer_kernels import kernels_for
from testbed.engine.linear import prepare_linears
from testbed.engine.metadata import AttentionMetadata, StepInputs
from testbed.engine.model import LlamaModel
from testbed.engine.rope_shift import copy_kv
from testbed.engine.slot_table import PAD_ROW, SlotTable
from testbed.engine.step_buffers import StepBuffers
from testbed.engine.verify import tree_mask, tree_positions
from testbed.config.engine_config import CPU_KERNELS
from testbed.errors import check_choice
from testbed.scheduler.batch import Batch
from testbed.scheduler.cascade_rule import CascadeRule
from testbed.scheduler.decode_groups import DecodeGroups


def kv_slots_for_free_memory(free_bytes: int, total_bytes: int, mem_fraction: float,
                             bytes_per_token: int, cap: int | None = None) -> int:
    """KV slots for what a device has free after the weights loaded, keeping ``1 −
    mem_fraction`` of its whole memory for activations (SGLang's ``mem_fraction_static``):
    ``(free − (1 − mem_fraction) × total) / bytes_per_token``, at most ``cap``."""
    budget = free_bytes - (1 - mem_fraction) * total_bytes
    slots = math.floor(budget / bytes_per_token)
    if slots < 1:
        raise ValueError(f"no device memory left for KV: {free_bytes / 2**30:.2f} GiB free of "
                         f"{total_bytes / 2**30:.2f} GiB, {1 - mem_fraction:.0%} of it kept back "
                         f"(hardware.mem_fraction={mem_fraction}); set cache.capacity_tokens")
    return min(slots, cap) if cap is not None else slots


def kv_pool_slots(model: LlamaModel, mem_fraction: float, max_slots: int | None = None) -> int:
    """KV slots for ``model`` on its CUDA device from what is free there now (weights loaded)."""
    if model.device.type != "cuda":
        raise ValueError(f"the KV pool is sized from free memory on CUDA only; on "
                         f"{model.device.type} give num_slots (cache.capacity_tokens)")
    free, total = torch.cuda.mem_get_info(model.device)
    return kv_slots_for_free_memory(free, total, mem_fraction,
                                    KVCache.bytes_per_token(model.config, model.dtype), max_slots)


def in_place_decode(model: LlamaModel) -> tuple[object | None, str | None]:
    """The CPU's in-place decode kernel for ``model``'s KV (`testbed.engine.cpu_attention`), or
    None and why not: it reads fp32 with a head_dim a multiple of 16 up to 256."""
    head_dim = model.config.head_dim
    if model.dtype != torch.float32:
        return None, f"the in-place decode kernel is fp32 only, not {model.dtype}"
    if head_dim % 16 or head_dim > 256:
        return None, f"the in-place decode kernel takes head_dim 16, 32, ... 256, not {head_dim}"
    return load_kernel()


class ModelRunner:
    def __init__(self, model: LlamaModel, num_slots: int | None,
                 attention: str | AttentionBackend = "torch", mem_fraction: float = 0.9,
                 max_slots: int | None = None, cascade_min_saved: int = 0,
                 cuda_graph: bool = False, cuda_graph_max_batch: int = 256,
                 emulate_graphs: bool = False, cpu_kernels: str = "native",
                 cascade_rule: CascadeRule | None = None) -> None:
        """``num_slots`` None (CUDA only): size the KV pool from free device memory now,
        at most ``max_slots``. ``cascade_min_saved``, ``cascade_rule`` (None: ``auto`` on this
        device for this model): see `DecodeGroups`, for a batch formed without its groups
        (the scheduler's groups are the run's: `testbed.config.assembly`). ``cuda_graph``:
        decode steps of up to ``cuda_graph_max_batch`` requests replay CUDA graphs
        (`testbed.engine.cuda_graph`; on CUDA with a graphable attention backend, captured
        here); ``emulate_graphs``: the graph path without graphs, on any device (tests).
        ``cpu_kernels`` (`CPU_KERNELS`, the CPU only): ``native``, the linear layers on weights
        oneDNN prepared once (`testbed.engine.linear`), the torch backends' decode and prefill
        attention reading the KV pool in place (`testbed.engine.cpu_attention`) and the layer's
        elementwise steps in C (`testbed.engine.cpu_layers`), each where it passes its smoke
        test (else torch's, the reason in ``linear_error`` / ``decode_kernel_error`` /
        ``kernels_error``); ``torch``: torch's linear, the gathered attention and the torch
        layer steps."""
        self.model = model
        self.device = model.device
        check_choice("cpu_kernels", cpu_kernels, CPU_KERNELS, error=ValueError)
        self.cpu_kernels = cpu_kernels  # asked for (a calibration records it: its meta)
        native = cpu_kernels == "native" and self.device.type == "cpu"
        self.linear, self.linear_error = prepare_linears(model, "onednn" if native else "torch")
        decode_kernel, self.decode_kernel_error = None, None
        if native and isinstance(attention, str) and not attention.endswith("triton"):
            decode_kernel, self.decode_kernel_error = in_place_decode(model)
        # RoPE's frequencies on the device now: moved in the first forward, the copy from the
        # host would synchronize (and could not be captured in a CUDA graph)
        model.inv_freq = model.inv_freq.to(self.device)
        self.attention = (make_attention(attention, model.config.num_kv_heads, self.device,
                                         decode_kernel)
                          if isinstance(attention, str) else attention)
        # the fused layer steps of the backend's family; the torch ones, and why, if the
        # Triton ones failed their smoke test here
        attention_name = getattr(self.attention, "name", "torch")
        if native and attention_name != "triton":
            self.kernels, self.kernels_error = native_or_torch(model.dtype)
        else:
            self.kernels, self.kernels_error = kernels_for(attention_name, self.device,
                                                           model.dtype)
        if self.kernels_error and attention_name == "triton":  # the native ones': the summary
            warnings.warn(f"the Triton layer kernels failed here ({self.kernels_error}); the "
                          "engine runs their torch references instead", stacklevel=2)
        if num_slots is None:
            num_slots = kv_pool_slots(model, mem_fraction, max_slots)
        self.kv_cache = KVCache.for_model(model.config, num_slots, model.dtype, self.device)
        self.slots = SlotTable(self.device)
        self.buffers = StepBuffers(self.device)
        # cascade decoding: who shares a cached prefix (a batch formed without its groups)
        c = model.config  # where sharing a prefix pays: on this device, for this model
        rule = cascade_rule or CascadeRule.build("auto", device_slots(self.device), c.num_heads,
                                                 c.num_kv_heads)
        self.decode_groups = DecodeGroups(min_saved=cascade_min_saved, rule=rule)
        self.triton_copies = getattr(self.attention, "name", "") == "triton"  # KV moves: its kernel
        self.graphs: DecodeGraphs | None = None
        self.graph_error: str | None = None  # why decode runs eagerly though graphs were asked
        graphs = emulate_graphs or (cuda_graph and self.device.type == "cuda")
        if graphs and getattr(self.attention, "graphable", False):
            self.graphs = DecodeGraphs(self, cuda_graph_max_batch, emulate=emulate_graphs)
            if not self.graphs.emulate:
                try:
                    self.graphs.capture_buckets()
                except Exception as e:  # noqa: BLE001 - eager decode is slower, not wrong
                    self.graphs, self.graph_error = None, f"{type(e).__name__}: {e}"[:500]
                    warnings.warn(f"CUDA graph capture failed ({self.graph_error}); decode "
                                  "steps run eagerly", stacklevel=2)

    @property
    def num_slots(self) -> int:
        return self.kv_cache.num_slots

    def groups_of(self, batch: Batch) -> list[tuple[int, list[int]]]:
        """The batch's cascade groups (the scheduler's when it formed them, else read here),
        a group too wide for one program split (`split_wide`)."""
        if not getattr(self.attention, "cascade", False):
            return []
        groups = batch.decode_groups if batch.decode_groups is not None \
            else self.decode_groups(batch.entries)
        c = self.model.config
        return split_wide(groups, c.num_heads // c.num_kv_heads) if groups else groups

    @torch.inference_mode()
    def prepare(self, batch: Batch, graph: GraphKey | None = None,
                groups: list[tuple[int, list[int]]] | None = None) -> StepInputs:
        """The step's flat inputs and attention metadata (built once, used by every layer);
        ``graph``: pad the decode step to the graph's shape (rows read the padding slot)."""
        entries = batch.entries
        if not entries:
            raise ValueError("cannot run an empty batch")
        ids, positions = [], []
        on_device = all(e.decode for e in entries)  # inputs: the token table's
        for e in entries:
            if e.new < 1 or len(e.kv_slots()) != e.context + e.new:
                raise ValueError(f"request {e.req.id}: {len(e.kv_slots())} KV slots for context "
                                 f"{e.context} + new {e.new}")
            ids.append(np.zeros(1, dtype=np.int64) if on_device else e.input_ids())
            positions.append(np.arange(e.context, e.context + e.new) if e.branches is None
                             else tree_positions(e.context, e.branches))
        rows, writes = self.slots.update(entries)
        written = writes[2]
        if len(written) and (written.min() < 1 or written.max() > self.num_slots):
            raise ValueError(f"KV slot ids must be in 1..{self.num_slots} (the engine's KV slots), "
                             f"got {written.min()}..{written.max()}: the cache's capacity "
                             f"must not exceed the engine's num_slots")
        qo_lens = np.array([e.new for e in entries])
        kv_lens = np.array([e.context + e.new for e in entries])
        window = self.model.config.sliding_window
        if window is not None and kv_lens.max() > window:
            raise NotImplementedError(f"a sequence of {kv_lens.max()} tokens exceeds the model's "
                                      f"sliding_window={window}, which the engine does not implement")
        if graph is not None and graph.batch > len(entries):  # padding rows: one key, slot 0
            pad = graph.batch - len(entries)
            ids.append(np.zeros(pad, dtype=np.int64))
            positions.append(np.zeros(pad, dtype=np.int64))
            rows = np.concatenate([rows, np.full(pad, PAD_ROW)])
            qo_lens = np.concatenate([qo_lens, np.ones(pad, dtype=np.int64)])
            kv_lens = np.concatenate([kv_lens, np.ones(pad, dtype=np.int64)])
        tokens = np.concatenate(ids + positions)
        if groups is None:
            groups = self.groups_of(batch)
        cascade, sizes = CascadePlan.host_arrays(
            groups, kv_lens, rows, graph and graph.groups, graph and graph.width) \
            if groups else ([], None)
        meta, extra = AttentionMetadata.from_table(
            qo_lens, kv_lens, rows, self.slots.table, [*writes, tokens, *cascade],
            transfer=self.buffers.transfer, before_gather=lambda dev: self.slots.apply(*dev[:3]))
        if groups:
            meta.cascade = CascadePlan.from_device(extra[4:], sizes)
        if batch.verifies:  # speculative: every query's logits (testbed.engine.verify)
            meta.last_token_index = None
            if any(e.branches is not None for e in entries):
                meta.query_masks = [None if e.branches is None else torch.as_tensor(
                    tree_mask(e.context, e.branches), device=self.device) for e in entries]
        if graph is not None:
            meta.num_kv_splits = MAX_KV_SPLITS
        meta.plan = self.attention.plan(meta)
        input_ids, pos = extra[3].split([len(tokens) // 2, len(tokens) // 2])
        if on_device:  # each row's last token (a padding row's: 0)
            input_ids = self.slots.last_tokens(meta.kv.rows)
        return StepInputs(input_ids=input_ids, positions=pos, meta=meta)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache,
                          self.attention, self.kernels)

    def _run_plain(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch without reused KV: a decode step through its CUDA graph when one takes it,
        else eagerly. Its logits, and its entries' rows."""
        groups = self.groups_of(batch)
        key = None
        n = len(batch.entries)
        if self.graphs is not None and batch.kind == "decode" and not batch.verifies \
                and all(e.new == 1 for e in batch.entries):
            key = self.graphs.key(n, groups)
        inputs = self.prepare(batch, key, groups)
        if key is not None:
            logits = self.graphs.run(key, inputs, n)
            if logits is not None:
                return logits, inputs.rows(n)
        if batch.verifies:  # one row per query (testbed.engine.verify)
            return self.forward(inputs), inputs.rows(n)
        return self.forward(inputs)[:n], inputs.rows(n)

    def run(self, batch: Batch) -> torch.Tensor:
        """Logits ``[len(batch.entries), vocab]`` of each entry's last new token (`step`)."""
        return self.step(batch)[0]

    @torch.inference_mode()
    def store_tokens(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The tokens a step produced, into the token table: the next decode's inputs."""
        self.slots.store_tokens(rows, tokens)

    @torch.inference_mode()
    def step(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[len(batch.entries), vocab]`` of each entry's last new token (a
        speculative verification step's: ``[T, vocab]``, every query's), and the
        entries' token-table rows (device tensors; nothing read back); the entries'
        new K/V are written into their slots.

        A prefill entry with a non-empty ``reuse`` (spans of donor KV, `testbed.engine.blend`)
        runs as its own forward through `blend_prefill`, after the step's other entries have run
        together; then the batch's ``kv_copies`` are executed (`copy_kv`, every layer, keys
        re-rotated by each copy's ``shift``).

        The whole step runs in inference mode, as `prepare` does for a caller of its own (the
        draft model): the slot and token tables grow inside steps, and a tensor made in
        inference mode cannot be written outside it, so every path that writes them — plain,
        blended, draft — must run in the one mode (issue 58: the blended path ran outside it)."""
        reuse = [e.reuse for e in batch.entries]
        if any(reuse):
            logits = self._run_blended(batch, reuse)
            rows = torch.as_tensor(self.slots.rows_of(batch.entries)).to(self.device)
        else:
            logits, rows = self._run_plain(batch)
        for c in batch.kv_copies:
            copy_kv(self.kv_cache, c.src_slots, c.dst_slots, c.shift, self.model.inv_freq,
                    self.triton_copies)
        return logits, rows

    def _run_blended(self, batch: Batch, reuse: list) -> torch.Tensor:
        out: list[torch.Tensor | None] = [None] * len(batch.entries)
        plain = [i for i, r in enumerate(reuse) if not r]
        if plain:
            logits = self.forward(self.prepare(replace(batch, entries=[batch.entries[i]
                                                                       for i in plain])))
            for row, i in enumerate(plain):
                out[i] = logits[row]
        for i, spans in enumerate(reuse):
            if spans:
                e = batch.entries[i]
                slots = e.kv_slots()
                if len(slots) != e.context + e.new or slots.min(initial=1) < 1 \
                        or slots.max(initial=1) > self.num_slots:
                    raise ValueError(f"request {e.req.id}: blend prefill needs context + new = "
                                     f"{e.context + e.new} KV slots in 1..{self.num_slots}")
                out[i] = blend_prefill(self.model, self.kv_cache, e.req.fill(), slots,
                                       e.context, spans, self.triton_copies).logits
        return torch.stack(out)
