#!/usr/bin/env bash
# GPU validation in one go (a CUDA machine; under 8 minutes on an H200). Writes JSON into $OUT
# (default outputs/gpu_validate) and a combined gpu_validate.json:
#   1. kernels compiled and checked against torch in fp32/fp16/bf16 at model shapes, timed, with
#      achieved TFLOP/s and HBM GB/s (radix_kernels.gpu_check);
#   2. the kernel test grid compiled (TRITON_INTERPRET=0);
#   3. the engine on a Llama-2-7B-shaped random model in bf16 with Triton attention on
#      tree-of-thought, radix+lpm against no cache (throughput ratio, hit rate);
#   4. experiments/sim_vs_engine.py on the same model and device: calibration of the fitted cost
#      model (cost_model.yaml) interleaved with engine runs of held-back work, and the simulator's
#      error against them.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-outputs/gpu_validate}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
status=0
step() { echo "== $1"; shift; timeout "$@" || { echo "   failed: $?"; status=1; }; }

step "kernels: correctness and timings" 240 $PY -m radix_kernels.gpu_check --out "$OUT/kernels.json"
step "kernels: test grid compiled" 180 $PY -m pytest -q tests/test_kernels.py -p no:cacheprovider
for cache in radix none; do
  sched=$([ $cache = radix ] && echo lpm || echo fcfs)
  step "engine: llama2_7b-shaped bf16, tree_of_thought, cache=$cache" 150 \
    $PY -m testbed.run backend=engine model=llama2_7b hardware=h200 device=cuda dtype=bfloat16 \
      attention=triton workload=tree_of_thought workload.num_problems=16 cache=$cache \
      scheduler=$sched progress=false hydra.run.dir="$OUT/engine_$cache"
done
step "calibration and simulator-vs-engine: llama2_7b-shaped bf16 on this GPU" 200 \
  $PY experiments/sim_vs_engine.py --out "$OUT/sim_vs_engine" --rounds 3 model=llama2_7b \
    hardware=h200 device=cuda dtype=bfloat16 attention=triton workload.vocab_size=32000

$PY - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
doc = {}
for name in ("kernels.json", "engine_radix/summary.json", "engine_none/summary.json",
             "sim_vs_engine/calibration/calibration.json", "sim_vs_engine/sim_vs_engine.json"):
    p = out / name
    doc[name] = json.loads(p.read_text()) if p.is_file() else None
r, n = doc["engine_radix/summary.json"], doc["engine_none/summary.json"]
if r and n:
    doc["engine_speedup"] = r["throughput_req_s"] / n["throughput_req_s"]
    print(f"engine on GPU: radix+lpm / none+fcfs throughput = {doc['engine_speedup']:.2f}x, "
          f"hit rate {r['hit_rate']:.3f}")
(out / "gpu_validate.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
print(f"wrote {out / 'gpu_validate.json'}")
PY
exit $status
