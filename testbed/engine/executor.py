"""`EngineExecutor`: the real model behind the simulator's `Executor` seam.

`launch` enqueues a `Batch`'s step on the device through the `ModelRunner` (inputs, forward,
sampling, each produced token into the token table beside the slot table, where the next decode
step reads its inputs, and the tokens' copy to the host) and returns a
`testbed.engine.launched.LaunchedStep` without waiting; its ``result()`` waits for the tokens and
returns the `StepOutcome`: the token each entry produced, the device's time (``gpu_s``: CUDA
events around the step's work; on the CPU, where launch does the work, launch's time) and the
host's (``host_s``: launching; on the CPU 0). Nothing between the two reads the device: on CUDA
the serving loop forms and launches the next step meanwhile (``asynchronous``). ``execute`` is
``launch(batch).result()``, timed as before from launch to result (``duration_s``).

With ``forced=True`` the workload's predetermined tokens are returned instead of the model's (the
model still runs and samples, so the step costs the same), and they are what the token table
holds: engine and simulator then see identical sequences and make identical decisions. A request
without predetermined output (``max_new_tokens`` in a token trace) gets the model's tokens
either way. Requests that reused donor KV (blend prefill) are measured against exact
recomputation by ``self.quality`` (`testbed.engine.quality.QualityMonitor`) when their results
are read, outside the timed part.

``clock`` (``time.perf_counter`` by default) is what a step's times are read from (`step_clock`,
which the serving loop also times the scheduler's work with); a study on a CPU machine that other
jobs share may set ``time.thread_time`` (the stepping thread's CPU seconds), which the other jobs' time
slices do not inflate (``experiments/validation/sim_vs_engine.py --clock cpu``). The steps' wall
time is added up in ``wall_s`` either way.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import numpy as np
import torch

from testbed.engine.attention import ATTENTION_BACKENDS
from testbed.engine.host_memory import keep_freed_memory
from testbed.engine.launched import DeviceTimer, LaunchedStep, Readback
from testbed.engine.loader import model_from_group, parse_dtype
from testbed.engine.quality import QualityMonitor
from testbed.engine.runner import ModelRunner
from testbed.engine.sampler import Sampler
from testbed.engine.draft_model import draft
from testbed.engine.verify import verified_tokens
from testbed.errors import check_choice
from testbed.scheduler.batch import Batch
from testbed.scheduler.batch import StepOutcome
from testbed.scheduler.decode_groups import default_attention
from testbed.scheduler.speculative import check_draft_layers


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class EngineExecutor:
    #: attention reads each request's KV where its slots lie (no gather into a padded batch), so
    #: the pool keeps a request's decoded tokens in runs (`testbed.serving.serve.keep_runs_for`)
    reads_kv_in_place = True

    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None,
                 forced: bool = False) -> None:
        self.runner = runner
        self.sampler = sampler or Sampler(device=runner.device)
        self.forced = forced
        self.steps = 0
        self.busy_s = 0.0  # Σ duration_s (by ``clock``)
        self.wall_s = 0.0  # Σ wall time of the same steps
        self.clock = None  # the step clock: None is wall time (time.perf_counter, read per call)
        self.forced_tokens = 0  # forced mode: tokens imposed, and how many the model agreed with
        self.forced_agreed = 0
        # approximate (KV-reusing) requests against exact recomputation: records(), summary()
        self.quality = QualityMonitor(runner.model, forced)
        self.draft_layers = 0  # speculative.method=draft: the draft model's layers (0: none)

    @property
    def asynchronous(self) -> bool:
        """The device runs a launched step while the host goes on (CUDA)."""
        return self.runner.device.type == "cuda"

    @property
    def step_clock(self):
        return self.clock or time.perf_counter

    def launch(self, batch: Batch) -> LaunchedStep:
        """Enqueue ``batch``'s step; nothing is read back (module docstring)."""
        clock = self.step_clock
        graphs = self.runner.graphs
        captured_before = graphs.capture_s if graphs is not None else 0.0
        start, wall = clock(), time.perf_counter()
        timer = DeviceTimer(self.runner.device)
        timer.start()
        if batch.verifies and self.draft_layers:  # the draft model fills the placeholders
            draft(self.runner, batch, self.draft_layers)
        logits, rows = self.runner.step(batch)
        if batch.verifies:  # speculative: verified here, on the host (testbed.engine.verify)
            return self._launch_verification(batch, logits, timer, clock, start, wall)
        sampled = self.sampler(logits)
        forced = self._forced(batch)
        written = sampled  # what the token table holds: the replayed token where forced
        if forced is not None:
            forced_dev = _to_device(forced, sampled.device)
            written = torch.where(forced_dev >= 0, forced_dev, sampled)
        self.runner.store_tokens(rows, written)
        top = top_logprobs(batch, logits)
        kept = logits.clone() if self.quality.watches(batch) else None
        readback = Readback(sampled)
        timer.stop()
        # a graph captured in this step: capture is not the step's work
        captured = graphs.capture_s - captured_before if graphs is not None else 0.0
        launch_s = max(clock() - start - captured, 0.0)
        self.wall_s += time.perf_counter() - wall
        return LaunchedStep(self, batch, readback, forced, top, kept, timer, launch_s,
                            synchronous=not self.asynchronous, capture_s=captured)

    def execute(self, batch: Batch) -> StepOutcome:
        return self.launch(batch).result()

    def _launch_verification(self, batch: Batch, logits: torch.Tensor, timer: DeviceTimer,
                             clock, start: float, wall: float) -> LaunchedStep:
        """A verification step's tokens, read back at launch: acceptance decides which rows
        count. Its inputs come from the host (the requests' applied outputs), so nothing is
        written to the token table."""
        s = self.sampler
        verified, imposed, agreed = verified_tokens(batch, logits, s.temperature, s.generator,
                                                    self.forced)
        self.forced_tokens += imposed
        self.forced_agreed += agreed
        timer.stop()
        launch_s = max(clock() - start, 0.0)
        self.wall_s += time.perf_counter() - wall
        return LaunchedStep(self, batch, Readback(torch.zeros(0)), None, None, None, timer,
                            launch_s, synchronous=True, verified=verified)

    def _forced(self, batch: Batch) -> np.ndarray | None:
        """The workload's token for each entry that replays one (-1 elsewhere), or None when
        none does: known on the host at launch, from the entry's position."""
        if not self.forced:
            return None
        out = np.full(len(batch.entries), -1, dtype=np.int64)
        for i, e in enumerate(batch.entries):
            if e.makes_output and not e.req.request.generates:
                out[i] = e.req.request.output[e.output_index]
        return out if (out >= 0).any() else None

    # ------------------------------------------------------------------ facts for the run
    @property
    def num_slots(self) -> int:
        return self.runner.num_slots

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.model.dtype

    @property
    def attention_name(self) -> str:
        """The attention backend's class name (what a calibration was measured with)."""
        return type(self.runner.attention).__name__

    @property
    def cpu_kernels(self) -> str | None:
        """The CPU's linear and decode kernels asked for (`engine.cpu_kernels`); None off the
        CPU, where they do not apply (what a calibration records)."""
        return self.runner.cpu_kernels if self.runner.device.type == "cpu" else None

    @property
    def model(self):
        """The `LlamaModel` (its config: vocabulary, EOS ids; its weights for quality checks)."""
        return self.runner.model

    def graph_summary(self) -> dict:
        """The CUDA graphs' figures for the run's summary (capture time, memory, replays);
        ``cuda_graph: false`` when decode ran eagerly."""
        runner = self.runner
        out = runner.graphs.summary() if runner.graphs is not None else {"cuda_graph": False}
        out["layer_kernels"] = runner.kernels.name
        for key, error in (("graph_error", runner.graph_error),
                           ("layer_kernels_error", runner.kernels_error),
                           ("linear_error", runner.linear_error),
                           ("decode_kernel_error", runner.decode_kernel_error)):
            if error:
                out[key] = error
        return out


def top_logprobs(batch: Batch, logits: torch.Tensor) -> list | None:
    """For each entry whose request asks for ``top_logprobs`` (beam search) and ends its fill:
    the most likely next tokens and their log-probs (log-softmax of the float32 logits, as HF's
    beam search takes them), highest first, as device tensors (read back with the step's
    tokens); None for the others, or for a batch without any."""
    rows = [i for i, e in enumerate(batch.entries)
            if e.req.request.top_logprobs and e.produces_token]
    if not rows:
        return None
    out: list = [None] * len(batch.entries)
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    for row, lp in zip(rows, logprobs):
        values, ids = lp.topk(min(batch.entries[row].req.request.top_logprobs, lp.shape[-1]))
        out[row] = (ids, values)
    return out


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on ``device`` without waiting: from pinned memory on CUDA."""
    host = torch.from_numpy(values)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def make_engine_executor(model: Mapping[str, Any], num_slots: int | None, *,
                         device: str | None = None, dtype: str | None = None,
                         attention: str | None = None, seed: int = 0, forced: bool = True,
                         temperature: float = 0.0, top_p: float = 1.0, mem_fraction: float = 0.9,
                         max_slots: int | None = None, cascade_min_saved: int = 0,
                         cuda_graph: bool = True, cuda_graph_max_batch: int = 256,
                         cpu_kernels: str = "native", speculative: Any = None,
                         cascade_rule: Any = None) -> EngineExecutor:
    """The engine for a ``model`` config group: the checkpoint at ``model.path`` or a random model
    of the group's shape (``seed``), with ``num_slots`` KV slots (the cache's capacity); None on
    CUDA: what free device memory leaves after the weights (``mem_fraction``), at most
    ``max_slots`` (`testbed.engine.runner.kv_slots_for_free_memory`).

    Defaults: ``device`` CUDA when present, else CPU; ``dtype`` float32 on CPU, on CUDA bf16 when
    ``model.dtype_bytes`` is 2; ``attention`` `default_attention` (triton on CUDA, cascade decoding
    on torch kernels elsewhere). ``cuda_graph``: decode steps of up to ``cuda_graph_max_batch``
    requests replay CUDA graphs captured here (CUDA with Triton attention; ignored elsewhere).
    ``cpu_kernels``: the CPU's linear and decode kernels (`ModelRunner`). ``cascade_rule``: where
    cascade's groups form (`testbed.scheduler.cascade_rule.CascadeRule`; None: ``auto`` on the
    device).
    """
    device = device or default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device=cuda but torch sees no CUDA device; use device=cpu")
    if dtype is None:
        dtype = "bfloat16" if device != "cpu" and model.get("dtype_bytes") == 2 else "float32"
    attention = attention or default_attention(device)
    if device == "cpu":
        keep_freed_memory()  # step times then do not depend on the process's allocation history
    check_choice("attention", attention, ATTENTION_BACKENDS, error=ValueError)
    net = model_from_group(model, seed=seed, dtype=parse_dtype(dtype), device=device)
    runner = ModelRunner(net, num_slots, attention=attention, mem_fraction=mem_fraction,
                         max_slots=max_slots, cascade_min_saved=cascade_min_saved,
                         cuda_graph=cuda_graph, cuda_graph_max_batch=cuda_graph_max_batch,
                         cpu_kernels=cpu_kernels, cascade_rule=cascade_rule)
    executor = EngineExecutor(runner, Sampler(temperature, top_p, seed=seed, device=device),
                              forced=forced)
    if speculative is not None and speculative.method == "draft":
        check_draft_layers(speculative, net.config.num_layers)
        executor.draft_layers = speculative.draft_layers
    return executor
