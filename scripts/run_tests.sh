#!/usr/bin/env bash
# Install what is needed, then run the whole test suite (CPU; about 20 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}" PYTHONUTF8=1
# two worker processes (TEST_WORKERS; 0 runs in this process), each test file in one worker: its module fixtures
# are built once, and each test's processes use one thread (OMP_NUM_THREADS), so two workers do not oversubscribe
# two cores
exec "${PYTHON:-python3}" -m pytest -q -ra -n "${TEST_WORKERS:-2}" --dist loadfile tests "$@"
