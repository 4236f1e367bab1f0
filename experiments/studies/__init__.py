"""The studies: each runs a grid of configs and writes its table and figure (docs/results/<study>/).

- `eviction`: hit rate against cache capacity per eviction policy (the grid of
  conf/experiment/eviction.yaml), with the oracle and the unlimited-cache ideal.
- `learned_vs_oracle`: what the learned eviction policy predicts against what the oracle knows.
- `tiers`: what a host-DRAM (and SSD) tier under the GPU buys on the Mooncake trace.
- `routing`: every router policy on N data-parallel replicas (``workload=chat_tenants``, Mooncake).
- `fairness`: LPM starves cache-cold requests; ``scheduler.lpm_aging`` bounds their wait.
- `beyond_prefix`: chunk reuse and semantic matching, cost in the simulator, quality in the engine.
- ``headline.sh``: the RadixAttention headline (radix+lpm against no cache+fcfs), a shell script.
"""
