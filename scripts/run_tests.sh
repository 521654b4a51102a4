#!/usr/bin/env bash
# Install what is needed, then run the whole test suite (CPU; a few minutes on 2 cores).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}" PYTHONUTF8=1
exec "${PYTHON:-python3}" -m pytest -q -ra tests "$@"
