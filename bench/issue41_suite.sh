#!/usr/bin/env bash
# Issue 41's GPU measurements (FP8 MoE at the weight floor, Mixtral decode, controlled MoE
# routing against vLLM, dense FP8 decode, W1 profile, short prefill), one device call per STEPS
# group, each under 6 minutes on one H200 (BUDGET_S caps a call; a step that would start past
# it is skipped, the summary always prints). From a built checkout (scripts/dev_build.sh with
# the CUDA kernels):
#
# In order of what they decide (times are estimates, not measured: BUDGET_S guards them):
#   bash bench/issue41_suite.sh OUT                        # STEPS="check layer"   (~4.5 min)
#   STEPS="qwen3 mixtral" bash bench/issue41_suite.sh OUT  # pagedd, controlled routing (~5.5 min)
#   STEPS=vllm BUDGET_S=420 VLLM_SITE=DIR bash bench/issue41_suite.sh OUT  # vLLM Qwen3 (~6 min)
#   STEPS="layer_ab prefill" bash bench/issue41_suite.sh OUT  # layer A/B rows, short prefill (~5 min)
#   STEPS=dense bash bench/issue41_suite.sh OUT            # FP8 GEMV / swap A/B (~3.5 min)
#   STEPS=vllm_mixtral BUDGET_S=420 VLLM_SITE=DIR bash bench/issue41_suite.sh OUT  # (~6 min)
#   STEPS=profile bash bench/issue41_suite.sh OUT          # W1 + MoE decode-step profiles (~5 min)
#
# The groups:
#   check:   GPU tests of the FP8 MoE decode kernels and the FP8 Triton path
#            (tests/gpu/test_moe_decode_fp8_gpu.py, test_moe_triton_fp8_gpu.py), the bf16 Triton
#            path (spread tiles) and the grouped FP8 path
#   layer:   bench_moe.py, the MoE layer alone per token count (CUDA graphs, uniform routing,
#            experts hit and the weight floor): Qwen3-30B-A3B and Mixtral-8x7B, bf16 and FP8
#   layer_ab: the same for the A/B rows: at 1-4 tokens the decode kernels (bf16 and FP8)
#            against the Triton path with spread tiles (--decode-max-slots 0); FP8 128x128
#            blocks; FP8 on the grouped path (the path before, no decode kernels); FP8 w8a8 at
#            8 and 64 tokens (--fp8-w8a16-max-tokens 0)
#   qwen3, mixtral: pagedd W1 + TPOT at batch 1 and 64 with the routers re-drawn from
#            ROUTER_SEED (bench/moe_routing.py: experts touched per step and the per-expert
#            histogram in each JSON), bf16 and FP8 weights + FP8 KV
#   vllm, vllm_mixtral: vLLM 0.26 on the same runs, the same router draw (a vLLM plugin)
#   dense:   Llama-3-8B FP8 weights + FP8 KV, W1 + TPOT at batch 1: torch._scaled_mm as in the
#            code against ops.fp8_gemv (--fp8-gemv-max-tokens 16) and the swapped operands
#            (--fp8-swap-ab-max-tokens 16); W1 bf16 for calibration
#   prefill: bench_prefill.py at short prompts, MHA 32/32 and GQA 32/8, every backend
#   profile: W1 bf16 under torch.profiler (GPU time by kernel kind, idle), a decode step of
#            Llama-3-8B at batch 256, of Mixtral-8x7B at batch 1 and of Qwen3-30B-A3B bf16 /
#            FP8 at batch 64 and 256
#
# Environment: PYTHON (python3), STEPS, BUDGET_S (340; the vllm groups want 420: two vLLM
# start-ups of ~2 min), ROUTER_SEED (0), VLLM_SITE (vLLM's install dir, for the vllm groups),
# TPOT_RUNS (3). Each step is its own process under
# `timeout`; its log and JSON land in OUT; bench/issue41_summary.py prints the table at the end.
set -uo pipefail
out=$(realpath -m "${1:-${OUT:-/tmp/issue41}}")
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
mkdir -p "$out"
py=${PYTHON:-python3}
budget=${BUDGET_S:-340}
seed=${ROUTER_SEED:-0}
runs=${TPOT_RUNS:-3}
t_all=$(date +%s)
source bench/steps.sh  # step NAME TIMEOUT_S ENV... -- COMMAND...: one process, its log in OUT/NAME.log
extra=${PYTHONPATH:+:$PYTHONPATH}
pagedd=(PYTHONPATH="$repo$extra")
steps=" ${STEPS:-check layer} "
has() { [[ $steps == *" $1 "* ]]; }

models=$(mktemp -d)
for m in qwen3-30b-a3b mixtral-8x7b llama3-8b; do
  PYTHONPATH="$repo$extra" "$py" bench/throughput_models.py "$m" "$models/$m" >/dev/null
done
engine() {  # MODEL: throughput.py's W1 + TPOT at batch 1 and 64, controlled routing
  echo bench/throughput.py --model "$models/$1" --load-format dummy --device cuda --no-progress \
    --workload w1 --tpot-batch1 "$runs" --tpot-batch "$runs" --tpot-batch-size 64 \
    --moe-router-seed "$seed"
}
fp8=(--quantization fp8 --kv-cache-dtype fp8)

if has check; then
  step check 200 "${pagedd[@]}" -- "$py" -m pytest -q -p no:cacheprovider \
    tests/gpu/test_moe_decode_fp8_gpu.py tests/gpu/test_moe_triton_fp8_gpu.py \
    tests/gpu/test_moe_triton_gpu.py \
    "tests/gpu/test_moe_gpu.py::test_fp8_layer_against_emulated"
  tail -n 1 "$out/check.log" >&2
fi
if has layer; then  # the most telling rows first: a cut budget drops the last ones
  q=(bench/bench_moe.py --shape qwen3-30b-a3b --tokens 1,8,64,256,1024,4096 --iters 30)
  mx=(bench/bench_moe.py --shape mixtral-8x7b --iters 30)
  step layer_qwen3_bf16 60 "${pagedd[@]}" -- "$py" "${q[@]}" --out "$out/layer_qwen3_bf16.json"
  step layer_qwen3_fp8 60 "${pagedd[@]}" -- "$py" "${q[@]}" --quantization fp8 \
    --out "$out/layer_qwen3_fp8.json"
  step layer_mixtral_bf16 60 "${pagedd[@]}" -- "$py" "${mx[@]}" --tokens 1,2,4,8,64,1024 \
    --out "$out/layer_mixtral_bf16.json"
  step layer_mixtral_fp8 60 "${pagedd[@]}" -- "$py" "${mx[@]}" --tokens 1,2,4,8,64,1024 \
    --quantization fp8 --out "$out/layer_mixtral_fp8.json"
fi
if has layer_ab; then  # the A/B rows of the layer: decode kernels vs Triton, blocks, before
  q=(bench/bench_moe.py --shape qwen3-30b-a3b --tokens 1,8,64,256,1024,4096 --iters 30)
  mx=(bench/bench_moe.py --shape mixtral-8x7b --iters 30)
  step layer_mixtral_bf16_triton 50 "${pagedd[@]}" -- "$py" "${mx[@]}" --tokens 1,2,4 \
    --decode-max-slots 0 --out "$out/layer_mixtral_bf16_triton.json"
  step layer_mixtral_fp8_triton 60 "${pagedd[@]}" -- "$py" "${mx[@]}" --tokens 1,2,4 \
    --quantization fp8 --decode-max-slots 0 --out "$out/layer_mixtral_fp8_triton.json"
  step layer_qwen3_fp8_triton 50 "${pagedd[@]}" -- "$py" bench/bench_moe.py \
    --shape qwen3-30b-a3b --tokens 1 --iters 30 --quantization fp8 --decode-max-slots 0 \
    --out "$out/layer_qwen3_fp8_triton.json"
  step layer_qwen3_fp8_block 60 "${pagedd[@]}" -- "$py" "${q[@]}" --quantization fp8-block \
    --out "$out/layer_qwen3_fp8_block.json"
  step layer_qwen3_fp8_grouped 50 "${pagedd[@]}" -- "$py" bench/bench_moe.py \
    --shape qwen3-30b-a3b --tokens 1,64,4096 --iters 30 --quantization fp8 \
    --moe-fp8-backend grouped --decode-max-slots 0 --out "$out/layer_qwen3_fp8_grouped.json"
  step layer_qwen3_fp8_w8a8 50 "${pagedd[@]}" -- "$py" bench/bench_moe.py \
    --shape qwen3-30b-a3b --tokens 8,64 --iters 30 --quantization fp8 \
    --fp8-w8a16-max-tokens 0 --out "$out/layer_qwen3_fp8_w8a8.json"
fi
if has qwen3; then
  # shellcheck disable=SC2046
  step engine_qwen3_bf16 150 "${pagedd[@]}" -- "$py" $(engine qwen3-30b-a3b) \
    --out "$out/engine_qwen3_bf16_pagedd.json"
  # shellcheck disable=SC2046
  step engine_qwen3_fp8 150 "${pagedd[@]}" -- "$py" $(engine qwen3-30b-a3b) "${fp8[@]}" \
    --out "$out/engine_qwen3_fp8_pagedd.json"
fi
if has mixtral; then
  # shellcheck disable=SC2046
  step engine_mixtral_bf16 170 "${pagedd[@]}" -- "$py" $(engine mixtral-8x7b) \
    --out "$out/engine_mixtral_bf16_pagedd.json"
  # shellcheck disable=SC2046
  step engine_mixtral_fp8 150 "${pagedd[@]}" -- "$py" $(engine mixtral-8x7b) "${fp8[@]}" \
    --out "$out/engine_mixtral_fp8_pagedd.json"
fi
if has vllm || has vllm_mixtral; then
  site=$(realpath "${VLLM_SITE:?the vllm groups need VLLM_SITE (vLLM 0.26 installed there)}")
  vllm=(PYTHONPATH="$site:$repo$extra" VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false)
  for m in $(has vllm && echo qwen3) $(has vllm_mixtral && echo mixtral); do
    model=$([ "$m" = qwen3 ] && echo qwen3-30b-a3b || echo mixtral-8x7b)
    # shellcheck disable=SC2046
    step "engine_${m}_bf16_vllm" 280 "${vllm[@]}" -- "$py" $(engine "$model") --backend vllm \
      --out "$out/engine_${m}_bf16_vllm.json"
    # shellcheck disable=SC2046
    step "engine_${m}_fp8_vllm" 280 "${vllm[@]}" -- "$py" $(engine "$model") --backend vllm \
      "${fp8[@]}" --out "$out/engine_${m}_fp8_vllm.json"
  done
fi
if has dense; then
  llama=(bench/throughput.py --model "$models/llama3-8b" --load-format dummy --device cuda
         --no-progress --workload w1)
  step dense_bf16 90 "${pagedd[@]}" -- "$py" "${llama[@]}" --tpot-batch1 5 \
    --out "$out/dense_bf16.json"
  step dense_fp8_scaled_mm 90 "${pagedd[@]}" -- "$py" "${llama[@]}" "${fp8[@]}" --tpot-batch1 5 \
    --fp8-gemv-max-tokens 0 --fp8-swap-ab-max-tokens 0 --out "$out/dense_fp8_scaled_mm.json"
  step dense_fp8_gemv16 90 "${pagedd[@]}" -- "$py" "${llama[@]}" "${fp8[@]}" --tpot-batch1 5 \
    --fp8-gemv-max-tokens 16 --out "$out/dense_fp8_gemv16.json"
  step dense_fp8_swap16 90 "${pagedd[@]}" -- "$py" "${llama[@]}" "${fp8[@]}" --tpot-batch1 5 \
    --fp8-gemv-max-tokens 0 --fp8-swap-ab-max-tokens 16 --out "$out/dense_fp8_swap16.json"
fi
if has prefill; then
  for heads in "32 32" "32 8"; do
    tag=$(echo "$heads" | tr ' ' x)
    # shellcheck disable=SC2086
    step "prefill_$tag" 100 "${pagedd[@]}" -- "$py" bench/bench_prefill.py --dtypes bf16 \
      --heads $heads --q-lens 128 256 512 1024 2048 --backend auto,mma,wgmma --tiles 128x32 \
      --wgmma-block-n 128 --sdpa-backends flash efficient cudnn --decode-batches \
      --out "$out/prefill_$tag.json"
  done
fi
if has profile; then
  step profile_w1_bf16 150 "${pagedd[@]}" -- "$py" bench/throughput.py \
    --model "$models/llama3-8b" --load-format dummy --device cuda --no-progress --workload w1 \
    --profile --out "$out/profile_w1_bf16.json"
  step profile_step_llama_256 90 "${pagedd[@]}" -- "$py" bench/profile_step.py \
    --model "$models/llama3-8b" --load-format dummy --num-seqs 256 --steps 10 \
    --out "$out/profile_step_llama_256.json"
  step profile_step_mixtral_bf16_1 80 "${pagedd[@]}" -- "$py" bench/profile_step.py \
    --model "$models/mixtral-8x7b" --load-format dummy --num-seqs 1 --steps 20 \
    --prefill-steps 0 --moe-router-seed "$seed" --out "$out/profile_step_mixtral_bf16_1.json"
  for q in bf16 fp8; do
    for b in 64 256; do
      qflags=(); [ $q = fp8 ] && qflags=(--quantization fp8 --kv-cache-dtype fp8)
      step "profile_step_qwen3_${q}_$b" 80 "${pagedd[@]}" -- "$py" bench/profile_step.py \
        --model "$models/qwen3-30b-a3b" --load-format dummy --num-seqs "$b" --steps 10 \
        --prefill-steps 0 --moe-router-seed "$seed" "${qflags[@]}" \
        --out "$out/profile_step_qwen3_${q}_$b.json"
    done
  done
fi
rm -rf "$models"
PYTHONPATH="$repo$extra" "$py" bench/issue41_summary.py "$out"
echo "total $(($(date +%s) - t_all)) s; files in $out" >&2
