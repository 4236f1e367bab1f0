"""The executor seam: the only thing that differs between the simulator and the engine.

An executor receives a `Batch` and returns a `StepOutcome`: how long the step took and the token
each entry produced. The simulator's `testbed.sim.executor.SimExecutor` asks a cost model for the
duration and emits the workload's predetermined tokens; the engine's
`testbed.engine.executor.EngineExecutor` runs the model and times it. `EXECUTORS` builds the one
``backend=`` names (``backend=custom backend.target=module.Class``: any class with ``execute``,
built with the run's values it names, e.g. ``cost_model``; docs/extending.md). Both built-ins are
registered by import path, so the serving loop imports neither the simulator nor torch.
"""

from __future__ import annotations

from typing import Protocol

from testbed.registry import Registry
from testbed.scheduler.batch import Batch, StepOutcome


class Executor(Protocol):
    def execute(self, batch: Batch) -> StepOutcome: ...


#: what the run offers an executor (testbed/assembly.py); the ``backend`` group sets nothing else
EXECUTOR_CONTEXT = ("cost_model", "model", "num_slots", "max_slots", "mem_fraction", "device",
                    "dtype", "attention", "cascade_min_saved", "cuda_graph",
                    "cuda_graph_max_batch", "seed", "forced", "temperature", "top_p")
EXECUTORS = Registry("backend", methods=("execute",), context_keys=EXECUTOR_CONTEXT,
                     what="an executor (execute(Batch) -> StepOutcome)")
EXECUTORS.register("sim", "testbed.sim.executor:SimExecutor")
EXECUTORS.register("engine", "testbed.engine.executor:make_engine_executor")  # imports torch
