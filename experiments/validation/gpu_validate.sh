#!/usr/bin/env bash
# GPU validation in one command, from a fresh clone on a bare CUDA machine, in at most 8 minutes:
# every step has a time cap (they add up to 470 s) and the script skips a step that would not
# finish inside DEADLINE (default 480 s); a step that fails or runs out of time is recorded as
# such and the others still run. One JSON report, gpu_validate.json, and one log.
#   0. what the machine lacks: the pure-Python wheels of `make gpu-wheels` (.whl/, carried there)
#      installed into a temporary folder when an import fails (../shared/GPU.md);
#   1. experiments.validation.gpu_engine on a Llama-2-7B-shaped random model in bf16: the copy
#      bandwidth and the byte floor; the decode step at 32 x (2,048 shared + 64 own), eager and
#      CUDA graphs, plain and cascade, and with scheduler.overlap=true (the next step launched
#      before the last one's tokens are read), as steps.jsonl records it (its GPU time by CUDA
#      events and its host time beside it), beside its floor; kernels a decode step launches;
#      synchronizing calls in the forward; the KV pool; tree-of-thought (12 problems) and
#      few-shot radix+lpm against none+fcfs (graphs, with overlap, eager and cascade);
#   2. the engine's tests and the kernel test grid compiled on the GPU (two pytest processes side
#      by side: correctness only, nothing timed);
#   3. radix_kernels.gpu_check: every kernel against torch in fp32/fp16/bf16 at model shapes,
#      timed; the layer kernels; a sweep of the prefill kernel's launch settings beside SDPA;
#   4. experiments.validation.sim_vs_engine: the simulator calibrated on this GPU's engine,
#      predicting its tree-of-thought and chat runs (one round).
# WORK (default outputs/gpu_validate) holds everything; COLLECT=DIR copies the report, the log
# and the step files (at most 8 files) there.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
WORK=${WORK:-${OUT:-outputs/gpu_validate}}
DEADLINE=${DEADLINE:-480}
mkdir -p "$WORK"
exec > >(tee "$WORK/gpu_validate.log") 2>&1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! $PY -c "import hydra, omegaconf, simpy, fastapi, uvicorn" 2>/dev/null; then
  echo "== installing the wheels in .whl/ into /tmp/gpu_site (make gpu-wheels made them)"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_site .whl/*.whl || echo "   pip install failed"
  export PYTHONPATH="/tmp/gpu_site:$PYTHONPATH"
fi
status=0
: > "$WORK/steps.tsv"
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$WORK/steps.tsv"; }
step() {  # step NAME CAP_SECONDS COMMAND...: run it unless past the deadline, record its status
  local name=$1 cap=$2; shift 2
  if [ $((SECONDS + cap)) -gt "$DEADLINE" ]; then
    echo "== $name skipped: ${cap}s would pass the ${DEADLINE}s deadline"; record "$name" skipped 0
    return
  fi
  echo "== $name (at most ${cap}s)"
  local started=$SECONDS rc=0
  timeout "$cap" "$@" || rc=$?
  [ $rc -ne 0 ] && { echo "   failed: $rc"; status=1; }
  record "$name" "$rc" "$((SECONDS - started))"
}
PRESSURE=test_hits_eviction_and_retraction_each_keep_greedy_tokens_equal_to_hf
ENGINE_TESTS=(tests/test_engine_generate.py tests/test_cascade.py tests/test_engine_hot_path.py
              tests/test_cuda_graph.py "tests/test_engine_model.py::$PRESSURE"
              tests/test_engine_overlap.py)
KERNEL_TESTS=(tests/test_kernels.py tests/test_layer_kernels.py)

step gpu_engine 200 $PY -m experiments.validation.gpu_engine --out "$WORK/gpu_engine.json" \
  --runs-dir "$WORK/runs"
# the two test runs side by side (correctness only: nothing here is timed), each capped
if [ $((SECONDS + 120)) -le "$DEADLINE" ]; then
  echo "== tests (at most 120s): ${KERNEL_TESTS[*]} | ${ENGINE_TESTS[*]}"
  started=$SECONDS
  timeout 120 $PY -m pytest -q -p no:cacheprovider "${KERNEL_TESTS[@]}" \
    --junitxml "$WORK/kernel_tests.xml" > "$WORK/kernel_tests.log" 2>&1 & k=$!
  timeout 120 $PY -m pytest -q -p no:cacheprovider "${ENGINE_TESTS[@]}" \
    --junitxml "$WORK/engine_tests.xml" > "$WORK/engine_tests.log" 2>&1 & e=$!
  rk=0; re=0; wait $k || rk=$?; wait $e || re=$?
  tail -n 3 "$WORK/kernel_tests.log" "$WORK/engine_tests.log"
  [ $rk -ne 0 ] || [ $re -ne 0 ] && status=1
  record kernel_tests $rk $((SECONDS - started)); record engine_tests $re $((SECONDS - started))
else
  record kernel_tests skipped 0; record engine_tests skipped 0
fi
step kernels_check 75 $PY -m radix_kernels.gpu_check --out "$WORK/kernels.json" --max-s 60
step sim_vs_engine 75 $PY -m experiments.validation.sim_vs_engine --out "$WORK/sim_vs_engine" \
  --rounds 1 model=llama2_7b hardware=h200 engine.device=cuda engine.dtype=bfloat16 \
  engine.attention=triton workload.vocab_size=32000

$PY - "$WORK" <<'PY'
import json, pathlib, sys
import xml.etree.ElementTree as ET
out = pathlib.Path(sys.argv[1])
doc = {"steps": {}}
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, seconds = line.split("\t")
    doc["steps"][name] = {"exit_code": rc, "seconds": int(seconds)}
for name in ("kernel_tests", "engine_tests"):
    p = out / f"{name}.xml"
    if p.is_file():
        suite = ET.parse(p).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        doc[name] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        doc[name]["failed"] = [f"{c.get('classname')}::{c.get('name')}"
                               for c in suite.iter("testcase")
                               if c.find("failure") is not None or c.find("error") is not None]
for name in ("gpu_engine.json", "kernels.json", "sim_vs_engine/sim_vs_engine.json"):
    p = out / name
    doc[name] = json.loads(p.read_text()) if p.is_file() else None
runs = (doc["gpu_engine.json"] or {}).get("runs") or {}
for key, value in (runs.get("ratios") or {}).items():
    print(f"{key}: {value:.3f}" if value is not None else f"{key}: -")
for name in ("shape_plain_eager", "shape_plain_graph", "shape_plain_graph_overlap",
             "shape_cascade_eager", "shape_cascade_graph"):
    r = runs.get(name) or {}
    if r.get("decode_step_s"):
        print(f"{name}: decode step {r['decode_step_s'] * 1e3:.2f} ms (GPU "
              f"{(r.get('decode_gpu_s') or 0) * 1e3:.2f} ms, host "
              f"{(r.get('decode_host_s') or 0) * 1e3:.2f} ms), byte floor "
              f"{(r.get('byte_floor_s') or 0) * 1e3:.2f} ms ({r.get('over_floor') or 0:.2f}x)")
(out / "gpu_validate.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
print(f"wrote {out / 'gpu_validate.json'}")
PY
if [ -n "${COLLECT:-}" ]; then  # the files a GPU session brings back (at most 8)
  mkdir -p "$COLLECT"
  cp "$WORK/gpu_validate.json" "$WORK/gpu_validate.log" "$COLLECT/" 2>/dev/null
  cat "$WORK"/kernel_tests.log "$WORK"/engine_tests.log > "$COLLECT/tests.log" 2>/dev/null
  tar czf "$COLLECT/runs.tar.gz" -C "$WORK" runs sim_vs_engine 2>/dev/null
fi
echo "gpu_validate: ${SECONDS}s"
exit $status
