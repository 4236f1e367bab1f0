#!/usr/bin/env bash
# GPU validation in one command, from a fresh clone on a bare CUDA machine, in at most 8 minutes:
# every step has a time cap (they add up to 470 s) and the script skips a step that would not
# finish inside DEADLINE (default 480 s); a step that fails or runs out of time is recorded as
# such and the others still run. One JSON report, gpu_validate.json, with issue 61's acceptance
# points measured against their bounds, and one log.
#   0. what the machine lacks: the pure-Python wheels `make gpu-wheels` puts in .whl/ (carry it
#      there), installed into a temporary folder when an import fails;
#   1. experiments.validation.gpu_engine on a Llama-2-7B-shaped random model in bf16: the copy
#      bandwidth and the byte floor; the decode step at 32 x (2,048 shared + 64 own), eager and
#      CUDA graphs, plain and cascade, with scheduler.overlap=true, and steps of 8 and 16
#      requests, each beside its floor (GPU time by CUDA events, host time beside it); kernels a
#      decode step launches, by name; synchronizing calls in the forward; the KV pool; the tier
#      copies beside the host link's measured bandwidth; tree-of-thought (12 problems) radix+lpm
#      against none+fcfs (graphs, overlap, eager, cascade with its rule and with every node),
#      chat and few-shot plain against cascade; every run's decode steps by batch size;
#   2. the engine's tests and the kernel test grids compiled on the GPU, bf16 included (two
#      pytest processes side by side: correctness only, nothing timed);
#   3. radix_kernels.gpu_check: every kernel against torch in fp32/fp16/bf16 at model shapes,
#      timed; the layer kernels; the cascade kernel; the prefill kernel's settings and sources
#      beside SDPA at 4 x 2,048 (Llama-2-7B heads, bf16);
#   4. experiments.validation.sim_vs_engine: the simulator calibrated on this GPU's engine,
#      predicting its tree-of-thought, chat and few-shot runs (one round).
# WORK (default outputs/gpu_validate; $OUT when set) holds everything; COLLECT=DIR copies the
# report, the log, the tests' log and the run files there (4 files). --dry-run prints the plan
# (each step's cap and command) and runs nothing.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
WORK=${WORK:-${OUT:-outputs/gpu_validate}}
DEADLINE=${DEADLINE:-480}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PRESSURE=test_hits_eviction_and_retraction_each_keep_greedy_tokens_equal_to_hf
ENGINE_TESTS=(tests/test_engine_generate.py tests/test_cascade.py tests/test_engine_hot_path.py
              tests/test_cuda_graph.py "tests/test_engine_model.py::$PRESSURE"
              tests/test_engine_overlap.py tests/test_cascade_rule.py)
KERNEL_TESTS=(tests/test_kernels.py tests/test_layer_kernels.py tests/test_cascade_kernel.py
              tests/test_extend_kernel.py)
GPU_ENGINE=($PY -m experiments.validation.gpu_engine --out "$WORK/gpu_engine.json"
            --runs-dir "$WORK/runs")
KERNELS_CHECK=($PY -m radix_kernels.gpu_check --out "$WORK/kernels.json" --max-s 50)
SIM_VS_ENGINE=($PY -m experiments.validation.sim_vs_engine --out "$WORK/sim_vs_engine"
               --rounds 1 --few-shot model=llama2_7b hardware=h200 engine.device=cuda
               engine.dtype=bfloat16 engine.attention=triton workload.vocab_size=32000)
COLLECTED=(gpu_validate.json gpu_validate.log tests.log runs.tar.gz)
if [ "$DRY" = 1 ]; then  # the plan: NAME<TAB>CAP<TAB>COMMAND, then the files collected
  printf 'step\tgpu_engine\t240\t%s\n' "${GPU_ENGINE[*]}"
  printf 'step\ttests\t100\t%s\n' "pytest ${KERNEL_TESTS[*]} | pytest ${ENGINE_TESTS[*]}"
  printf 'step\tkernels_check\t60\t%s\n' "${KERNELS_CHECK[*]}"
  printf 'step\tsim_vs_engine\t70\t%s\n' "${SIM_VS_ENGINE[*]}"
  printf 'deadline\t%s\n' "$DEADLINE"
  printf 'collect\t%s\n' "${COLLECTED[*]}"
  exit 0
fi
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

step gpu_engine 240 "${GPU_ENGINE[@]}"
# the two test runs side by side (correctness only: nothing here is timed), each capped
if [ $((SECONDS + 100)) -le "$DEADLINE" ]; then
  echo "== tests (at most 100s): ${KERNEL_TESTS[*]} | ${ENGINE_TESTS[*]}"
  started=$SECONDS
  timeout 100 $PY -m pytest -q -p no:cacheprovider "${KERNEL_TESTS[@]}" \
    --junitxml "$WORK/kernel_tests.xml" > "$WORK/kernel_tests.log" 2>&1 & k=$!
  timeout 100 $PY -m pytest -q -p no:cacheprovider "${ENGINE_TESTS[@]}" \
    --junitxml "$WORK/engine_tests.xml" > "$WORK/engine_tests.log" 2>&1 & e=$!
  rk=0; re=0; wait $k || rk=$?; wait $e || re=$?
  tail -n 3 "$WORK/kernel_tests.log" "$WORK/engine_tests.log"
  [ $rk -ne 0 ] || [ $re -ne 0 ] && status=1
  record kernel_tests $rk $((SECONDS - started)); record engine_tests $re $((SECONDS - started))
else
  record kernel_tests skipped 0; record engine_tests skipped 0
fi
step kernels_check 60 "${KERNELS_CHECK[@]}"
step sim_vs_engine 70 "${SIM_VS_ENGINE[@]}"

$PY -m experiments.validation.gpu_report "$WORK" || status=1
if [ -n "${COLLECT:-}" ]; then  # the files a GPU session brings back (COLLECTED: 4)
  mkdir -p "$COLLECT"
  cp "$WORK/gpu_validate.json" "$WORK/gpu_validate.log" "$COLLECT/" 2>/dev/null
  cat "$WORK"/kernel_tests.log "$WORK"/engine_tests.log > "$COLLECT/tests.log" 2>/dev/null
  tar czf "$COLLECT/runs.tar.gz" -C "$WORK" runs sim_vs_engine 2>/dev/null
fi
echo "gpu_validate: ${SECONDS}s"
exit $status
