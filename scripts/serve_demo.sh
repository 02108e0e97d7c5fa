#!/usr/bin/env bash
# Set up .venv if needed, then serve the built-in demo model on localhost:50051.
#   bash scripts/serve_demo.sh [extra `pagedd serve` flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/pagedd serve --model demo "$@"
