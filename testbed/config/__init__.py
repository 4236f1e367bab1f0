"""The config layer: a run's configuration read, checked and turned into the plan of a run.

- `overrides` checks the command line's overrides before Hydra composes them (`compose_config`
  composes a config for scripts), `cli` the entry points' one-line errors;
- `group_values` reads typed values out of a config group, `registry` turns a group into an
  object for every family (cache, eviction, scheduler, router, cost model, workload, executor);
- `model_group` the ``model`` group (presets, checkpoints by path), `model_shape` the
  `ModelShape` the engine and the simulator share; `engine_config` the ``engine:`` block,
  `engine_timing` the engine's threads and step clock; `backend_limits` what a backend cannot
  serve;
- `assembly`: ``assemble(cfg)``, the one step from a composed config to a checked `Assembly`
  (`builders`), which builds the run's objects.

Nothing is imported here, so that the families (testbed/cache, testbed/scheduler, ...) can read
`group_values` and `registry` without loading the assembly that imports them.
"""
