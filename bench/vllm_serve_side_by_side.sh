#!/usr/bin/env bash
# `pagedd serve` and `vllm serve` under the same Poisson load through the OpenAI API, one server
# on the GPU at a time, the same load generator (bench/loadgen.py --protocol openai), the same
# prompts, a fresh prefix-cache salt per rate (no run reuses another's cache). About 6 minutes
# on an H200 with the defaults (vLLM's server start-up alone is ~2 minutes).
#
#   bash bench/vllm_serve_side_by_side.sh VLLM_SITE [OUT]
#
# Environment: RATES (default 12,24 requests/s), NUM_REQUESTS (400), WORKLOAD (default
# "--workload sharegpt": heavy-tailed lengths), SLO (ttft_ms=500,tpot_ms=50), PYTHON, PORT
# (8300), EXTRA_PAGEDD / EXTRA_VLLM (more server flags, e.g. "--quantization fp8").
# Writes OUT/serve_pagedd.json, OUT/serve_vllm.json (+ their PNG plots), the servers' logs,
# and prints both sweep tables and a side-by-side table (bench/side_by_side_summary.py --serve).
set -uo pipefail
site=$(realpath "${1:?usage: vllm_serve_side_by_side.sh VLLM_SITE [OUT]}")
out=$(realpath -m "${2:-${OUT:-/tmp/serve_side_by_side}}")
py=${PYTHON:-python3}
port=${PORT:-8300}
rates=${RATES:-12,24}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
mkdir -p "$out"
[ -d "$site/vllm" ] || { echo "no vllm package in $site (run install_vllm.sh first)" >&2; exit 2; }
model=$(mktemp -d)/llama3-8b
PYTHONPATH="$repo" "$py" bench/throughput_models.py llama3-8b "$model" >/dev/null
# shellcheck disable=SC2206
load=(bench/loadgen.py --protocol openai --server "127.0.0.1:$port" ${WORKLOAD:---workload sharegpt}
      --num-requests "${NUM_REQUESTS:-400}" --sweep-rates "$rates" --slo "${SLO:-ttft_ms=500,tpot_ms=50}"
      --no-progress)
server=
stop() { [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null; server=; }
trap stop EXIT
t0=$(date +%s)

echo "== pagedd serve (HTTP port $port)" >&2
# shellcheck disable=SC2086
PYTHONPATH="$repo" "$py" -m pydaemon serve --model "$model" --load-format dummy --device cuda \
  --port $((port + 1)) --http-port "$port" --log-level warning ${EXTRA_PAGEDD:-} >"$out/pagedd_server.log" 2>&1 &
server=$!
PYTHONPATH="$repo" timeout 240 "$py" "${load[@]}" --wait-ready 120 --out "$out/serve_pagedd.json" \
  || echo "pagedd sweep failed: see above and $out/pagedd_server.log" >&2
stop
echo "   $(($(date +%s) - t0)) s" >&2

echo "== vllm serve (port $port)" >&2
# shellcheck disable=SC2086
PYTHONPATH="$site:$repo" VLLM_USE_FLASHINFER_SAMPLER=0 "$py" -m vllm.entrypoints.cli.main serve "$model" \
  --load-format dummy --skip-tokenizer-init --port "$port" \
  ${EXTRA_VLLM:-} >"$out/vllm_server.log" 2>&1 &
server=$!
PYTHONPATH="$repo" timeout 360 "$py" "${load[@]}" --wait-ready 240 --out "$out/serve_vllm.json" \
  || echo "vLLM sweep failed: see above and $out/vllm_server.log" >&2
stop
echo "   $(($(date +%s) - t0)) s" >&2
PYTHONPATH="$repo" "$py" bench/side_by_side_summary.py --serve "$out"
