#!/usr/bin/env bash
# Install what is needed, then train autoencoder_3d briefly on the embedded MNI152 demo data, evaluate it and
# print where outputs, metrics and TensorBoard logs are (GPU when there is one; a few minutes on a 2-core CPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" scripts/demo.py "$@"
