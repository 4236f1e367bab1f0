"""The serving loop the simulator and the engine share (they differ only in their executor).

- `executor`: the seam (`Executor`: a `Batch` in, a `StepOutcome` out) and ``backend=``'s registry;
- `driver`: arrivals, program dependencies, think times, closed loops, load-backs and the step
  loop, in SimPy's virtual time (advanced by each step's priced or measured duration);
- `cluster`: N replicas behind a router, the same loop with routing and load accounting;
- `serve`: one replica's run from a built cache and executor, and its records;
- `observer`: what a run looked like step by step (``steps.jsonl``, ``timeline.json``).
"""
