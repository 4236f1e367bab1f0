"""The executor seam: the only thing that differs between the simulator and the engine.

An executor runs a `Batch` in two calls, launch and result (SGLang's ``run_batch`` and
``process_batch_result``, vLLM's async scheduling): ``launch(batch) -> handle`` starts the step
and returns at once where the device runs on its own (CUDA), and ``handle.result() ->
StepOutcome`` waits for it and returns its tokens and times. Between the two the serving loop
forms and launches the next step (`testbed.serving.step_cycle`), so a step's tokens never have to
reach the host before the next step starts: the engine keeps them on the device, where the next
step reads its inputs. On a synchronous device (the CPU, the simulator's cost model) launch does
the work and result hands it over.

A handle carries ``launch_s``: the host seconds its launch took (on a synchronous device, the
step's work included), which the serving loop's timeline charges to the host. An executor says
whether its device runs beside the host with ``asynchronous`` (absent: False). ``execute(batch)``
is ``launch(batch).result()``; an executor with only ``execute`` (a user's, docs/extending.md) is
served through `launcher`: its ``duration_s`` is the device's time, the host's none.

The simulator's `testbed.sim.executor.SimExecutor` prices the step with a cost model (and the
host's work with `testbed.sim.overlap.HostCost`) and emits the workload's predetermined tokens; the
engine's `testbed.engine.executor.EngineExecutor` runs the model. `EXECUTORS` builds the one
``backend=`` names (``backend=custom backend.target=module.Class``: any class with ``execute``,
built with the run's values it names, e.g. ``cost_model``; docs/extending.md). Both built-ins are
registered by import path, so the serving loop imports neither the simulator nor torch.
"""

from __future__ import annotations

from typing import Any, Protocol

from testbed.config.registry import Registry
from testbed.scheduler.batch import Batch, StepOutcome


class StepHandle(Protocol):
    launch_s: float  # host seconds the launch took (a synchronous device's work included)

    def result(self) -> StepOutcome: ...


class Executor(Protocol):
    def execute(self, batch: Batch) -> StepOutcome: ...


class Done:
    """The handle of a step whose outcome is known at launch (a synchronous executor)."""

    def __init__(self, outcome: StepOutcome, launch_s: float | None = None) -> None:
        self.outcome = outcome
        self.launch_s = outcome.duration_s if launch_s is None else launch_s

    def result(self) -> StepOutcome:
        return self.outcome


class _ExecuteOnly:
    """An executor with ``execute`` alone: launch runs the step and its ``duration_s`` is the
    device's, the host's work none (the serving loop's timeline then advances by it, as it
    always did)."""

    asynchronous = True

    def __init__(self, executor: Any) -> None:
        self.executor = executor

    def launch(self, batch: Batch) -> Done:
        return Done(self.executor.execute(batch), launch_s=0.0)


def launcher(executor: Any) -> Any:
    """``executor`` if it launches, else it wrapped to (`_ExecuteOnly`)."""
    return executor if hasattr(executor, "launch") else _ExecuteOnly(executor)


#: what the run offers an executor (testbed/config/builders.py); the ``backend`` group sets
#: nothing else
EXECUTOR_CONTEXT = ("cost_model", "model", "num_slots", "max_slots", "mem_fraction", "device",
                    "dtype", "attention", "cascade_min_saved", "cascade_rule", "cuda_graph",
                    "cuda_graph_max_batch", "cpu_kernels", "seed", "forced", "temperature", "top_p",
                    "host_cost", "speculative", "requests")
EXECUTORS = Registry("backend", methods=("execute",), context_keys=EXECUTOR_CONTEXT,
                     what="an executor (execute(Batch) -> StepOutcome)")
EXECUTORS.register("sim", "testbed.sim.executor:SimExecutor")
EXECUTORS.register("engine", "testbed.engine.executor:make_engine_executor")  # imports torch
