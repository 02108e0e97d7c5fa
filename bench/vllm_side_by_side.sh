#!/usr/bin/env bash
# pagedd and vLLM 0.26.0 side by side on W1, in ONE device call (about 6 minutes on an H200):
#   0. "check": tests/gpu/test_fast_kernel_args_gpu.py (the fast kernel-argument path gives the
#      plain path's bits, under a CUDA graph too, with the same error messages)
#   1. "w1": pagedd W1 bf16 + TPOT at batch 1 (1k prompt) on the same engine; vLLM W1 bf16 +
#      TPOT (vLLM start-up ~53 s); pagedd W1 FP8 weights + FP8 KV (+ TPOT); vLLM the same
#   2. "levers": pagedd's A/B rows: bf16 with a 16,384-token step budget and bf16 with
#      PAGEDD_FAST_KERNEL_ARGS=0 (the plain kernel-argument path), both right after pagedd's
#      bf16 row; eager TPOT at batch 1 with the fast kernel arguments on and off; the wrappers'
#      host cost per call, both paths; pagedd's bf16 row once more, last (the drift)
#   3. "profile" (not by default, ~2.5 min more): W1 bf16 of each engine under torch.profiler,
#      GPU time by kernel kind and idle time side by side (bench/gpu_breakdown.py)
# Each step is its own process under `timeout`; its log and JSON land in OUT; a failed step is
# reported and the next one runs. The summary table (bench/side_by_side_summary.py) ends it.
#
#   bash bench/vllm_side_by_side.sh VLLM_SITE [OUT]      # OUT defaults to $OUT, else /tmp/side_by_side
#
# VLLM_SITE: the directory install_vllm.sh installed vLLM into (it goes on PYTHONPATH for the
# vLLM steps only). pagedd must be built with its CUDA kernels first (scripts/dev_build.sh).
# Environment: PYTHON (default python3); TPOT_RUNS (5); STEPS (default "check w1 levers"; any
# of check, w1, levers, profile); BUDGET_S (560: a step that would start past it is skipped and
# a running one is cut there, so that the summary still prints inside a 10-minute call). For a
# smoke run of the plumbing elsewhere: MODEL_DIR (a model directory instead of the Llama-3-8B
# shape), DEVICE (cuda), WORKLOAD ("--workload w1"), TPOT_ARGS (e.g. "--tpot-prompt-len 8
# --tpot-output-len 3").
set -uo pipefail
site=$(realpath "${1:?usage: vllm_side_by_side.sh VLLM_SITE [OUT]}")
out=$(realpath -m "${2:-${OUT:-/tmp/side_by_side}}")
py=${PYTHON:-python3}
tpot_runs=${TPOT_RUNS:-5}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
mkdir -p "$out"
device=${DEVICE:-cuda}
[ -d "$site/vllm" ] || { echo "no vllm package in $site (run install_vllm.sh first)" >&2; exit 2; }
if [ "$device" = cuda ]; then
  PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$py" -c "from pydaemon import ops; r = ops.unavailable_reason(); assert r is None, r" \
    || { echo "pagedd's CUDA kernels are not usable here (build: scripts/dev_build.sh)" >&2; exit 2; }
fi
model=${MODEL_DIR:-}
if [ -z "$model" ]; then
  model=$(mktemp -d)/llama3-8b
  PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$py" bench/throughput_models.py llama3-8b "$model" >/dev/null
fi
# shellcheck disable=SC2206
w1=(bench/throughput.py --model "$model" --load-format dummy --device "$device" --no-progress
    ${WORKLOAD:---workload w1})
# shellcheck disable=SC2206
tpot=(--tpot-batch1 "$tpot_runs" ${TPOT_ARGS:-})
fp8=(--quantization fp8 --kv-cache-dtype fp8)
t_all=$(date +%s)

budget=${BUDGET_S:-560}  # the whole call's steps; the summary always runs
source bench/steps.sh  # step NAME TIMEOUT_S ENV... -- COMMAND...: one process, its log in OUT/NAME.log
# The caller's PYTHONPATH (carried wheels the machine lacks) stays behind ours.
extra=${PYTHONPATH:+:$PYTHONPATH}
pagedd=(PYTHONPATH="$repo$extra")
vllm=(PYTHONPATH="$site:$repo$extra" VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false)

steps=" ${STEPS:-check w1 levers} "
if [[ $steps == *" check "* ]]; then
  step check 90 "${pagedd[@]}" -- "$py" -m pytest -q -x -p no:cacheprovider \
    tests/gpu/test_fast_kernel_args_gpu.py
  tail -n 1 "$out/check.log" >&2
fi
has() { [[ $steps == *" $1 "* ]]; }
if has w1 || has levers; then  # the baseline of both
  step w1_pagedd_bf16 150 "${pagedd[@]}" -- "$py" "${w1[@]}" --backend pagedd \
    "${tpot[@]}" --out "$out/w1_pagedd_bf16.json"
fi
if has levers; then  # the W1 levers right after their baseline (less drift between them)
  step w1_pagedd_bf16_budget16k 120 "${pagedd[@]}" -- "$py" "${w1[@]}" --backend pagedd \
    --max-num-batched-tokens 16384 --out "$out/w1_pagedd_bf16_budget16k.json"
  step w1_pagedd_bf16_plainargs 120 "${pagedd[@]}" PAGEDD_FAST_KERNEL_ARGS=0 -- "$py" "${w1[@]}" \
    --backend pagedd --out "$out/w1_pagedd_bf16_plainargs.json"
fi
if has w1; then
  step w1_vllm_bf16 240 "${vllm[@]}" -- "$py" "${w1[@]}" --backend vllm \
    "${tpot[@]}" --out "$out/w1_vllm_bf16.json"
  step w1_pagedd_fp8 150 "${pagedd[@]}" -- "$py" "${w1[@]}" --backend pagedd "${fp8[@]}" \
    "${tpot[@]}" --out "$out/w1_pagedd_fp8.json"
  step w1_vllm_fp8 240 "${vllm[@]}" -- "$py" "${w1[@]}" --backend vllm "${fp8[@]}" \
    "${tpot[@]}" --out "$out/w1_vllm_fp8.json"
fi
if has levers; then
  for mode in fast plain; do
    flag=1; [ $mode = plain ] && flag=0
    step "tpot_eager_$mode" 90 "${pagedd[@]}" PAGEDD_FAST_KERNEL_ARGS=$flag -- "$py" bench/tpot_batch1.py \
      --model "$model" --device "$device" --modes eager --runs 3 --out "$out/tpot_eager_$mode.json"
  done
  step op_overhead 60 "${pagedd[@]}" -- "$py" bench/bench_op_overhead.py --out "$out/op_overhead.json"
  # the baseline once more, last: how far the machine drifted over the call (the noise floor)
  step w1_pagedd_bf16_again 120 "${pagedd[@]}" -- "$py" "${w1[@]}" --backend pagedd \
    --out "$out/w1_pagedd_bf16_again.json"
fi
if [[ $steps == *" profile "* ]]; then
  step w1_pagedd_bf16_profile 150 "${pagedd[@]}" -- "$py" "${w1[@]}" --backend pagedd --profile \
    --out "$out/w1_pagedd_bf16_profile.json"
  step w1_vllm_bf16_profile 240 "${vllm[@]}" -- "$py" "${w1[@]}" --backend vllm --profile \
    --out "$out/w1_vllm_bf16_profile.json"
fi
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$py" bench/side_by_side_summary.py "$out"
echo "total $(($(date +%s) - t_all)) s; files in $out" >&2
