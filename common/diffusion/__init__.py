# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The diffusion family (``fast_ddpm_3d``): the noise schedule and samplers (DDPM, DDIM, Fast-DDPM step
sets), the denoising network, the latent space of a frozen autoencoder, transforms, engines and metrics."""

from __future__ import annotations
