"""`VidurCostModel`: step times from measured operator times (a Vidur profile), operator by
operator.

A step (`StepShape`: request i computes ``new[i]`` tokens over ``context[i]`` cached ones) costs,
the way Vidur decomposes an iteration:

- token-level operators by the step's total new tokens N: per layer the norms, QKV and output
  projections, rope, MLP up/act/down and two residual adds (× the model's layers), and the
  embedding once. The LM head and sampler are not in the profile and not counted (the LM head
  runs for one position per request: ~0.2 ms of a 25–65 ms CodeLlama-34B decode step);
- attention per layer: a decode step (every request computes one token) is one decode kernel over
  the batch size B and its mean context (the profile's axes; B × mean = the KV read); a prefill
  step runs every request as a chunk over its own context: chunk n over c cached tokens costs the
  profile's ``attn_prefill(n, c)``: the attention of n new tokens × their full context. A cached
  prefix is thus paid in attention only — less than recomputing it (whose tokens pass every
  operator) and more than the same chunk with nothing cached, which Vidur's own predictor (no
  prefix caching) cannot tell apart. A batch of chunks is one kernel: its smallest profiled time
  (launch and set-up) once, plus each chunk's time above it;
- two all-reduces per layer of N × hidden × dtype bytes among the tp ranks (tp > 1);
- a per-step CPU overhead (``hardware.step_overhead_s``, or ``cost_model.overhead_s``): Vidur's
  CPU-overhead profile is not in the data.

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
All of these are monotone, so a step never gets cheaper by doing more.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.sim.cost_model import StepShape
from testbed.sim.monotone import Curve, Surface
from testbed.sim.specs import ModelSpec
from testbed.sim.vidur_profile import EMB_OP, VidurProfile


@dataclass(frozen=True)
class StepParts:
    """One step's seconds by kind of work (their sum is the step time)."""

    token_ops: float
    attention: float
    all_reduce: float
    overhead: float

    @property
    def total(self) -> float:
        return self.token_ops + self.attention + self.all_reduce + self.overhead


class VidurCostModel:
    """Step time = token-level operators + attention + all-reduces (per layer, × layers) + CPU
    overhead, from a Vidur profile of ``model`` (see the module docstring)."""

    def __init__(self, profile: VidurProfile, model: ModelSpec, overhead_s: float) -> None:
        if overhead_s < 0:
            raise ValueError(f"cost_model.overhead_s must be >= 0, got {overhead_s}")
        self.profile, self.model, self.overhead_s = profile, model, overhead_s
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
        n = step.num_new
        attention = (self.decode_attention(step.context) if step.is_decode
                     else self.prefill_attention(step.new, step.context))
        all_reduce = 0.0
        if self.allreduce is not None:
            all_reduce = 2 * layers * self.allreduce.at(n * self._ar_bytes_per_token)
        return StepParts(self.token_ops.at(n), layers * attention, all_reduce, self.overhead_s)

    def step_time(self, step: StepShape) -> float:
        return self.parts(step).total

    def prefill_attention(self, new: tuple[int, ...], context: tuple[int, ...]) -> float:
        """One layer's prefill attention for chunks ``new`` over ``context`` cached tokens."""
        surface, launch, size = self.prefill, self._launch_s, self._max_chunk
        total = launch
        for n, c in zip(new, context):
            while n > size:  # a chunk past the profile: profiled-size pieces, each over the rest
                total += surface.at(size, c) - launch
                n, c = n - size, c + size
            total += surface.at(n, c) - launch
        return total

    def decode_attention(self, context: tuple[int, ...]) -> float:
        """One layer's decode attention for one new token over each of ``context``."""
        batch = len(context)
        mean = sum(context) / batch
        if batch <= self._max_batch:
            return self.decode.at(batch, mean)
        return self.decode.at(self._max_batch, mean) * batch / self._max_batch

    def __repr__(self) -> str:
        return (f"VidurCostModel({self.model.name}, tp={self.model.tp}, "
                f"profile={self.profile.directory}, overhead_s={self.overhead_s})")
