"""The validations: our code against other code, and the checks that need a GPU.

One package per peer, each release a parameter of its harness:

- `sglang`: our scheduler, replay and eviction against SGLang's own scheduling code and
  RadixCache, 0.5.23 or 0.4.10 (``python -m experiments.validation.sglang --release R``; the
  node-by-node checkpoint fields and the whole-trace replay beside it).
- `vllm`: ``scheduler=vllm`` against vLLM 0.32's own ``Scheduler`` and ``KVCacheManager`` from
  its wheel (``vllm.scheduler``, with drafts ``vllm.spec_blocks``); a live vLLM (CPU, its own
  venv) driven by ``backend=server`` (``vllm.caching``: cached tokens and hit rates;
  ``vllm.latency``: the simulator's latencies); our n-gram drafter against vLLM's
  (``vllm.ngram``).
- `vidur`: our simulator against Vidur on the same Azure requests
  (``python -m experiments.validation.vidur``), and the roofline's efficiencies fitted to a Vidur
  profile (``vidur.roofline``, `testbed.sim.roofline_fit`).

Our engine against our simulator, and the GPU checks:

- `sim_vs_engine`: does the simulator predict the engine? Calibrate, then compare (``--real``:
  SmolLM2-135M on four text workloads); `prefill_rows` and `captured_steps` look closer at its
  steps.
- `server_vs_engine`: a live ``testbed.serve`` against the offline engine.
- `blend_engine`: the engine's blend prefill on the CPU, its time and its distance from exact.
- `gpu_engine`: the engine's hot path and cascade decoding on a GPU (part of ``gpu_validate.sh``;
  `gpu_runs`, `gpu_tiers` and `gpu_report` its plan, tier copies and report).
- ``gpu_validate.sh``: the GPU validation in one command, one JSON report.
"""
