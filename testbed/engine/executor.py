"""`EngineExecutor`: the real model behind the simulator's `Executor` seam.

It runs each `Batch` through the `ModelRunner`, picks the next token of every entry that produces
one, and reports the step's measured wall time (``time.perf_counter`` around building the step's
inputs, the forward, sampling and reading the tokens back; ``torch.cuda.synchronize`` on CUDA), by
which the driver advances virtual time. With ``forced=True`` the workload's predetermined tokens
are returned instead of the model's (the model still runs and samples, so the step costs the
same): engine and simulator then see identical sequences and make identical decisions. A request
without predetermined output (``max_new_tokens`` in a token trace) gets the model's tokens
either way. Requests that reused donor KV (blend prefill) are measured against exact
recomputation by ``self.quality`` (`testbed.engine.quality.QualityMonitor`), outside the timed part.

``clock`` (``time.perf_counter`` by default) is what a step's duration is read from; a study on a
CPU machine that other jobs share may set ``time.process_time`` (this process's CPU seconds), which
the other jobs' time slices do not inflate (``experiments/validation/sim_vs_engine.py --clock
cpu``). The step's wall time is added up in ``wall_s`` either way.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch

from testbed.engine.attention import ATTENTION_BACKENDS
from testbed.engine.host_memory import keep_freed_memory
from testbed.engine.loader import model_from_group, parse_dtype
from testbed.engine.quality import QualityMonitor
from testbed.engine.runner import ModelRunner
from testbed.engine.sampler import Sampler
from testbed.scheduler.batch import Batch
from testbed.scheduler.batch import StepOutcome
from testbed.scheduler.decode_groups import default_attention


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class EngineExecutor:
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

    def execute(self, batch: Batch) -> StepOutcome:
        cuda = self.runner.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.runner.device)
        clock = self.clock or time.perf_counter
        graphs = self.runner.graphs
        captured_before = graphs.capture_s if graphs is not None else 0.0
        start, wall = clock(), time.perf_counter()
        logits = self.runner.run(batch)
        sampled = self.sampler(logits).tolist()  # reading the tokens back syncs the device
        logprobs = top_logprobs(batch, logits)
        if cuda:
            torch.cuda.synchronize(self.runner.device)
        duration = clock() - start
        if graphs is not None:  # a graph captured in this step: capture is not the step's work
            duration = max(duration - (graphs.capture_s - captured_before), 0.0)
        self.steps += 1
        self.busy_s += duration
        self.wall_s += time.perf_counter() - wall
        tokens: list[int | None] = []
        for e, own in zip(batch.entries, sampled):
            if not (e.produces_token and e.req.remaining_new_tokens > 0):
                tokens.append(None)
            elif self.forced and not e.req.request.generates:  # replay the workload's token
                tok = int(e.req.request.output[len(e.req.output)])
                self.forced_tokens += 1
                self.forced_agreed += tok == own
                tokens.append(tok)
            else:
                tokens.append(int(own))
        self.quality.observe(batch, logits, tokens)  # after the timed part: not in duration_s
        return StepOutcome(duration_s=duration, tokens=tokens, logprobs=logprobs)


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
                           ("layer_kernels_error", runner.kernels_error)):
            if error:
                out[key] = error
        return out


def top_logprobs(batch: Batch, logits: torch.Tensor) -> list | None:
    """For each entry whose request asks for ``top_logprobs`` (beam search) and ends its fill:
    the most likely next tokens and their log-probs (log-softmax of the float32 logits, as HF's
    beam search takes them), highest first; None for the others, or for a batch without any."""
    rows = [i for i, e in enumerate(batch.entries)
            if e.req.request.top_logprobs and e.produces_token]
    if not rows:
        return None
    out: list = [None] * len(batch.entries)
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    for row, lp in zip(rows, logprobs):
        values, ids = lp.topk(min(batch.entries[row].req.request.top_logprobs, lp.shape[-1]))
        out[row] = (ids.cpu().numpy(), values.cpu().numpy())
    return out


def make_engine_executor(model: Mapping[str, Any], num_slots: int | None, *,
                         device: str | None = None, dtype: str | None = None,
                         attention: str | None = None, seed: int = 0, forced: bool = True,
                         temperature: float = 0.0, top_p: float = 1.0, mem_fraction: float = 0.9,
                         max_slots: int | None = None, cascade_min_saved: int = 0,
                         cuda_graph: bool = True, cuda_graph_max_batch: int = 256
                         ) -> EngineExecutor:
    """The engine for a ``model`` config group: the checkpoint at ``model.path`` or a random model
    of the group's shape (``seed``), with ``num_slots`` KV slots (the cache's capacity); None on
    CUDA: what free device memory leaves after the weights (``mem_fraction``), at most
    ``max_slots`` (`testbed.engine.runner.kv_slots_for_free_memory`).

    Defaults: ``device`` CUDA when present, else CPU; ``dtype`` float32 on CPU, on CUDA bf16 when
    ``model.dtype_bytes`` is 2; ``attention`` `default_attention` (triton on CUDA, cascade decoding
    on torch kernels elsewhere). ``cuda_graph``: decode steps of up to ``cuda_graph_max_batch``
    requests replay CUDA graphs captured here (CUDA with Triton attention; ignored elsewhere).
    """
    device = device or default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device=cuda but torch sees no CUDA device; use device=cpu")
    if dtype is None:
        dtype = "bfloat16" if device != "cpu" and model.get("dtype_bytes") == 2 else "float32"
    attention = attention or default_attention(device)
    if device == "cpu":
        keep_freed_memory()  # step times then do not depend on the process's allocation history
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}; got {attention!r}")
    net = model_from_group(model, seed=seed, dtype=parse_dtype(dtype), device=device)
    runner = ModelRunner(net, num_slots, attention=attention, mem_fraction=mem_fraction,
                         max_slots=max_slots, cascade_min_saved=cascade_min_saved,
                         cuda_graph=cuda_graph, cuda_graph_max_batch=cuda_graph_max_batch)
    return EngineExecutor(runner, Sampler(temperature, top_p, seed=seed, device=device),
                          forced=forced)
