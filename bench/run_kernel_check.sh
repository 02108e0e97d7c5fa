#!/usr/bin/env bash
# One device call for the CUDA kernels: build _core (sm_90), kernel tests, a small
# compute-sanitizer memcheck pass, and the prefill / decode benchmarks. Logs under $OUT.
#   OUT=/tmp/kcheck bench/run_kernel_check.sh     (STAGES="build test memcheck bench w1")
# Needs python3 with torch, nanobind, cmake, ninja, pytest and a CUDA toolkit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kernel_check}
STAGES=${STAGES:-build test memcheck bench w1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
COMMIT=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
summary "commit $COMMIT  $(date -u +%FT%TZ)  $(nvidia-smi --query-gpu=name,driver_version \
  --format=csv,noheader | head -1)"

if [[ $STAGES == *build* ]]; then
  start=$SECONDS
  if CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_FLAGS=-Xptxas=-v" \
    PYTHON=python3 PAGEDD_CUDA=ON scripts/dev_build.sh >"$OUT/build.log" 2>&1; then
    summary "build ok ($((SECONDS - start)) s)"
  else
    summary "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1
  fi
  grep -A2 -E "paged_prefill_(sm90_)?kernel|paged_decode_tc_kernel" "$OUT/build.log" \
    | grep -E "registers|spill" | sort | uniq -c | tee -a "$OUT/summary.txt"
  grep -c "C7520" "$OUT/build.log" | sed 's/^/wgmma serialization warnings (C7520): /' \
    | tee -a "$OUT/summary.txt"
fi

if [[ $STAGES == *test* ]]; then
  start=$SECONDS
  timeout 300 python3 -m pytest -q --maxfail=20 -p no:cacheprovider tests/gpu >"$OUT/tests.log" 2>&1
  summary "tests rc=$? ($((SECONDS - start)) s): $(tail -1 "$OUT/tests.log")"
  grep -E "^FAILED|^ERROR|Error|assert" "$OUT/tests.log" | head -20
fi

if [[ $STAGES == *memcheck* ]]; then
  start=$SECONDS
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_prefill_kernel.py \
    tests/gpu/test_kernels.py -k "(reference and q16kv4 and 16-128) or mixed_step or odd_group \
    or bad_metadata or reshape_and_cache or copy_blocks or (tile and q16kv4 and 128-) \
    or single_partition or decode_step" >"$OUT/memcheck.log" 2>&1
  summary "memcheck rc=$? ($((SECONDS - start)) s): $(grep -E "ERROR SUMMARY" "$OUT/memcheck.log" \
    | tail -1) / $(grep -E "passed|failed" "$OUT/memcheck.log" | tail -1)"
  start=$SECONDS  # the tensor-core decode kernel: bf16 and fp8, one and several partitions
  timeout 180 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_tc_kernel.py \
    -k "(reference and q16kv4 and 8-128 and dtype1) or empty_sequence or generous" \
    >"$OUT/memcheck_tc.log" 2>&1
  summary "memcheck decode_tc rc=$? ($((SECONDS - start)) s): $(grep -E "ERROR SUMMARY" \
    "$OUT/memcheck_tc.log" | tail -1) / $(grep -E "passed|failed" "$OUT/memcheck_tc.log" | tail -1)"
fi

if [[ $STAGES == *bench* ]]; then
  timeout 240 python3 bench/bench_prefill.py --commit "$COMMIT" --out "$OUT/prefill.json" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
if [[ $STAGES == *w1* ]]; then  # W1 offline, Llama-3-8B shape, dummy weights (bench/README.md)
  start=$SECONDS
  timeout 200 python3 bench/throughput.py --model-config llama3-8b --no-progress \
    --out "$OUT/w1.json" >"$OUT/w1.log" 2>&1
  summary "w1 rc=$? ($((SECONDS - start)) s):"; tail -8 "$OUT/w1.log" | tee -a "$OUT/summary.txt"
fi
cat "$OUT/summary.txt"
