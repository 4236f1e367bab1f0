"""Serving a run on the backend ``backend=`` names, with the objects its `Assembly` builds.

`dispatch` (``run_backend``) serves the workload on replay, sim, engine, custom or server and
returns the records; `replay` is the replay backend's loop (requests one at a time, no time);
`engine_assembly` builds the engine, its cache and its limits together (``backend=engine`` and
``testbed.serve``). The simulator's and the engine's steps themselves live in testbed/sim and
testbed/engine, their shared serving loop in testbed/serving, a live server's client in
testbed/remote.

Nothing is imported here: `replay` is read by tools (``testbed.viz``, ``testbed.workloads``)
that need no assembly.
"""
