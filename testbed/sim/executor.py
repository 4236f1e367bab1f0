"""The simulator's executor: `SimExecutor` asks a cost model how long a `Batch` takes (with
``attention=cascade*``, of the step's cascade groups: `testbed.scheduler.decode_groups`) and
emits the workload's predetermined output tokens. The seam it implements, and the registry of
``backend=``, are `testbed.serving.executor`.
"""

from __future__ import annotations

from testbed.scheduler.batch import Batch, StepOutcome  # StepOutcome: re-exported
from testbed.scheduler.decode_groups import DecodeGroups, SharedReads, cascades
from testbed.sim.cost_model import CostModel
from testbed.sim.step_shape import StepShape


def predetermined_tokens(batch: Batch) -> list[int | None]:
    """The next output token of each entry that produces one, from the workload."""
    out: list[int | None] = []
    for e in batch.entries:
        req = e.req
        produces = e.produces_token and req.remaining_new_tokens > 0
        out.append(int(req.request.output[len(req.output)]) if produces else None)
    return out


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
    """

    def __init__(self, cost_model: CostModel, attention: str | None = None,
                 cascade_min_saved: int = 0) -> None:
        self.cost_model = cost_model
        self.groups = DecodeGroups(min_saved=cascade_min_saved) if cascades(attention) else None
        self.shared_reads = SharedReads() if self.groups is None and getattr(
            cost_model, "prices_rereads", False) else None
        self.decode_context = 0  # Σcontext of the decode steps priced so far
        self.decode_saved = 0  # of which cascade left unread (StepShape.shared_saving)
        self.reach = None  # a `testbed.sim.grid_reach.GridReach` told every step priced, if set

    def execute(self, batch: Batch) -> StepOutcome:
        new, context = batch.shape()
        shared = () if self.groups is None else batch.decode_groups \
            if batch.decode_groups is not None else self.groups(batch.entries)
        if batch.kv_copies or any(e.reuse for e in batch.entries):
            step = reuse_shape(batch)
        else:
            reread = self.shared_reads(batch.entries) if self.shared_reads is not None else 0
            step = StepShape(new=new, context=context, shared=shared, reread=reread)
        if self.reach is not None:
            self.reach.add(step)
        if step.is_decode:
            self.decode_context += step.num_context
            self.decode_saved += step.shared_saving
        return StepOutcome(duration_s=self.cost_model.step_time(step),
                           tokens=predetermined_tokens(batch))

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

