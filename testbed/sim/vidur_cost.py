"""`VidurCostModel`: step times from measured operator times (a Vidur profile), operator by
operator.

A step (`StepShape`: request i computes ``new[i]`` tokens over ``context[i]`` cached ones) costs,
the way Vidur 0.0.26 prices a batch (``SklearnExecutionTimePredictor.get_execution_time`` and
``ExecutionTime.model_time``), × the model's layers:

- token-level operators by the step's total new tokens N rounded up to a multiple of 8 (Vidur's
  ``Batch._total_num_q_tokens_rounded``): the norms, QKV and output projections, rope, MLP
  up/act/down and two residual adds, plus the embedding once per step;
- attention: a decode step (every request computes one token) is one decode kernel over the batch
  size B and the mean context, truncated to a whole token and rounded up to a multiple of
  ``kv_granularity`` (Vidur's ``kv_cache_prediction_granularity``, 256, in
  ``_get_batch_decode_attention_params``), × (1 + ``decode_batching_overhead``) when B > 1 and the
  model has fewer KV heads than query heads (Vidur's ``attention_decode_batching_overhead_fraction``,
  0.1, GQA models only). With cascade decoding (`StepShape.shared`) the mean is of the KV the
  step reads, ``kv_read_context / B`` (each group's shared prefix once): the profiled decode
  kernel streams its requests' KV, so a batch reading that much KV is priced as B requests of
  the mean read. Neither the second kernel (the groups' prefix pass, its queries ``members``
  times a GQA group's) nor the merge is priced, which Vidur, with no cascade kernel profiled,
  could not price either; a prefill step runs every request as a chunk over its own context (rounded
  up the same way, as ``_get_batch_prefill_attention_params`` rounds): chunk n over c cached tokens
  costs the profile's ``attn_prefill(n, c)``, the attention of n new tokens × their full context.
  A cached prefix is thus paid in attention only — less than recomputing it (whose tokens pass
  every operator) and more than the same chunk with nothing cached, which Vidur's own predictor
  (no prefix caching) cannot tell apart. A batch of chunks is one kernel: its smallest profiled
  time (launch and set-up) once, plus each chunk's time above it;
- two all-reduces per layer of N (rounded as above) × hidden × dtype bytes among the tp ranks
  (tp > 1), each plus ``nccl_launch_s`` of CPU launch time (Vidur's
  ``nccl_cpu_launch_overhead_ms``, 0.02 ms; its ``nccl_cpu_skew_overhead_per_device_ms`` is 0 and
  not modelled);
- ``overhead_s`` per step, by default none (``conf/cost_model/vidur.yaml``): Vidur 0.0.26 prices a
  batch by its model time alone, with no scheduling, input preparation or sampling time.

Where we price differently from Vidur 0.0.26, on purpose (effects measured on the Azure
conversation trace with ``experiments.validation.vidur``; together they leave our steps within 2 % of
Vidur's on that run's batches, see docs/results/vs_vidur.md):
- the prefill KV is the context cached before the chunk, which is what the profile's
  ``kv_cache_size`` measured (the chunk attends to it plus itself). Vidur's scheduler passes
  ``num_processed_tokens + chunk`` as the KV of a prefill, so a fresh prompt of P tokens is priced
  as P new tokens over P cached ones (about three times the attended pairs; past the profile, its
  random forest stays flat). Ours is 20 % under Vidur's prefill attention on that trace, ~2 % of a
  prefill step;
- a batch of chunks pays the kernel set-up once (one varlen kernel), where Vidur adds each
  request's whole predicted time; chunks are not rounded up to Vidur's 32-token prediction grid
  (both: under 1 % on the table);
- both residual adds of a layer count: Vidur's profiler times only the second (``add``) and
  ``ExecutionTime`` counts one per layer; the embedding and the attention reshapes the profile
  timed count too (Vidur leaves out the embedding and trains on ``attn_prefill`` /
  ``attn_decode`` alone): +1–2 % on a step;
- the decode KV is the context before the step (the profile's ``kv_cache_size``); Vidur's is 2
  more (the token being computed, and the first output token counted as processed by the
  prefill), which moves its rounding up to 256 only at the boundaries.
The LM head and sampler are in neither (the LM head runs for one position per request: ~0.2 ms of
a 25–65 ms CodeLlama-34B decode step).

Measured medians are fitted monotone (`testbed.sim.monotone`: isotonic regression) and
interpolated linearly, bilinearly on the attention grids, so a prediction is exact at every profiled
point where the measurements are in order. Vidur's A100 profile is not in order everywhere (a larger
shape often measured a little faster); there each out-of-order run takes its mean. Measured on it
(fitted / measured at the profiled points): token-level operators exact at 27 % of the token
counts, within 1.5 % at 95 % and 4 % at worst, no bias (+0.01 % on average); prefill attention
exact at 29 % of the points, within 3.7 % at 95 %, 13 % at worst, +0.03 %; decode attention exact
at 51 %, within 10 % at 95 %, 38 % at worst, +0.2 %; all-reduces, which jump between a ~10 µs floor
and ~60 µs stalls, exact at 41 %, +5.6 % on average. Vidur itself fits random forests
(scikit-learn), which average neighbouring points (exact at none), are flat between their leaves
and take from a minute to an hour to train; SciPy's isotonic regression and one pass of
interpolation load and fit a profile in under a second, and each step then costs a few bisections
(~10 µs in Python).

Beyond the profile (Vidur's stops at 4,096 tokens; Mooncake's prompts run past 100k):
- token-level operators and all-reduces grow at the slope of their largest profiled points (the
  upper half of the range: compute- and bandwidth-bound, cost ∝ tokens and bytes);
- attention over more context than profiled grows, per cached token, at the rate the same chunk
  size (decode: batch size) shows over its largest profiled contexts; chunk sizes whose profiled
  contexts span too little (chunk + KV ≤ 4,096 leaves a 3,584-token chunk 512) take the rate
  per attended pair of the nearest chunk that spans enough; and no chunk or batch rises slower
  per attended pair than the largest that spans enough (small decode batches' short contexts are
  launch-bound or sit in the L2 cache: one request would otherwise add 0.2 ns per cached token
  and layer, 5× faster than HBM can deliver its KV);
- chunks shorter than the smallest profiled one (64 tokens) cost that one's time;
- a chunk longer than the largest profiled one runs as consecutive profiled-size chunks, each
  over everything before it (the same query–key pairs);
- more decode requests than profiled cost the largest batch's time per request.
All of these are monotone (and so are the roundings up), so a step never gets cheaper by doing
more.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.errors import BadInput
from testbed.config.model_shape import ModelShape
from testbed.sim.step_shape import StepShape, kv_move_bytes
from testbed.sim.monotone import Curve, Surface
from testbed.sim.specs import HardwareSpec
from testbed.sim.vidur_profile import EMB_OP, VidurProfile


#: Vidur 0.0.26's defaults (``vidur/config/config.py``, ``BaseExecutionTimePredictorConfig``) and
#: the rounding of its ``Batch``.
TOKEN_MULTIPLE = 8  # Batch._total_num_q_tokens_rounded
KV_GRANULARITY = 256  # kv_cache_prediction_granularity
DECODE_BATCHING_OVERHEAD = 0.1  # attention_decode_batching_overhead_fraction (GQA models)
NCCL_LAUNCH_S = 2e-5  # nccl_cpu_launch_overhead_ms = 0.02


@dataclass(frozen=True)
class StepParts:
    """One step's seconds by kind of work (their sum is the step time)."""

    token_ops: float
    attention: float
    all_reduce: float
    overhead: float
    kv_moves: float = 0.0  # reuse beyond exact prefixes: priced from bytes (no profiled kernel)

    @property
    def total(self) -> float:
        return self.token_ops + self.attention + self.all_reduce + self.overhead + self.kv_moves


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


class VidurCostModel:
    """Step time = token-level operators + attention + all-reduces (per layer, × layers) + CPU
    overhead, from a Vidur profile of ``model`` (see the module docstring)."""

    def __init__(self, profile: VidurProfile, model: ModelShape, overhead_s: float = 0.0,
                 kv_granularity: int = KV_GRANULARITY,
                 decode_batching_overhead: float = DECODE_BATCHING_OVERHEAD,
                 nccl_launch_s: float = NCCL_LAUNCH_S, move_bw: float | None = None) -> None:
        """``move_bw``: bytes/s at which the KV moves of reuse beyond exact prefixes run (Vidur
        profiles no such kernel; None: they cost nothing)."""
        for key, value in (("overhead_s", overhead_s), ("nccl_launch_s", nccl_launch_s),
                           ("decode_batching_overhead", decode_batching_overhead)):
            if value < 0:
                raise BadInput(f"cost_model.{key} must be >= 0, got {value}")
        if kv_granularity != int(kv_granularity) or kv_granularity < 1:
            raise BadInput(f"cost_model.kv_granularity must be a whole number >= 1, got "
                           f"{kv_granularity}")
        self.profile, self.model, self.overhead_s = profile, model, overhead_s
        self.move_bw = move_bw
        self.kv_granularity, self.nccl_launch_s = int(kv_granularity), nccl_launch_s
        gqa = model.num_heads > model.num_kv_heads  # Vidur adds the overhead for GQA only
        self.decode_batching_overhead = decode_batching_overhead if gqa else 0.0
        layers = model.num_layers
        self.token_ops = Curve.fit(profile.tokens,
                                   layers * profile.layer_s() + profile.ops[EMB_OP])
        self.prefill = Surface.fit(profile.prefill.rows, profile.prefill.cols,
                                   profile.prefill.values)
        self.decode = Surface.fit(profile.decode.rows, profile.decode.cols,
                                  profile.decode.values)
        self.allreduce = (Curve.fit(profile.allreduce_bytes, profile.allreduce_s)
                          if model.tp > 1 else None)
        self._launch_s = self.prefill.values[0][0]  # the smallest prefill kernel: set-up
        self._max_chunk = int(self.prefill.rows[-1])
        self._max_batch = self.decode.rows[-1]
        self._ar_bytes_per_token = model.hidden_size * model.dtype_bytes

    def parts(self, step: StepShape) -> StepParts:
        layers = self.model.num_layers
        n = round_up(step.num_new, TOKEN_MULTIPLE)
        attention = (self.decode_attention(step.context, step.shared_saving) if step.is_decode
                     else self.prefill_attention(step.new, step.context))
        all_reduce = 0.0
        if self.allreduce is not None:
            one = self.allreduce.at(n * self._ar_bytes_per_token) + self.nccl_launch_s
            all_reduce = 2 * layers * one
        moved = kv_move_bytes(self.model, step)
        moves = moved / self.move_bw if moved and self.move_bw else 0.0
        return StepParts(self.token_ops.at(n), layers * attention, all_reduce, self.overhead_s,
                         moves)

    def step_time(self, step: StepShape) -> float:
        return self.parts(step).total

    def prefill_attention(self, new: tuple[int, ...], context: tuple[int, ...]) -> float:
        """One layer's prefill attention for chunks ``new`` over ``context`` cached tokens."""
        surface, launch, size = self.prefill, self._launch_s, self._max_chunk
        total = launch
        for n, c in zip(new, context):
            c = round_up(c, self.kv_granularity)
            while n > size:  # a chunk past the profile: profiled-size pieces, each over the rest
                total += surface.at(size, c) - launch
                n, c = n - size, c + size
            total += surface.at(n, c) - launch
        return total

    def decode_attention(self, context: tuple[int, ...], shared_saving: int = 0) -> float:
        """One layer's decode attention for one new token over each of ``context``, of which
        cascade decoding leaves ``shared_saving`` tokens unread (`StepShape.shared_saving`)."""
        batch = len(context)
        kv = round_up((sum(context) - shared_saving) // batch, self.kv_granularity)
        if batch <= self._max_batch:
            seconds = self.decode.at(batch, kv)
        else:
            seconds = self.decode.at(self._max_batch, kv) * batch / self._max_batch
        return seconds * (1 + self.decode_batching_overhead) if batch > 1 else seconds

    def __repr__(self) -> str:
        return (f"VidurCostModel({self.model.name}, tp={self.model.tp}, "
                f"profile={self.profile.directory}, overhead_s={self.overhead_s}, "
                f"kv_granularity={self.kv_granularity}, "
                f"decode_batching_overhead={self.decode_batching_overhead}, "
                f"nccl_launch_s={self.nccl_launch_s})")


def vidur_cost_model(model: ModelShape, hw: HardwareSpec, profile_dir: str | None = None,
                     overhead_s: float | None = 0.0, kv_granularity: int = KV_GRANULARITY,
                     decode_batching_overhead: float = DECODE_BATCHING_OVERHEAD,
                     nccl_launch_s: float = NCCL_LAUNCH_S) -> VidurCostModel:
    """The ``cost_model=vidur`` entry: the profile in ``profile_dir`` for ``model``; ``overhead_s``
    null takes the hardware's ``step_overhead_s``."""
    from testbed.data import resolve_folder
    from testbed.sim.cost_model import DEFAULT_MBU, number, resolve_path
    from testbed.sim.vidur_profile import load_vidur_profile

    if not profile_dir:
        raise BadInput("cost_model.profile_dir is required with cost_model=vidur (a directory "
                       "of Vidur's profiling CSVs: mlp.csv, attention.csv, all_reduce.csv)")
    overhead = number("overhead_s", overhead_s, None)
    return VidurCostModel(
        load_vidur_profile(resolve_path(resolve_folder(profile_dir, "cost_model.profile_dir")),
                           model), model,
        overhead_s=hw.step_overhead_s if overhead is None else overhead,
        kv_granularity=number("kv_granularity", kv_granularity, KV_GRANULARITY),
        decode_batching_overhead=number("decode_batching_overhead", decode_batching_overhead,
                                        DECODE_BATCHING_OVERHEAD),
        nccl_launch_s=number("nccl_launch_s", nccl_launch_s, NCCL_LAUNCH_S),
        move_bw=hw.mem_bw * DEFAULT_MBU)
