#!/usr/bin/env bash
# Device calls for 4-bit weights (issue 45): build _core (sm_90) if needed, the W4A16 kernel
# and engine tests, the kernel micro-benchmark with its tile sweep, then W1 + TPOT (batch 1,
# and 64 for the MoE shapes) with dummy weights: Llama-3-8B bf16 vs int4 group 128 (GPTQ
# layout), Qwen3-30B-A3B bf16 vs int4 experts, gpt-oss-20b's expert shape MXFP4.
#   OUT=/tmp/int4 STAGES="build test gemm" bash bench/run_int4_check.sh      (~10 min)
#   OUT=/tmp/int4 STAGES="llama" bash bench/run_int4_check.sh                (~8 min)
#   OUT=/tmp/int4 STAGES="moe" bash bench/run_int4_check.sh                  (~10 min)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/int4_check}
STAGES=${STAGES:-build test gemm}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
summary "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)  $(date -u +%FT%TZ)"

if [[ $STAGES == *build* ]] && ! python3 -c "from pydaemon import ops; assert ops.is_available()" 2>/dev/null; then
  start=$SECONDS
  if CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90" PYTHON=python3 PAGEDD_CUDA=ON \
    scripts/dev_build.sh >"$OUT/build.log" 2>&1; then
    summary "build ok ($((SECONDS - start)) s)"
  else
    summary "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1
  fi
fi
if [[ $STAGES == *test* ]]; then
  start=$SECONDS
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_w4a16_gpu.py \
    >"$OUT/tests.log" 2>&1
  summary "tests rc=$? ($((SECONDS - start)) s): $(tail -1 "$OUT/tests.log")"
  grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -20
fi
if [[ $STAGES == *gemm* ]]; then
  timeout 300 python3 bench/bench_int4_gemm.py --sweep --moe --out "$OUT/int4_gemm.json" \
    2>&1 | tee "$OUT/gemm.log" | grep -v "sweep M"
  summary "gemm: $OUT/int4_gemm.json"
fi
w1() {  # name, model config, quantization ("" = bf16), extra flags
  local start=$SECONDS q=()
  [[ -n $3 ]] && q=(--quantization "$3")
  timeout 280 python3 bench/throughput.py --model-config "$2" --no-progress "${q[@]}" $4 \
    --out "$OUT/$1.json" >"$OUT/$1.log" 2>&1
  summary "$1 rc=$? ($((SECONDS - start)) s):"; tail -6 "$OUT/$1.log" | tee -a "$OUT/summary.txt"
}
if [[ $STAGES == *llama* ]]; then
  w1 w1_llama_bf16 llama3-8b "" "--tpot-batch1 3"
  w1 w1_llama_int4 llama3-8b gptq "--tpot-batch1 3"
fi
if [[ $STAGES == *moe* ]]; then
  w1 w1_qwen3_bf16 qwen3-30b-a3b "" "--tpot-batch1 3 --tpot-batch 2"
  w1 w1_qwen3_int4 qwen3-30b-a3b gptq "--tpot-batch1 3 --tpot-batch 2"
  w1 w1_gptoss_mxfp4 gpt-oss-20b-shape mxfp4 "--tpot-batch1 3 --tpot-batch 2"
fi
cat "$OUT/summary.txt"
