"""The differential checks against SGLang's own code, one harness for its releases (0.4.10 and
0.5.23, `wheel.RELEASES`): ``python -m experiments.validation.sglang [--release R]`` (`check`).

- `wheel`: a release's wheel fetched and its modules loaded, with stand-ins (`placeholders`: the
  import hook 0.5.23's are loaded through);
- `stand_ins`: SGLang's ``Req`` and memory pools, per release; `loop` its event loop (what every
  release does alike) and `release_loops` each release's part of it;
- the four parts of the check: `queues` (a), `batches` (b) on `cases`' run configs, `replay` (c)
  against `tree_serving` (SGLang's tree serving one request at a time), `eviction` (d);
- `checkpoint_fields`: node by node after 0.5.23's checkpoint insert
  (``python -m experiments.validation.sglang.checkpoint_fields``); `whole_trace`: the whole
  Mooncake trace through 0.5.23's tree (``python -m experiments.validation.sglang.whole_trace``).
"""
