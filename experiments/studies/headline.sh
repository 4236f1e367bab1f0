#!/usr/bin/env bash
# The RadixAttention headline in the simulator: Llama-2-7B on an A10G, offline batches of programs.
#   bash experiments/studies/headline.sh    # from anywhere; it runs from the repository root
# Prints, per workload, radix+lpm vs no cache+fcfs: hit rate (and the ideal), makespan, speedup.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
out=${OUT:-outputs/headline}
printf "%-17s %9s %9s %12s %12s %8s\n" workload hit ideal radix_s none_s speedup
for w in ${WORKLOADS:-few_shot tree_of_thought self_consistency chat chat_long}; do
  common="backend=sim model=llama2_7b hardware=a10g workload=$w seed=0 progress=false"
  $PY -m testbed.run $common cache=radix scheduler=lpm hydra.run.dir=$out/$w-radix >/dev/null
  $PY -m testbed.run $common cache=none scheduler=fcfs hydra.run.dir=$out/$w-none >/dev/null
  $PY - "$out/$w-radix/summary.json" "$out/$w-none/summary.json" "$w" <<'PY'
import json, sys
r, n = (json.load(open(p)) for p in sys.argv[1:3])
print(f"{sys.argv[3]:<17} {r['hit_rate']:9.3f} {r['ideal_hit_rate']:9.3f} {r['makespan_s']:12.1f} "
      f"{n['makespan_s']:12.1f} {n['makespan_s'] / r['makespan_s']:7.2f}x")
PY
done
