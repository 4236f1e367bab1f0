"""The executor seam: the only thing that differs between the simulator and the engine.

An executor receives a `Batch` and returns how long the step took and the token each entry
produced. `SimExecutor` asks a cost model for the duration and emits the workload's predetermined
output tokens; the engine's executor runs the model and times it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
