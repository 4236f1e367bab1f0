#!/usr/bin/env bash
# GPU validation in one command, one JSON report ($OUT/gpu_validate.json; OUT defaults to
# outputs/gpu_validate), in under 8 minutes: every step has a time cap and the caps add up to
# 465 s; a step that fails or runs out of time is recorded as such and the others still run.
#   1. kernels compiled and checked against torch in fp32/fp16/bf16 at model shapes, timed
#      (radix_kernels.gpu_check), and the kernel test grid compiled (TRITON_INTERPRET=0);
#   2. the engine's tests compiled on the GPU: generating traces (max_new_tokens) and checkpoints
#      by path equal HF generate; hits, eviction and retraction with Triton and cascade
#      attention; cascade decode equals plain decode; no device read in the layer loop;
#   3. experiments.validation.gpu_engine on a Llama-2-7B-shaped random model in bf16: the KV pool
#      sized from free memory, synchronizing calls in the forward (CUDA's sync debug mode), and
#      cascade against plain decode on 32 requests sharing a 2,048-token prompt;
#   4. the engine on tree_of_thought with that model: radix+lpm, radix+lpm with cascade, and no
#      cache + fcfs (throughput ratios, hit rate; the KV pool from free memory).
# WITH_SIM_VS_ENGINE=1 adds experiments.validation.sim_vs_engine (calibration and the simulator's
# error against the engine on this GPU; about 3 more minutes).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
OUT=${OUT:-outputs/gpu_validate}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
status=0
: > "$OUT/steps.tsv"
step() {  # step NAME CAP_SECONDS COMMAND...: run it, record "name<TAB>exit code<TAB>seconds"
  local name=$1 cap=$2; shift 2
  echo "== $name (at most ${cap}s)"
  local started=$SECONDS rc=0
  timeout "$cap" "$@" || rc=$?
  [ $rc -ne 0 ] && { echo "   failed: $rc"; status=1; }
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - started))" >> "$OUT/steps.tsv"
}
PRESSURE=test_hits_eviction_and_retraction_each_keep_greedy_tokens_equal_to_hf
ENGINE_TESTS=(tests/test_engine_generate.py tests/test_cascade.py tests/test_engine_hot_path.py
              "tests/test_engine_model.py::$PRESSURE")

step kernels_check 90 $PY -m radix_kernels.gpu_check --out "$OUT/kernels.json"
step kernel_tests 80 $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py \
  --junitxml "$OUT/kernel_tests.xml"
step engine_tests 90 $PY -m pytest -q -p no:cacheprovider "${ENGINE_TESTS[@]}" \
  --junitxml "$OUT/engine_tests.xml"
step engine_check 60 $PY -m experiments.validation.gpu_engine --out "$OUT/engine_check.json"
for variant in radix radix_cascade none; do
  case $variant in
    radix) extra=(cache=radix scheduler=lpm attention=triton) ;;
    radix_cascade) extra=(cache=radix scheduler=lpm attention=cascade_triton) ;;
    none) extra=(cache=none scheduler=fcfs attention=triton) ;;
  esac
  cap=$([ $variant = radix ] && echo 55 || echo 45)  # the first compiles the kernels' configs
  step "engine_$variant" "$cap" $PY -m testbed.run backend=engine model=llama2_7b hardware=h200 \
    device=cuda dtype=bfloat16 workload=tree_of_thought workload.num_problems=12 \
    "${extra[@]}" progress=false hydra.run.dir="$OUT/engine_$variant"
done
if [ "${WITH_SIM_VS_ENGINE:-0}" = 1 ]; then
  step sim_vs_engine 200 $PY -m experiments.validation.sim_vs_engine --out "$OUT/sim_vs_engine" \
    --rounds 3 model=llama2_7b hardware=h200 device=cuda dtype=bfloat16 attention=triton \
    workload.vocab_size=32000
fi

$PY - "$OUT" <<'PY'
import json, pathlib, sys
import xml.etree.ElementTree as ET
out = pathlib.Path(sys.argv[1])
doc = {"steps": {}}
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, seconds = line.split("\t")
    doc["steps"][name] = {"exit_code": int(rc), "seconds": int(seconds)}
for name in ("kernel_tests", "engine_tests"):
    p = out / f"{name}.xml"
    if p.is_file():
        suite = ET.parse(p).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        doc[name] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        doc[name]["failed"] = [f"{c.get('classname')}::{c.get('name')}"
                               for c in suite.iter("testcase")
                               if c.find("failure") is not None or c.find("error") is not None]
for name in ("kernels.json", "engine_check.json", "engine_radix/summary.json",
             "engine_radix_cascade/summary.json", "engine_none/summary.json",
             "sim_vs_engine/calibration/calibration.json", "sim_vs_engine/sim_vs_engine.json"):
    p = out / name
    doc[name] = json.loads(p.read_text()) if p.is_file() else None
r, c, n = (doc[f"engine_{v}/summary.json"] for v in ("radix", "radix_cascade", "none"))
if r and n:
    doc["engine_speedup"] = r["throughput_req_s"] / n["throughput_req_s"]
    print(f"engine on GPU: radix+lpm / none+fcfs throughput = {doc['engine_speedup']:.2f}x, "
          f"hit rate {r['hit_rate']:.3f}, KV pool {r['kv_capacity_tokens']} tokens")
if c and n:
    doc["engine_speedup_cascade"] = c["throughput_req_s"] / n["throughput_req_s"]
    print(f"engine on GPU with cascade: {doc['engine_speedup_cascade']:.2f}x")
(out / "gpu_validate.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
print(f"wrote {out / 'gpu_validate.json'}")
PY
exit $status
