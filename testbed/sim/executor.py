"""The simulator's executor: `SimExecutor` asks a cost model how long a `Batch` takes on the
device (with ``attention=cascade*``, of the step's cascade groups:
`testbed.scheduler.decode_groups`) and a `HostCost` what it costs the host
(`testbed.sim.overlap`), and emits the workload's predetermined output tokens. Its launch knows
the outcome at once; the serving loop's timeline places the step (`testbed.serving.step_cycle`).
The seam it implements, and the registry of ``backend=``, are `testbed.serving.executor`.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from testbed.scheduler.batch import Batch, DecodeBatch, StepOutcome  # StepOutcome: re-exported
from testbed.scheduler.decode_groups import DecodeGroups, SharedReads, cascades
from testbed.scheduler.request_state import Req
from testbed.serving.executor import Done
from testbed.sim.acceptance import Acceptance
from testbed.sim.cost_model import CostModel
from testbed.sim.overlap import HostCost
from testbed.sim.step_shape import StepShape
from testbed.workloads.request import TOKEN_DTYPE

TOKEN_TYPECODE = np.dtype(TOKEN_DTYPE).char  # the array module's code for the token dtype


def predetermined_tokens(batch: Batch, acceptance: Acceptance | None = None
                         ) -> list[int | tuple[int, ...] | None]:
    """The output token each entry produces, from the workload (None where it makes none). The
    position comes from the entry (`BatchEntry.output_index`), so a step launched before the
    last step's results were applied (overlap) gets the right ones. A verification entry's are
    the tokens ``acceptance`` verifies (`testbed.sim.acceptance`)."""
    if isinstance(batch, DecodeBatch):  # its columns (once per decoded token)
        return decode_tokens(batch)
    tokens: list[int | tuple[int, ...] | None] = []
    plain_decode = batch.kind == "decode" and not batch.verifies
    for e in batch.entries:
        if plain_decode:  # (`output_made`, inline: once per decoded token)
            req = e.req
            at = e.context + 1 - len(req.prompt)
            at = at if 0 <= at < req.max_new_tokens else None
        else:
            at = e.output_made
        if at is None:
            tokens.append(None)
        elif e.draft is None:
            tokens.append((e.req.recorded_output or recorded_output(e.req))[at])
        else:
            tokens.append((acceptance or Acceptance()).tokens(e))
    return tokens


def decode_tokens(batch: DecodeBatch) -> list[int | None]:
    """`predetermined_tokens` of a plain decode step: request ``i``'s output token at fill
    position ``contexts[i] + 1`` (None past its last)."""
    tokens: list[int | None] = []
    append = tokens.append
    for req, context in zip(batch.reqs, batch.contexts):
        at = context + 1 - len(req.prompt)
        if 0 <= at < req.max_new_tokens:
            append((req.recorded_output or recorded_output(req))[at])
        else:
            append(None)
    return tokens


def recorded_output(req: Req) -> array:
    """The request's workload output, kept on it at the first read: 4 bytes a token, read as
    ints (a list would hold an object each)."""
    req.recorded_output = array(TOKEN_TYPECODE, req.request.output.tobytes())
    return req.recorded_output


class SimExecutor:
    """A GPU that takes the cost model's time and says what the workload says.

    ``attention`` is the run's key: ``cascade*`` prices cascade decoding, each decode step's
    shared prefixes read once per group (the groups the scheduler put on the batch, the engine's
    too; a batch formed without them is grouped here by the same `DecodeGroups`); any other name,
    or None, prices every request's whole context. ``cascade_min_saved``: as the engine's, a
    step whose groups save fewer KV reads is priced plain (`DecodeGroups`). Without cascade, a
    cost model that prices re-read KV apart (``prices_rereads``: a fitted CPU model whose ``h``
    is not its ``e``) is told how much of a decode step's KV other requests of the batch read
    first (`StepShape.reread`, counted from the slots by `SharedReads`, whatever the cache).

    ``host_cost``: the host's seconds per step, priced apart (None: none); its ``concurrent``
    says whether the device runs beside the host (``asynchronous``), so that under
    ``scheduler.overlap`` the host's work hides behind the device's.

    ``speculative``: the run's ``speculative`` block; its ``acceptance`` decides what a
    verification step accepts (`testbed.sim.acceptance`), drawn from ``seed``; with
    ``recorded``, from the run it names, whose request ids ``requests`` (the workload's, where
    given) must all be in. A verification
    step is priced as what it is, each request's last token and drafts (q tokens) against its
    context, with every query's logits (`StepShape.verify`: a fitted model's ``verify``
    coefficients where it has them).
    """

    def __init__(self, cost_model: CostModel, attention: str | None = None,
                 cascade_min_saved: int = 0, host_cost: HostCost | None = None,
                 speculative: Any = None, seed: int = 0, requests: Any = None,
                 cascade_rule: Any = None) -> None:
        self.cost_model = cost_model
        self.host_cost = host_cost or HostCost()
        self.acceptance = Acceptance(speculative.acceptance, speculative.accept_rate, seed,
                                     getattr(speculative, "acceptance_path", None)) \
            if speculative is not None and speculative.active else Acceptance()
        if requests is not None:
            self.acceptance.check_requests(r.id for r in requests)
        self.groups = DecodeGroups(min_saved=cascade_min_saved, rule=cascade_rule) \
            if cascades(attention) else None  # cascade_rule: where groups form (as the engine's)
        self.shared_reads = SharedReads() if self.groups is None and getattr(
            cost_model, "prices_rereads", False) else None
        self.decode_context = 0  # Σcontext of the decode steps priced so far
        self.decode_saved = 0  # of which cascade left unread (StepShape.shared_saving)
        self.reach = None  # a `testbed.sim.grid_reach.GridReach` told every step priced, if set

    @property
    def asynchronous(self) -> bool:
        return self.host_cost.concurrent

    def launch(self, batch: Batch) -> Done:
        """The step priced: its device time from the cost model, its host time from
        ``host_cost`` (a synchronous device's launch takes both)."""
        device = self._device_time(batch)
        host = self.host_cost.host_time(batch)
        outcome = StepOutcome(duration_s=device, tokens=predetermined_tokens(batch, self.acceptance),
                              gpu_s=device, host_s=host)
        return Done(outcome, host if self.asynchronous else host + device)

    def execute(self, batch: Batch) -> StepOutcome:
        return self.launch(batch).result()

    def _device_time(self, batch: Batch) -> float:
        new, context = batch.shape()
        shared = () if self.groups is None else batch.decode_groups \
            if batch.decode_groups is not None else self.groups(batch.entries)
        if batch.kv_copies or (batch.kind == "prefill" and any(e.reuse for e in batch.entries)):
            step = reuse_shape(batch)
        elif not shared and self.shared_reads is None and isinstance(batch, DecodeBatch):
            step = StepShape.of_decode(context)  # (once a step: its shape needs no checks)
        else:
            reread = self.shared_reads(batch.entries) if self.shared_reads is not None else 0
            step = StepShape(new=new, context=context, shared=shared, reread=reread,
                             verify=batch.verifies)
        if self.reach is not None:
            self.reach.add(step)
        if step.is_decode:
            self.decode_context += step.num_context
            self.decode_saved += step.shared_saving
        return self.cost_model.step_time(step)

    @property
    def cascade_saved(self) -> float | None:
        """Share of the decode steps' cached KV (Σcontext) that cascade left unread; None
        without cascade or before any decode step."""
        if self.groups is None or not self.decode_context:
            return None
        return self.decode_saved / self.decode_context


def reuse_shape(batch: Batch) -> StepShape:
    """A prefill step with reuse beyond exact prefixes, as the cost models price it: each entry
    computes its fresh and recomputed tokens (at least one: an entry wholly reused still runs)
    over the rest of its positions as context; the reused spans' tokens are rotated, the chunk
    stores' copied (`testbed.sim.cost_model`)."""
    new = tuple(max(e.computed, 1) for e in batch.entries)
    context = tuple(e.context + e.new - n for e, n in zip(batch.entries, new))
    rotated = sum(len(s) for e in batch.entries for s in e.reuse)
    return StepShape(new=new, context=context, rotated=rotated,
                     copied=sum(len(c) for c in batch.kv_copies))

