# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The X-ray -> CT family (``xray2ct_cascade``), built on the diffusion family: digitally reconstructed
radiographs, biplanar view data, the cascade networks, the projection loss and the staged engines."""

from __future__ import annotations
