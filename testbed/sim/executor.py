"""The executor seam: the only thing that differs between the simulator and the engine.

An executor receives a `Batch` and returns how long the step took and the token each entry
produced. `SimExecutor` asks a cost model for the duration and emits the workload's predetermined
output tokens; the engine's executor runs the model and times it. `EXECUTORS` builds the one
``backend=`` names (``backend=custom backend.target=module.Class``: any class with ``execute``,
built with the run's values it names, e.g. ``cost_model``; docs/extending.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from testbed.registry import Registry
from testbed.scheduler.batch import Batch
from testbed.sim.cost_model import CostModel, StepShape


@dataclass(frozen=True)
class StepOutcome:
    duration_s: float
    tokens: list[int | None]  # per batch entry; None where no token is produced


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
    """A GPU that takes the cost model's time and says what the workload says."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model

    def execute(self, batch: Batch) -> StepOutcome:
        new, context = batch.shape()
        duration = self.cost_model.step_time(StepShape(new=new, context=context))
        return StepOutcome(duration_s=duration, tokens=predetermined_tokens(batch))


#: what the run offers an executor (testbed/assembly.py); the ``backend`` group sets nothing else
EXECUTOR_CONTEXT = ("cost_model", "model", "num_slots", "max_slots", "mem_fraction", "device",
                    "dtype", "attention", "seed", "forced", "temperature", "top_p")
EXECUTORS = Registry("backend", methods=("execute",), context_keys=EXECUTOR_CONTEXT,
                     what="an executor (execute(Batch) -> StepOutcome)")
EXECUTORS.register("sim", SimExecutor)
EXECUTORS.register("engine", "testbed.engine.executor:make_engine_executor")  # imports torch
