# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The autoencoder as an inference network: one tensor out, what an inference config's ``network_def`` is."""

from __future__ import annotations

import torch
from monai.networks.nets import AutoencoderKL

__all__ = ["AutoencoderKLReconstructor"]


class AutoencoderKLReconstructor(AutoencoderKL):
    """MONAI ``AutoencoderKL`` whose ``forward(x)`` is its deterministic reconstruction (the decoded posterior
    mean, ``reconstruct``) instead of ``(reconstruction, z_mu, z_sigma)`` from a sampled latent: the single tensor
    the model zoo checks (``verify_net_in_out``) and exporters expect. Same arguments and state dict as
    ``AutoencoderKL``; training uses ``AutoencoderKL`` itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.reconstruct(x)
