# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The survival family (``mace_survival``): cohort CSVs, transforms, the image + covariate hazard network,
losses, metrics (concordance, AUC, Brier, calibration, risk groups), engines and report handlers."""

from __future__ import annotations
