#!/usr/bin/env bash
# Install what the collection needs into the current Python environment.
# A CPU build of torch is installed only when no torch is present (GPU users install their CUDA build first);
# the MNI152 demo templates come from the nilearn wheel, installed without its dependencies. The checkout itself is
# installed in editable mode, so `common` (the library the configs import) and `scripts` import from any folder.
set -euo pipefail
PYTHON=${PYTHON:-python3}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "no torch found: installing torch 2.13.0 (the CPU build where a local wheel is provided)"
    "$PYTHON" -m pip install --quiet torch==2.13.0
fi
"$PYTHON" -m pip install --quiet -r requirements.txt
"$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('nilearn') is None)" \
    || "$PYTHON" -m pip install --quiet --no-deps nilearn
"$PYTHON" -m pip install --quiet --no-deps --no-build-isolation --editable .
"$PYTHON" -c "import torch, monai; print(f'torch {torch.__version__} (cuda: {torch.cuda.is_available()}), monai {monai.__version__}')"
