# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Demo and test data generators (MNI152-based volumes, phantoms, the synthetic MACE cohort). They are not part
of a packaged bundle: a trained bundle runs on the user's data."""

from __future__ import annotations
