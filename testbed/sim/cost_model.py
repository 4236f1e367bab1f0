"""GPU step-time models: how long one scheduler step takes, given the step's shape.

The simulator calls ``cost_model.step_time(StepShape(new=..., context=...))`` once per step: for
each request in the batch, ``new`` tokens are computed this step (a prefill chunk, or 1 for a
decode) on top of ``context`` tokens already in its KV. Three models implement `CostModel`
(`COST_MODELS` builds the one ``cost_model=`` names; ``cost_model=custom
cost_model.target=module.Class`` takes a class of your own built with ``model``, ``hw`` and the
group's other keys):

- `RooflineCostModel` — FLOPs and HBM bytes per GPU from the model's shape, each divided by the
  device's peak times an efficiency factor (matmuls and attention each their own); the slower one
  wins, plus the hardware's per-step overhead and, with tensor parallelism, the all-reduces.
  ``floor(step)`` is the same with perfect efficiency and no overhead: a physical lower bound.
- `FittedCostModel` — ``a + b·Σnew + c·Σ(new·context) + d·batch + e·Σcontext
  + f·batch·max(context) + g·few_row_passes`` per kind of step (decode / prefill; the ``f`` term,
  a decode kernel padded to the batch's longest KV, is 0 in a prefill; ``g``'s, a CPU BLAS that
  reads the weights once per row for 2-3 rows, is ``batch − 1`` then, else 0), plus, where a fit
  measured them, ``n<K>``: the own cost of a step of K rows (``Σnew``: a decode batch of K, a
  prefill of K new tokens), read between the measured row counts (`row_weights`), with
  coefficients fitted to measured step times (YAML files written by `save_fitted`), clamped from
  below by the roofline floor; it and its file live in `testbed.sim.fitted`.
- `testbed.sim.vidur_cost.VidurCostModel` — measured operator times (a Vidur profile),
  operator by operator.

Cascade decoding (``attention=cascade*``; `StepShape.shared`): a decode step's requests that
share a cached prefix read its KV once per group. Each model sees it through one number, the
cached KV the step reads, ``kv_read_context = Σcontext − Σ_groups (members − 1)·P``: the roofline
reads that many tokens' KV (plus the new tokens') from HBM, attention FLOPs unchanged; the fitted
model's ``e`` term multiplies it; Vidur's decode kernel is looked up at the mean of it per
request (the batch's mean context with each shared prefix counted once). Without groups it is
``Σcontext``: the same prices as before, to the bit.

Reuse beyond exact prefixes (``cache.reuse=blend``, ``cache.match=semantic``; the simulator's
`SimExecutor` shapes the step): ``new`` counts the tokens computed (fresh and recomputed) and
``context`` the rest of each request's positions, so the computed tokens attend the full context
as if they stood last (exact matmuls; an upper bound on the attention pairs). The KV moves are
priced by every model alike, as HBM traffic after the forward pass (`kv_move_bytes`): each
``rotated`` token (of a reused span) is copied from its donor (K and V read and written) and its
key re-rotated (read and written), each ``copied`` token (a chunk store) copied once. Without
reuse both are 0 and every price is as before, to the bit.

Checked against measurements: Vidur's A100 operator timings (CodeLlama-34B at TP2, GPU kernel time
only, ``data:vidur_a100_codellama34b_tp2``);
``tests/test_cost_model.py::test_roofline_against_vidur_a100`` recomputes these figures
(measured time / roofline floor, per layer and per rank):

- matmuls (q, k, v, o, gate/up, down) at 1–64 tokens, memory-bound: 1.28–1.38 (72–78 % of HBM
  bandwidth); at 512–4096 tokens, compute-bound: 1.29–1.64, median 1.39 (~72 % of peak FLOP/s);
- prefill attention (chunks 64–4096 over 0–4032 cached tokens): ≥ 2.45, median 4.3; its FLOPs
  over all 4,206 profiled points' time are 23 % of peak (1 % for a 64-token chunk alone, 40 %
  at best), while the matmuls reach ~72 %;
- decode attention with batch × context ≥ 32k tokens: 1.14–2.24, median 1.44; smaller ones are
  launch-bound (9–31 µs per call whatever the size);
- all-reduce at TP2: 7–10 µs per call up to 64 KiB, ~186 GB/s at large sizes (vs 300 GB/s NVLink).

The floor is never above any measured operator. The defaults below are fitted to whole steps of
`VidurCostModel` on that profile (priced as Vidur 0.0.26 prices them: GPU time plus a 20 µs NCCL
launch per all-reduce, no per-step overhead; ``python -m experiments.validation.vidur.roofline``
prints the fit and these ratios): ``attn_mfu`` from the profiled attention alone; the all-reduce's
per-call latency from the profiled TP2 all-reduces of 512 KiB and more (31 µs + bytes / 0.62 of
NVLink) plus Vidur's NCCL launch; ``mfu`` and ``mbu`` on the steps of a loaded server (decode
batches of 64–128 requests at mixed contexts, prefill batches of 1–4 fresh prompts), where the
roofline / measured is 0.95–1.06 (median 1.01) for decode and 0.82–1.06 (median 1.01) for
prefill (lowest for short prompts: matmuls near the ridge point, slower than both roofs). On
single shapes: 0.91–1.18 (median 1.15) for decode steps of 1–128 requests at 128–4,032 tokens of
context (small batches are launch- and latency-bound, and the per-call all-reduce latency fitted
on large messages is 2–3× theirs), 0.94–1.08 (median 1.01) for prefill chunks of 64–4,096 tokens
with nothing cached, and 0.95–1.12 (median 1.04) for chunks over 512–4,032 cached tokens. Past the
profile (Vidur's side extrapolated), decode at 16k–64k tokens of context is 1.15–1.22× slow, and
prefill chunks over 8k–100k cached tokens 1.14–2.35× slow: the profile's kernel attends to a long
cache at up to ~65 % of peak, while one ``attn_mfu`` has to cover chunks' own causal triangles at
~20 %. Against Vidur 0.0.26 itself on the first 2,000 requests of the Azure 2023 conversation
trace (``experiments.validation.vidur``; docs/results/vs_vidur.md), the roofline's TTFT, TPOT and e2e
percentiles and makespan are within 5 % at the recorded rate (TTFT −4.9 %) and within 8 % at
half of it (e2e p50 +7.6 %); at a quarter of it, where decode batches are small, TPOT and e2e
are 13–19 % long (the small batches above). The fit is sensitive: 0.01 of ``mfu`` moves the
recorded rate's TTFT by ~4 %, as that run is overloaded and step-time errors compound in the
queue, and fitted over decode batches of 1–128 requests instead, ``mbu`` comes out 0.62 and
TTFT there is 11 % short. Pure roofline models miss real step times by 30–50 % (docs/design.md §6);
`FittedCostModel` is the accurate one once a device has been measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from testbed.config import group_values
from testbed.errors import BadInput
from testbed.config.model_shape import ModelShape
from testbed.config.registry import Registry
from testbed.sim.specs import HardwareSpec
from testbed.sim.step_shape import StepShape, kv_move_bytes  # noqa: F401 (also importable here)
from testbed.sim.fitted import (  # noqa: F401 (the fitted model's names, importable here too)
    COEFFS, KINDS, OPTIONAL_COEFFS, OPTIONAL_KINDS, ROW_KEY, FittedCostModel, load_fitted,
    row_table, row_weights, save_fitted,
)

#: Defaults of the roofline model, fitted to Vidur's A100 profile (CodeLlama-34B, TP2; above).
#: MFU 0.65: the matmul FLOPs' share of peak that the token-level operators reach (matmuls alone
#: ~72 %; norms, rope, activation and adds take the rest). Smaller models and newer GPUs usually
#: reach less.
DEFAULT_MFU = 0.65
#: ATTN_MFU 0.23: attention FLOPs over the time of every profiled prefill attention point.
DEFAULT_ATTN_MFU = 0.23
#: MBU 0.58: a loaded decode step (64–128 requests) streams its weights and KV at ~0.58 of 2.0 TB/s
#: (the matmuls alone at ~0.75; at 128 tokens they near the ridge point, where neither roof
#: holds). `RooflineCostModel.step_time` applies it to the interconnect bandwidth too (Vidur's TP2
#: all-reduce reaches ~0.62 of NVLink's 300 GB/s from 512 KiB up).
DEFAULT_MBU = 0.58
#: Fixed cost of one all-reduce call (not in the floor): Vidur's TP2 A100 all-reduce fits 31 µs +
#: bytes / (0.62 × 300 GB/s) from 512 KiB up (7–24 µs below: small messages are overcharged),
#: plus the 20 µs CPU launch Vidur adds to each (``nccl_cpu_launch_overhead_ms``).
ALLREDUCE_LATENCY_S = 5e-5

class CostModel(Protocol):
    def step_time(self, step: StepShape) -> float:
        """Seconds the step takes on the device (including per-step overhead)."""
        ...


class RooflineCostModel:
    """``max(compute, bytes / (bandwidth·mbu)) + overhead_s + all-reduces``, per GPU, where
    ``compute = matmul FLOPs / (peak·mfu) + attention FLOPs / (peak·attn_mfu)``.

    - Matmul FLOPs: ``2·layers·layer_linear_params·Σnew / tp`` for the layers' matmuls, plus the
      LM head ``2·vocab·hidden / tp`` once per request (only its last position reaches the LM
      head, as in the engine, whether the chunk is a prompt's last or not).
    - Attention FLOPs: ``4·layers·heads·head_dim·Σ new·(context + (new+1)/2) / tp`` for QKᵀ and
      PV (causal within the chunk), at their own efficiency ``attn_mfu``: attention kernels run
      far below the matmuls on the same GPU (module docstring).
    - Bytes: the matmul weights of one rank read once per step, the KV read
      (``Σ(context+new)``) and written (``Σnew``) at ``kv_bytes_per_token_per_gpu``. With
      cascade decoding (``step.shared``) a group's shared prefix is read once: the KV read is
      ``Σ_groups (P + Σ_members (context + 1 − P)) + Σ_others (context + 1)``, i.e.
      ``kv_read_context + Σnew``; its FLOPs are unchanged (every query still attends every key;
      the merge's few ops per query and the prefix pass's second launch are not priced).
      Activations (~10·hidden + 5·intermediate elements per token per layer, unfused) are left
      out: in decode they are 1–2 % of the weight bytes, and a large chunk, where they add up,
      does ~2000 FLOPs per activation byte, far on the compute side of the ridge.
    - With ``tp > 1``, two ring all-reduces per layer of ``Σnew·hidden·dtype_bytes`` bytes, each
      ``ALLREDUCE_LATENCY_S + 2·(tp−1)/tp · bytes / (interconnect_bw·mbu)``, not overlapped with
      compute. ``interconnect_bw`` (per direction, per GPU) and ``overhead_s`` (the CPU side:
      scheduling, input prep, sampling, launch gaps, which FLOPs and bytes do not see) default to
      the hardware preset's ``interconnect_bw`` and ``step_overhead_s``.
    """

    def __init__(self, model: ModelShape, hw: HardwareSpec, mfu: float = DEFAULT_MFU,
                 mbu: float = DEFAULT_MBU, overhead_s: float | None = None,
                 interconnect_bw: float | None = None,
                 attn_mfu: float = DEFAULT_ATTN_MFU) -> None:
        for key, value in (("mfu", mfu), ("mbu", mbu), ("attn_mfu", attn_mfu)):
            if not 0 < value <= 1:
                raise BadInput(f"cost_model.{key} must be in (0, 1], got {value}")
        overhead_s = hw.step_overhead_s if overhead_s is None else overhead_s
        if overhead_s < 0:
            raise BadInput(f"cost_model.overhead_s must be >= 0, got {overhead_s}")
        interconnect_bw = hw.interconnect_bw if interconnect_bw is None else interconnect_bw
        if interconnect_bw is None and model.tp > 1:
            raise BadInput(f"model.tp={model.tp} needs hardware.interconnect_bw (or "
                           f"cost_model.interconnect_bw): the bandwidth between the GPUs")
        if interconnect_bw is not None and interconnect_bw <= 0:
            raise BadInput(f"cost_model.interconnect_bw must be > 0, got {interconnect_bw}")
        self.model, self.hw = model, hw
        self.mfu, self.mbu, self.attn_mfu, self.overhead_s = mfu, mbu, attn_mfu, overhead_s
        self.interconnect_bw = interconnect_bw
        m = model
        self._layer_flops_per_token = 2 * m.num_layers * m.layer_linear_params / m.tp
        self._lm_head_flops_per_request = 2 * m.vocab_size * m.hidden_size / m.tp
        self._attn_flops_per_pair = 4 * m.num_layers * m.num_heads * m.head_dim / m.tp
        self._weight_bytes = m.linear_params * m.dtype_bytes / m.tp
        self._ar_bytes_per_token = m.hidden_size * m.dtype_bytes

    def matmul_flops(self, step: StepShape) -> float:
        """Matmul FLOPs one GPU executes: every layer for every new token, the LM head once per
        request."""
        return (self._layer_flops_per_token * step.num_new
                + self._lm_head_flops_per_request * step.batch)

    def attention_flops(self, step: StepShape) -> float:
        """Attention FLOPs (QKᵀ and PV) one GPU executes."""
        return self._attn_flops_per_pair * step.attended_pairs

    def flops(self, step: StepShape) -> float:
        """FLOPs one GPU executes in the step (matmuls and attention)."""
        return self.matmul_flops(step) + self.attention_flops(step)

    def bytes(self, step: StepShape) -> float:
        """HBM bytes one GPU moves in the step: weights once, KV read (a shared prefix once per
        group) and written."""
        kv = self.model.kv_bytes_per_token_per_gpu
        return self._weight_bytes + kv * (step.kv_read_context + 2 * step.num_new)

    def allreduce_time(self, step: StepShape, efficiency: float = 1.0,
                       latency_s: float = ALLREDUCE_LATENCY_S) -> float:
        """Seconds of tensor-parallel all-reduces in the step (0 when ``tp == 1``)."""
        tp = self.model.tp
        if tp == 1:
            return 0.0
        moved = 2 * (tp - 1) / tp * self._ar_bytes_per_token * step.num_new
        one = latency_s + moved / (self.interconnect_bw * efficiency)
        return 2 * self.model.num_layers * one

    def step_time(self, step: StepShape) -> float:
        peak = self.hw.flops
        compute = (self.matmul_flops(step) / (peak * self.mfu)
                   + self.attention_flops(step) / (peak * self.attn_mfu))
        memory = self.bytes(step) / (self.hw.mem_bw * self.mbu)
        return (max(compute, memory) + self.overhead_s
                + self.allreduce_time(step, efficiency=self.mbu) + self.move_time(step))

    def move_time(self, step: StepShape, efficiency: float | None = None) -> float:
        """Seconds of the step's KV moves (reuse beyond exact prefixes), at ``mbu`` of HBM."""
        moved = kv_move_bytes(self.model, step)
        return moved / (self.hw.mem_bw * (self.mbu if efficiency is None else efficiency)) \
            if moved else 0.0

    def floor(self, step: StepShape) -> float:
        """The physical lower bound: peak FLOP/s and bandwidths, no overhead, no call latency."""
        compute = self.flops(step) / self.hw.flops
        memory = (self.bytes(step) + kv_move_bytes(self.model, step)) / self.hw.mem_bw
        return max(compute, memory) + self.allreduce_time(step, latency_s=0.0)

    def __repr__(self) -> str:
        return (f"RooflineCostModel({self.model.name}, {self.hw.name}, mfu={self.mfu}, "
                f"attn_mfu={self.attn_mfu}, mbu={self.mbu}, overhead_s={self.overhead_s})")


COST_MODELS = Registry("cost_model", methods=("step_time",), context_keys=("model", "hw"),
                       what="a cost model (step_time(StepShape) -> seconds)")


def number(key: str, value: Any, default: float | None) -> float | None:
    """A ``cost_model`` setting as a float (``default`` when null); one line when not a number
    (`testbed.config.group_values.number`)."""
    if value is None:
        return default
    return group_values.number({key: value}, key, "cost_model")


@COST_MODELS.register("roofline")
def roofline(model: ModelShape, hw: HardwareSpec, mfu: float = DEFAULT_MFU,
             attn_mfu: float = DEFAULT_ATTN_MFU, mbu: float = DEFAULT_MBU,
             overhead_s: float | None = None,
             interconnect_bw: float | None = None) -> RooflineCostModel:
    return RooflineCostModel(
        model, hw, mfu=number("mfu", mfu, DEFAULT_MFU), mbu=number("mbu", mbu, DEFAULT_MBU),
        overhead_s=number("overhead_s", overhead_s, None),
        interconnect_bw=number("interconnect_bw", interconnect_bw, None),
        attn_mfu=number("attn_mfu", attn_mfu, DEFAULT_ATTN_MFU))


@COST_MODELS.register("fitted")
def fitted(model: ModelShape, hw: HardwareSpec, path: str | None = None,
           mfu: float = DEFAULT_MFU, attn_mfu: float = DEFAULT_ATTN_MFU, mbu: float = DEFAULT_MBU,
           overhead_s: float | None = None,
           interconnect_bw: float | None = None) -> FittedCostModel:
    """Coefficients from ``path``, floored by the roofline of the other settings."""
    if not path:
        raise BadInput("cost_model.path is required with cost_model=fitted (a YAML file written "
                       "by testbed.sim.cost_model.save_fitted)")
    return load_fitted(resolve_path(path), floor_model=roofline(
        model, hw, mfu, attn_mfu, mbu, overhead_s, interconnect_bw))


# the Vidur-profile model imports its profile reader only when chosen
COST_MODELS.register("vidur", "testbed.sim.vidur_cost:vidur_cost_model")


def resolve_path(path: str | Path) -> Path:
    """``path`` as given, or relative to the repository when it names a shipped file."""
    resolved = Path(path)
    if not resolved.is_absolute() and not resolved.exists():
        resolved = Path(__file__).resolve().parents[2] / path
    return resolved
