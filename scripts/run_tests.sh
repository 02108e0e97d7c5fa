#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite (GPU tests skip cleanly without a GPU).
#   bash scripts/run_tests.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python -m pytest -q "$@"
