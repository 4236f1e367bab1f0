"""The executor seam: the only thing that differs between the simulator and the engine.

An executor receives a `Batch` and returns how long the step took and the token each entry
produced. `SimExecutor` asks a cost model for the duration (with ``attention=cascade*``, of the
step's cascade groups: `testbed.scheduler.decode_groups`) and emits the workload's predetermined
output tokens; the engine's executor runs the model and times it. `EXECUTORS` builds the one
``backend=`` names (``backend=custom backend.target=module.Class``: any class with ``execute``,
built with the run's values it names, e.g. ``cost_model``; docs/extending.md).
"""

from __future__ import annotations

from typing import Protocol

from testbed.registry import Registry
from testbed.scheduler.batch import Batch, StepOutcome  # StepOutcome: re-exported
from testbed.scheduler.decode_groups import DecodeGroups, cascades
from testbed.sim.cost_model import CostModel
from testbed.sim.step_shape import StepShape


class Executor(Protocol):
    def execute(self, batch: Batch) -> StepOutcome: ...


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
    shared prefixes read once per group (the engine's groups, `DecodeGroups`); any other name,
    or None, prices every request's whole context. ``cascade_min_saved``: as the engine's, a
    step whose groups save fewer KV reads is priced plain (`DecodeGroups`).
    """

    def __init__(self, cost_model: CostModel, attention: str | None = None,
                 cascade_min_saved: int = 0) -> None:
        self.cost_model = cost_model
        self.groups = DecodeGroups(min_saved=cascade_min_saved) if cascades(attention) else None
        self.decode_context = 0  # Σcontext of the decode steps priced so far
        self.decode_saved = 0  # of which cascade left unread (StepShape.shared_saving)

    def execute(self, batch: Batch) -> StepOutcome:
        new, context = batch.shape()
        shared = self.groups(batch.entries) if self.groups is not None else ()
        if batch.kv_copies or any(e.reuse for e in batch.entries):
            step = reuse_shape(batch)
        else:
            step = StepShape(new=new, context=context, shared=shared)
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


#: what the run offers an executor (testbed/assembly.py); the ``backend`` group sets nothing else
EXECUTOR_CONTEXT = ("cost_model", "model", "num_slots", "max_slots", "mem_fraction", "device",
                    "dtype", "attention", "cascade_min_saved", "seed", "forced", "temperature",
                    "top_p")
EXECUTORS = Registry("backend", methods=("execute",), context_keys=EXECUTOR_CONTEXT,
                     what="an executor (execute(Batch) -> StepOutcome)")
EXECUTORS.register("sim", SimExecutor)
EXECUTORS.register("engine", "testbed.engine.executor:make_engine_executor")  # imports torch
