"""The validations: our code against other code, and the checks that need a GPU.

- `sglang` (a package): our scheduler, replay and eviction against SGLang's own scheduling code
  and RadixCache, one harness for its releases (``python -m experiments.validation.sglang
  --release 0.5.23|0.4.10``).
- `vllm_scheduler`: ``scheduler=vllm`` against vLLM 0.32's own ``Scheduler`` and ``KVCacheManager``.
- `vllm_wheel`: vLLM 0.32's scheduler modules, fetched from its wheel and loaded with stand-ins.
- `vs_vllm`: a live vLLM 0.32 (CPU, its own venv) driven by ``backend=server``: its cached
  tokens against a block-hash replay of what ran, its closed-loop hit rates against
  ``scheduler=vllm``.
- `vidur`: our simulator against Vidur on the same Azure requests.
- `vidur_drive`: one timed Vidur run, run by file path in Vidur's own virtual environment.
- `roofline`: the roofline's efficiencies fitted to a Vidur profile (`testbed.sim.roofline_fit`).
- `sim_vs_engine`: does the simulator predict the engine? Calibrate, then compare (``--real``:
  SmolLM2-135M on four text workloads).
- `blend_engine`: the engine's blend prefill on the CPU, its time and its distance from exact.
- `gpu_engine`: the engine's hot path and cascade decoding on a GPU (part of ``gpu_validate.sh``).
- ``gpu_validate.sh``: the GPU validation in one command, one JSON report.
"""
