#!/usr/bin/env bash
# Issue 44's H200 measurements: pagedd and vLLM 0.26.0 on the issue's shapes (bench/
# throughput_models.py: mistral-7b, a 4,096-token window on every layer; gemma3-27b, 5 local
# layers of 1,024 to 1 global; gpt-oss-20b, bf16 experts, sinks, 128-token windows on every
# other layer), dummy bf16 weights, one device call per STEPS group. From a built checkout
# (scripts/dev_build.sh with the CUDA kernels; the build is not part of this script):
#
#   STEPS=pagedd bash bench/issue44_suite.sh OUT                         # ~6.5 min
#   STEPS=vllm_a VLLM_SITE=DIR bash bench/issue44_suite.sh OUT           # ~5.5 min
#   STEPS=vllm_b VLLM_SITE=DIR bash bench/issue44_suite.sh OUT           # ~5.5 min
#
# (times are estimates, not measured: BUDGET_S guards them; vLLM starts in 75-120 s per engine,
# so all three vLLM shapes do not fit one 600 s call: STEPS=vllm runs vllm_a and vllm_b, for a
# longer call.) Each row is one throughput.py process under `timeout` (bench/steps.sh), its log
# and JSON in OUT as ENGINE_SHAPE_KIND.{log,json}:
#   W1     `--workload w1` (bench/README.md's W1), then on the same engine TPOT at batch 1 and at
#          batch 64 on fresh 1k-token prompts, TPOT = (t(257 tokens) - t(1)) / 256
#          (bench/tpot_generate.py; medians of TPOT_RUNS runs)
#   long   mistral-7b only: 64 prompts of 8,192 tokens, 256 out: twice the window, the case
#          where the window bounds the KV a decode step reads
# The groups:
#   pagedd: llama3-8b W1 (the calibration row, bench/README.md's model), mistral-7b W1 + TPOT and
#           long, gpt-oss-20b W1 + TPOT (routing statistics: bench/moe_routing.py), gemma3-27b
#           W1 + TPOT; MXFP4=1 adds gpt-oss-20b with the checkpoint's MXFP4 experts
#   vllm_a: vLLM mistral-7b W1 + TPOT, gpt-oss-20b W1 + TPOT (bf16 experts: no
#           quantization_config, vLLM's unquantized fused MoE). Should vLLM refuse that, the
#           same with `quantization_config: {quant_method: mxfp4}` (the checkpoint's format)
#           runs instead (row gpt-oss-20b-mxfp4); MXFP4=1 runs it in any case
#   vllm_b: vLLM gemma3-27b W1 + TPOT, mistral-7b long
# One vLLM engine per row (start-up once per shape); vLLM gets every setting no flag names at
# its default (bench/throughput_vllm.py). bench/issue44_summary.py prints the table at the end.
#
# Environment: PYTHON (python3), STEPS (pagedd), BUDGET_S (540: a step that would start past it
# is skipped, a running one is cut there; the summary always prints), TPOT_RUNS (3), VLLM_SITE
# (vLLM's install dir, for the vllm groups), ROUTING_STATS (auto: gpt-oss rows record experts
# touched per step on 3 layers; none: off), MXFP4 (0). For a smoke run of the plumbing
# elsewhere: TINY=1 (every shape cut to 2 layers of hidden 128: 6 for gemma3, for a global
# layer), DEVICE (cuda), W1_ARGS ("--workload w1"), LONG_ARGS, TPOT_ARGS, e.g.
#   TINY=1 DEVICE=cpu W1_ARGS="--workload w1 --num-requests 8 --output-len 4" \
#   LONG_ARGS="--workload fixed --input-len 160 --output-len 4 --num-requests 4" \
#   TPOT_ARGS="--tpot-batch1 1 --tpot-batch 1 --tpot-batch-size 4 --tpot-prompt-len 16 \
#   --tpot-output-len 3" bash bench/issue44_suite.sh /tmp/issue44_smoke
set -uo pipefail
out=$(realpath -m "${1:-${OUT:-/tmp/issue44}}")
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
mkdir -p "$out"
py=${PYTHON:-python3}
budget=${BUDGET_S:-540}
runs=${TPOT_RUNS:-3}
device=${DEVICE:-cuda}
t_all=$(date +%s)
source bench/steps.sh  # step NAME TIMEOUT_S ENV... -- COMMAND...: one process, its log in OUT/NAME.log
extra=${PYTHONPATH:+:$PYTHONPATH}
pagedd=(PYTHONPATH="$repo$extra")
steps=" ${STEPS:-pagedd} "
has() { [[ $steps == *" $1 "* ]]; }
# shellcheck disable=SC2206
w1=(${W1_ARGS:---workload w1})
# shellcheck disable=SC2206
long=(${LONG_ARGS:---workload fixed --input-len 8192 --output-len 256 --num-requests 64})
# shellcheck disable=SC2206
tpot=(${TPOT_ARGS:---tpot-batch1 $runs --tpot-batch $runs --tpot-batch-size 64
      --tpot-prompt-len 1024 --tpot-output-len 257})
routing=(--routing-stats "${ROUTING_STATS:-auto}")
mxfp4=${MXFP4:-0}

# The shapes' config.json (dummy weights); gpt-oss-20b-mxfp4: the same with the checkpoint's
# quantization_config (experts MXFP4, attention / router / embeddings bf16).
models=$(mktemp -d)
trap 'rm -rf "$models"' EXIT
PYTHONPATH="$repo$extra" "$py" - "$models" "${TINY:-0}" <<'PY' || exit 2
import json
import sys
from pathlib import Path

from bench.throughput_models import MODEL_CONFIGS

root, tiny = Path(sys.argv[1]), sys.argv[2] == "1"
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
for name in ("llama3-8b", "mistral-7b", "gemma3-27b", "gpt-oss-20b", "gpt-oss-20b-mxfp4"):
    cfg = dict(MODEL_CONFIGS[name.removesuffix("-mxfp4")])
    if name.endswith("-mxfp4"):
        cfg["quantization_config"] = MXFP4
    if tiny:  # the plumbing on a CPU: the architecture's features, not its sizes
        layers = 6 if name == "gemma3-27b" else 2
        cfg.update(hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        if "num_local_experts" in cfg:
            cfg.update(num_local_experts=4, num_experts_per_tok=2, experts_per_token=2)
        if "layer_types" in cfg:
            cfg["layer_types"] = cfg["layer_types"][:layers]
        if cfg.get("sliding_window"):
            cfg["sliding_window"] = 64
        if "query_pre_attn_scalar" in cfg:
            cfg["query_pre_attn_scalar"] = 32
    (root / name).mkdir()
    (root / name / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
PY

if has vllm || has vllm_a || has vllm_b; then
  site=$(realpath "${VLLM_SITE:?the vllm groups need VLLM_SITE (vLLM 0.26 installed there)}")
  [ -d "$site/vllm" ] || { echo "no vllm package in $site (run install_vllm.sh first)" >&2; exit 2; }
  vllm=(PYTHONPATH="$site:$repo$extra" VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false)
fi
row() {  # ENGINE SHAPE KIND TIMEOUT_S [FLAGS...]: one throughput.py run, OUT/ENGINE_SHAPE_KIND.json
  local engine=$1 shape=$2 kind=$3 limit=$4 envs work
  shift 4
  if [ "$engine" = vllm ]; then envs=("${vllm[@]}"); else envs=("${pagedd[@]}"); fi
  if [ "$kind" = long ]; then work=("${long[@]}"); else work=("${w1[@]}"); fi
  rm -f "$out/${engine}_${shape}_$kind.json"  # a JSON left by an earlier run is no result
  step "${engine}_${shape}_$kind" "$limit" "${envs[@]}" -- "$py" bench/throughput.py \
    --model "$models/$shape" --load-format dummy --device "$device" --no-progress \
    --backend "$engine" "${work[@]}" "$@" --out "$out/${engine}_${shape}_$kind.json"
  [ -s "$out/${engine}_${shape}_$kind.json" ]
}

if has pagedd; then
  if [ "$device" = cuda ]; then
    PYTHONPATH="$repo$extra" "$py" -c \
      "from pydaemon import ops; r = ops.unavailable_reason(); assert r is None, r" \
      || { echo "pagedd's CUDA kernels are not usable here (scripts/dev_build.sh)" >&2; exit 2; }
  fi
  row pagedd llama3-8b w1 100
  row pagedd mistral-7b w1 160 "${tpot[@]}"
  row pagedd mistral-7b long 120
  row pagedd gpt-oss-20b w1 180 "${tpot[@]}" "${routing[@]}"
  row pagedd gemma3-27b w1 240 "${tpot[@]}"
  [ "$mxfp4" = 1 ] && row pagedd gpt-oss-20b-mxfp4 w1 180 "${tpot[@]}" "${routing[@]}"
fi
if has vllm || has vllm_a; then
  row vllm mistral-7b w1 270 "${tpot[@]}"
  if ! row vllm gpt-oss-20b w1 270 "${tpot[@]}" "${routing[@]}" || [ "$mxfp4" = 1 ]; then
    row vllm gpt-oss-20b-mxfp4 w1 270 "${tpot[@]}" "${routing[@]}"
  fi
fi
if has vllm || has vllm_b; then
  row vllm gemma3-27b w1 360 "${tpot[@]}"
  row vllm mistral-7b long 200
fi
PYTHONPATH="$repo$extra" "$py" bench/issue44_summary.py "$out"
echo "total $(($(date +%s) - t_all)) s; files in $out" >&2
