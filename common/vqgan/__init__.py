# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The VQ-GAN family (``vqgan_3d``), built on the autoencoder family: the patchwise 3D VQ-GAN with its
EMA codebook, and codebook usage metrics."""

from __future__ import annotations
