"""What one decode step costs the host: kernels a decoder layer launches, and host time a step.

A GPU decode step of a 7B model is bound by how many kernels its host launches and how long it
takes to prepare them, not by their arithmetic (docs/design.md §6). This counts both on any
machine, for the engine as it is:

- **kernels a layer**: one decode forward of the tiny model with ``attention=triton`` (the GPU's
  code path: Triton attention, the fused layer kernels and torch's linear layers; on a CPU under
  ``TRITON_INTERPRET=1``),
  every operator that launches a kernel counted once while decoder layer 0 runs: torch operators
  (views, allocations and the operators inside a Triton launch left out) and Triton launches;
  the same for ``cascade_triton`` on a batch whose requests share a prefix;
- **host time a step**: ``EngineExecutor.execute`` of a decode batch on the tiny model, the
  median of ``--steps`` (preparing the inputs, the forward, sampling, reading the tokens back),
  beside the runner's ``prepare`` alone (the inputs: slot table, metadata, the transfer), for
  the CPU's default attention.

It uses only APIs that predate the step room (`ModelRunner`, `EngineExecutor`, `Batch`; the
runner's ``cpu_kernels`` since issue 46), so the same file run in a checkout of an earlier
commit gives the "before" figures::

    TRITON_INTERPRET=1 python -m experiments.benchmarks.engine_step [--batch 8] [--context 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before torch and triton are imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from experiments.benchmarks.decode_batches import decode_batch  # noqa: E402
from testbed.engine.executor import EngineExecutor  # noqa: E402
from testbed.engine.loader import build_model, tiny_config  # noqa: E402
from testbed.engine.runner import ModelRunner  # noqa: E402
from testbed.scheduler.batch import Batch  # noqa: E402

NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
             "lift_fresh", "_local_scalar_dense", "resize_"}


def launches_kernel(func, args, out) -> bool:
    """Whether a dispatched aten operator launched a kernel: not an allocation, and not a view
    (an operator that may return a view of its input, ``reshape`` under inference mode among
    them, launched one when its output is not in the input's memory: it copied)."""
    if func.__name__.split(".")[0] in NO_KERNEL:
        return False
    if not any(r.alias_info is not None and not r.alias_info.is_write
               for r in func._schema.returns):
        return True
    first = out[0] if isinstance(out, (tuple, list)) else out
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    return isinstance(first, torch.Tensor) and source is not None \
        and first.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()


class LaunchCounter(TorchDispatchMode):
    """Counts kernel launches (torch operators and Triton kernels) while ``active``."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.in_triton = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.active and not self.in_triton and launches_kernel(func, args, out):
            self.ops.append(func.__name__)
        return out


def count_triton_launches(counter: LaunchCounter):
    """Patch Triton's launchers (compiled and interpreted) to count into ``counter``."""
    patched = []
    import triton.runtime.jit as jit
    targets = [(jit.JITFunction, "run")]
    try:
        import triton.runtime.interpreter as interp
        targets.append((interp.InterpretedFunction, "run"))
    except ImportError:
        pass
    for cls, name in targets:
        original = getattr(cls, name)

        def run(self, *args, _original=original, **kwargs):
            if counter.active and not counter.in_triton:
                counter.ops.append(f"triton:{getattr(self, 'fn', self).__name__}")
            counter.in_triton += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                counter.in_triton -= 1

        setattr(cls, name, run)
        patched.append((cls, name, original))
    return patched


def kernels_per_layer(model, attention: str, batch: Batch, slots: int, shared: int
                      ) -> list[str]:
    # torch's linear layers, as on a GPU (the CPU's oneDNN ones are not seen as kernels here)
    runner = ModelRunner(model, slots, attention=attention, cpu_kernels="torch")
    group = [(shared, list(range(len(batch.entries))))]  # the tree would group them so
    runner.decode_groups = lambda entries: group
    runner.run(batch)  # compile/warm up (and fill the slot table) outside the count
    counter = LaunchCounter()
    layer = model.layers[0]
    on = layer.register_forward_pre_hook(lambda *a: setattr(counter, "active", True))
    off = layer.register_forward_hook(lambda *a: setattr(counter, "active", False))
    patched = count_triton_launches(counter)
    try:
        with counter:
            runner.run(batch)
    finally:
        on.remove()
        off.remove()
        for cls, name, original in patched:
            setattr(cls, name, original)
    return counter.ops


def host_times(model, batch: Batch, slots: int, steps: int) -> tuple[float, float]:
    """Median seconds of a whole step (`EngineExecutor.execute`) and of `ModelRunner.prepare`."""
    runner = ModelRunner(model, slots)
    executor = EngineExecutor(runner)
    executor.execute(batch)
    whole, prepare = [], []
    for _ in range(steps):
        start = time.perf_counter()
        executor.execute(batch)
        whole.append(time.perf_counter() - start)
        start = time.perf_counter()
        runner.prepare(batch)
        prepare.append(time.perf_counter() - start)
    return statistics.median(whole), statistics.median(prepare)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--shared", type=int, default=160, help="prefix tokens the batch shares")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model(tiny_config(), seed=0)
    slots = args.batch * (args.context + 2) + 1
    batch = lambda: decode_batch(args.batch, args.context, args.shared,  # noqa: E731
                                 model.config.vocab_size)
    print(f"tiny model ({model.config.num_layers} layers), decode batch of {args.batch} x "
          f"{args.context} tokens ({args.shared} shared)")
    for attention in ("triton", "cascade_triton"):
        ops = kernels_per_layer(model, attention, batch(), slots, args.shared)
        print(f"kernels a decoder layer launches, attention={attention}: {len(ops)}")
        print("   " + ", ".join(ops))
    whole, prepare = host_times(model, batch(), slots, args.steps)
    print(f"host time a decode step (CPU, default attention, median of {args.steps}): "
          f"{whole * 1e3:.2f} ms; of which preparing the inputs: {prepare * 1e3:.2f} ms")


if __name__ == "__main__":
    from experiments import entry
    entry(main)
