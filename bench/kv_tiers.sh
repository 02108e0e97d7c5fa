#!/usr/bin/env bash
# KV tiers on one H200 in ONE device call, steps picked by STEPS (default "chat": ~3 minutes):
#   chat:      pagedd on the multi-turn chat workload (bench/bench_kv_tiers.py: 48
#              conversations x 5 turns, 256-token system prompts, 256-512-token user messages,
#              128-token replies, 16 requests in flight; its final histories need ~135k tokens,
#              4x the GPU KV cache of 2048 blocks = 32k tokens), Llama-3-8B shape, dummy bf16
#              weights: tiers off, then a CPU tier of CPU_GIB (32) GiB
#   disk:      the same with a 4 GiB CPU tier and a DISK_GIB (32) GiB disk tier in OUT/kv-disk,
#              then once more after a restart (the disk tier found again)          (~2 min)
#   w1:        W1 (bench/throughput.py) without tiers and with a CPU_GIB tier      (~2 min)
#   doc:       the long-document workload (--workload document: 32 conversations, each over
#              its own 8k-token document, 4 turns of short questions and 200-token answers,
#              DOC_ACTIVE (4) in flight): tiers off, a CPU tier of DOC_CPU_GIB (48), then a
#              4 GiB CPU tier + disk tier from an empty folder and once more after a restart
#              (the table's "1st turns" column: first-turn TTFT, cold against restarted)
#   vllm-doc:  vLLM 0.26 on the long-document workload, off and with DOC_CPU_GIB native
#              offloading (needs VLLM_SITE)
#   vllm:      vLLM 0.26 on the same chat workload and GPU KV size, off and with
#              --kv-offloading-backend native --kv-offloading-size CPU_GIB (needs VLLM_SITE:
#              the directory install_vllm.sh installed vLLM into)                  (~4 min)
# then the table of every chat run so far in OUT (bench_kv_tiers.py --compare; the first row
# is the baseline of the ratios). Each step is its own process under `timeout`, its log and
# JSON in OUT.
#
#   bash bench/kv_tiers.sh [OUT]          # OUT defaults to $OUT, else /tmp/kv_tiers
#   STEPS="w1" bash bench/kv_tiers.sh OUT; VLLM_SITE=... STEPS=vllm bash bench/kv_tiers.sh OUT
#
# Environment: PYTHON (python3), CPU_GIB (32), DISK_GIB (32), DOC_CPU_GIB (48), DOC_ACTIVE (4),
# BUDGET_S (560), CHAT_ARGS (more bench_kv_tiers.py flags for every run, e.g.
# "--conversations 24" for a shorter run).
set -uo pipefail
out=$(realpath -m "${1:-${OUT:-/tmp/kv_tiers}}")
py=${PYTHON:-python3}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
mkdir -p "$out"
cpu_gib=${CPU_GIB:-32}
disk_gib=${DISK_GIB:-32}
t_all=$(date +%s)
budget=${BUDGET_S:-560}
source bench/steps.sh
extra=${PYTHONPATH:+:$PYTHONPATH}
pagedd=(PYTHONPATH="$repo$extra")
model=$(mktemp -d)/llama3-8b
env "${pagedd[@]}" "$py" bench/throughput_models.py llama3-8b "$model" >/dev/null
# shellcheck disable=SC2206
chat=("$py" bench/bench_kv_tiers.py --model "$model" ${CHAT_ARGS:-})
steps=" ${STEPS:-chat} "

if [[ $steps == *" chat "* ]]; then
  step chat-off 240 "${pagedd[@]}" -- "${chat[@]}" --out "$out/chat-1-pagedd-off.json"
  step chat-cpu 240 "${pagedd[@]}" -- "${chat[@]}" --kv-offloading-size "$cpu_gib" \
    --out "$out/chat-2-pagedd-cpu.json"
fi
if [[ $steps == *" disk "* ]]; then
  rm -rf "$out/kv-disk"
  disk=(--kv-offloading-size 4 --kv-offloading-dir "$out/kv-disk" --kv-offloading-disk-size "$disk_gib")
  step chat-disk 240 "${pagedd[@]}" -- "${chat[@]}" "${disk[@]}" --out "$out/chat-3-pagedd-disk.json"
  step chat-disk-restart 240 "${pagedd[@]}" -- "${chat[@]}" "${disk[@]}" \
    --label "pagedd, disk tier after a restart" --out "$out/chat-4-pagedd-disk-restart.json"
fi
doc_cpu_gib=${DOC_CPU_GIB:-48}
doc=("${chat[@]}" --workload document --max-active "${DOC_ACTIVE:-4}")
if [[ $steps == *" doc "* ]]; then
  step doc-off 300 "${pagedd[@]}" -- "${doc[@]}" --out "$out/doc-1-pagedd-off.json"
  step doc-cpu 300 "${pagedd[@]}" -- "${doc[@]}" --kv-offloading-size "$doc_cpu_gib" \
    --out "$out/doc-2-pagedd-cpu.json"
  rm -rf "$out/kv-disk-doc"
  disk=(--kv-offloading-size 4 --kv-offloading-dir "$out/kv-disk-doc" --kv-offloading-disk-size "$disk_gib")
  step doc-disk 300 "${pagedd[@]}" -- "${doc[@]}" "${disk[@]}" --out "$out/doc-3-pagedd-disk.json"
  step doc-disk-restart 300 "${pagedd[@]}" -- "${doc[@]}" "${disk[@]}" \
    --label "pagedd, document, disk tier after a restart" --out "$out/doc-4-pagedd-disk-restart.json"
fi
if [[ $steps == *" vllm-doc "* ]]; then
  site=$(realpath "${VLLM_SITE:?STEPS=vllm-doc needs VLLM_SITE}")
  vllm=(PYTHONPATH="$site:$repo$extra" VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false)
  step vllm-doc-off 300 "${vllm[@]}" -- "${doc[@]}" --engine vllm --out "$out/doc-5-vllm-off.json"
  step vllm-doc-cpu 300 "${vllm[@]}" -- "${doc[@]}" --engine vllm \
    --kv-offloading-size "$doc_cpu_gib" --out "$out/doc-6-vllm-cpu.json"
fi
if [[ $steps == *" w1 "* ]]; then
  w1=("$py" bench/throughput.py --model "$model" --load-format dummy --device cuda --no-progress
      --workload w1)
  step w1-off 240 "${pagedd[@]}" -- "${w1[@]}" --out "$out/w1-off.json"
  step w1-cpu 240 "${pagedd[@]}" -- "${w1[@]}" --kv-offloading-size "$cpu_gib" --out "$out/w1-cpu.json"
  for name in w1-off w1-cpu; do  # throughput.py's table (wall time, tokens/s) ends its log
    echo "== $name" && tail -n 4 "$out/$name.log"
  done
fi
if [[ $steps == *" vllm "* ]]; then
  site=$(realpath "${VLLM_SITE:?STEPS=vllm needs VLLM_SITE}")
  vllm=(PYTHONPATH="$site:$repo$extra" VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false)
  step vllm-off 280 "${vllm[@]}" -- "${chat[@]}" --engine vllm --out "$out/chat-5-vllm-off.json"
  step vllm-cpu 280 "${vllm[@]}" -- "${chat[@]}" --engine vllm --kv-offloading-size "$cpu_gib" \
    --out "$out/chat-6-vllm-cpu.json"
fi

shopt -s nullglob
: >"$out/summary.txt"
for kind in chat doc; do  # one table per workload, its first row the baseline
  results=("$out"/$kind-*.json)
  if [ ${#results[@]} -gt 0 ]; then
    env "${pagedd[@]}" "$py" bench/bench_kv_tiers.py --compare "${results[@]}" | tee -a "$out/summary.txt"
  fi
done
echo "== total $(($(date +%s) - t_all)) s; logs and JSON in $out"
