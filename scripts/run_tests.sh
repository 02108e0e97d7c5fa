#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite (GPU tests skip cleanly without a GPU), in
# PAGEDD_TEST_WORKERS pytest-xdist workers (default 2: a 2-core box runs the suite in half the
# time of one process; whole files per worker, so module fixtures are built once).
#   bash scripts/run_tests.sh [pytest args...]     (-n 0: one process, for -s or pdb)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python -m pytest -q -n "${PAGEDD_TEST_WORKERS:-2}" --dist loadfile "$@"
