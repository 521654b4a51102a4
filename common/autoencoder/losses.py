# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Losses of autoencoder training besides MONAI's adversarial loss: KL divergence and an optional perceptual loss."""

from __future__ import annotations

import os

import torch
from torch import nn

__all__ = ["kl_divergence", "make_perceptual_loss"]


def kl_divergence(z_mu: torch.Tensor, z_sigma: torch.Tensor) -> torch.Tensor:
    """KL(N(mu, sigma^2) || N(0, 1)) summed over latent elements, averaged over the batch.

    The form used by MONAI's latent-diffusion tutorials and MAISI's VAE.
    """
    dims = list(range(1, z_mu.ndim))
    kl = 0.5 * torch.sum(z_mu.float().pow(2) + z_sigma.float().pow(2) - torch.log(z_sigma.float().pow(2)) - 1, dim=dims)
    return kl.mean()


def make_perceptual_loss(
    weight: float = 0.0,
    weights_path: str | None = None,
    network_type: str = "medicalnet_resnet10_23datasets",
    spatial_dims: int = 3,
    is_fake_3d: bool = False,
) -> nn.Module | None:
    """Build MONAI's ``PerceptualLoss`` only when it is used.

    Pretrained perceptual networks cannot be downloaded at run time in offline clusters, so this never
    downloads: with ``weight == 0`` nothing is built; otherwise ``weights_path`` must point to a local state
    dict of the chosen ``network_type``.

    Raises:
        ValueError: when ``weight > 0`` and ``weights_path`` is missing or does not exist.
    """
    if not weight:
        return None
    if not weights_path or not os.path.isfile(str(weights_path)):
        raise ValueError(
            f"perceptual_weight={weight} needs perceptual_weights_path pointing to a local {network_type} state dict "
            f"(weights are never downloaded at run time), got {weights_path!r}."
        )
    from monai.losses import PerceptualLoss

    loss = PerceptualLoss(
        spatial_dims=spatial_dims,
        network_type=network_type,
        is_fake_3d=is_fake_3d,
        pretrained=True,
        pretrained_path=str(weights_path),
    )
    return loss.eval()
