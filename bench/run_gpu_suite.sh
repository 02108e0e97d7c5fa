#!/usr/bin/env bash
# The issue-7 figures on one GPU, in one command (about 8 minutes on an H200), from a built
# checkout (pydaemon._core with CUDA):
#
#   OUT=/some/dir bash bench/run_gpu_suite.sh
#
# Writes under $OUT (default bench/results/gpu_suite_<date>):
#   w1_pagedd.json         full W1 offline through LLM.generate (pagedd)
#   w1_64_peers.json       the first 64 W1 requests through pagedd, transformers continuous
#                          batching and static generate (batch 64), with ratios (--compare)
#   w1_loadgen.json/.png   full W1 all at once through a running daemon (gRPC overhead)
#   w1_mux.json/.png       the same with every request on 8 shared GenerateBatched calls
#   w1_openai.json/.png    the same through the daemon's OpenAI HTTP API (HTTP overhead)
#   sweep.json/_sweep.png  a short Poisson rate sweep on W1 prompts
#   summary.md             the final table (also printed), *.log the pieces' output
# Each piece has its own time limit (500 s in all; LIMIT_W1=120, LIMIT_PEERS=190,
# LIMIT_LOADGEN=130 (includes the daemon's start-up), LIMIT_MUX=100, LIMIT_OPENAI=100, LIMIT_SWEEP=60
# override them; every loadgen run sends its own prefix-cache salt, so no run reuses the
# prompts an earlier one left in the cache); one that
# fails or runs over is reported and skipped. For a smoke run elsewhere: MODEL_DIR=<dir> DEVICE=cpu WORKLOAD="--workload fixed
# --input-len 32 --output-len 8 --num-requests 16" (defaults: the Llama-3-8B shape, cuda, W1).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-bench/results/gpu_suite_$(date +%Y%m%d_%H%M%S)}
PORT=${PORT:-50651}
HTTP_PORT=${HTTP_PORT:-50652}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
WORKLOAD=${WORKLOAD:---workload w1}
if [ -n "${MODEL_DIR:-}" ]; then
  MODEL=$MODEL_DIR
  TMP_MODEL=
else
  MODEL=$(mktemp -d /tmp/pagedd-llama3-8b.XXXXXX)
  TMP_MODEL=$MODEL
  $PY bench/throughput_models.py llama3-8b "$MODEL" >/dev/null || exit 1
fi
COMMON=(--model "$MODEL" --load-format dummy --device "$DEVICE" --no-progress)
start=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - start )) s] $*" >&2; }

piece() {  # piece NAME LIMIT_S CMD...: runs CMD under a time limit, output in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  stamp "$name (limit ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" > >(tee "$OUT/$name.log") 2>"$OUT/$name.err.log"
  local rc=$?
  [ $rc -eq 0 ] || stamp "$name FAILED (exit $rc; 124 = over its time limit): see $OUT/$name.err.log"
  return 0
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader >&2 || true

# 1. full W1 offline, pagedd
piece w1_pagedd "${LIMIT_W1:-120}" $PY bench/throughput.py "${COMMON[@]}" $WORKLOAD --out "$OUT/w1_pagedd.json"

# 2. the peers on the first 64 W1 requests, pagedd on the same 64, ratios
if [ -z "${SKIP_PEERS:-}" ]; then
piece w1_64_peers "${LIMIT_PEERS:-190}" $PY bench/throughput.py "${COMMON[@]}" $WORKLOAD --num-requests 64 \
  --backend pagedd,hf-continuous,hf-static --compare --out "$OUT/w1_64_peers.json"
fi

# 3. the daemon, then full W1 through loadgen, then a short rate sweep
stamp "starting the daemon on port $PORT"
$PY -m pydaemon serve --model "$MODEL" --load-format dummy --device "$DEVICE" --port "$PORT" \
  --http-port "$HTTP_PORT" --log-level warning >"$OUT/daemon.log" 2>&1 &
DAEMON=$!
trap 'kill $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null; [ -n "$TMP_MODEL" ] && rm -rf "$TMP_MODEL"' EXIT
piece w1_loadgen "${LIMIT_LOADGEN:-130}" $PY bench/loadgen.py --server "127.0.0.1:$PORT" --wait-ready 90 \
  $WORKLOAD --num-channels 8 --no-progress --out "$OUT/w1_loadgen.json"
piece w1_mux "${LIMIT_MUX:-100}" $PY bench/loadgen.py --protocol grpc-mux --server "127.0.0.1:$PORT" \
  --wait-ready 30 $WORKLOAD --num-channels 8 --no-progress --out "$OUT/w1_mux.json"
piece w1_openai "${LIMIT_OPENAI:-100}" $PY bench/loadgen.py --protocol openai \
  --server "127.0.0.1:$HTTP_PORT" --wait-ready 30 $WORKLOAD --no-progress --out "$OUT/w1_openai.json"
piece sweep "${LIMIT_SWEEP:-60}" $PY bench/loadgen.py --server "127.0.0.1:$PORT" --wait-ready 10 \
  $WORKLOAD --num-requests 48 --sweep-rates 4,16,64 --slo ttft_ms=1000,tpot_ms=100 \
  --no-progress --quiet --out "$OUT/sweep.json"
kill -TERM $DAEMON 2>/dev/null
wait $DAEMON 2>/dev/null
stamp "done"

$PY bench/loadgen_suite_summary.py "$OUT"
