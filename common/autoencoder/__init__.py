# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The autoencoder family (``autoencoder_3d``, and the GAN half of ``vqgan_3d``): the generator/discriminator
training step, the patch discriminator, the adversarial and reconstruction/perceptual losses."""

from __future__ import annotations
