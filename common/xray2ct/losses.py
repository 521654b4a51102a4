# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Projection ("physics") consistency loss of X-ray -> CT models: the DRRs of a predicted volume against the input
X-rays, with the same projector that made the X-rays."""

from __future__ import annotations

import torch
from torch import nn

from common.xray2ct.drr import DRRProjector, resize_2d, view_plane

__all__ = ["PHYSICS_WEIGHTINGS", "ProjectionLoss", "physics_noise_weight"]

PHYSICS_WEIGHTINGS = ("alpha_bar", "none")


def physics_noise_weight(alpha_bar: torch.Tensor, weighting: str = "alpha_bar") -> torch.Tensor:
    """Per-sample weight of the physics loss at noise level ``alpha_bar`` (``alphas_cumprod[t]``).

    ``alpha_bar``: the signal fraction ``a_t = SNR / (1 + SNR)``, near 1 at low noise and near 0 where the x0
    estimate is mostly noise and its projection meaningless; ``none``: 1 everywhere (the ``direct`` regressor).

    Raises:
        ValueError: for an unknown ``weighting``.
    """
    if weighting not in PHYSICS_WEIGHTINGS:
        raise ValueError(f"physics_weighting must be one of {PHYSICS_WEIGHTINGS}, got {weighting!r}.")
    alpha_bar = alpha_bar.reshape(-1).float()
    return alpha_bar if weighting == "alpha_bar" else torch.ones_like(alpha_bar)


class ProjectionLoss(nn.Module):
    """Mean absolute difference per volume between the normalised line integrals of ``volume`` and ``xray``.

    Both are compared at the volume's own projection resolution: ``volume`` is projected natively and ``xray``
    (``view_size``) is area-averaged down to it (or interpolated up), so a ground-truth volume projected by the
    same :class:`common.xray2ct.drr.DRRProjector` that made its X-rays gives exactly zero at equal resolution and
    zero up to float rounding when the X-rays come from an integer multiple of the volume's size.

    Args:
        projector: the projector that made (or calibrates) the X-rays.

    Returns from ``forward``: a ``(B,)`` tensor (no reduction over the batch, so callers can weight per sample).
    """

    def __init__(self, projector: DRRProjector) -> None:
        super().__init__()
        self.projector = projector

    def target(self, xray: torch.Tensor, spatial: tuple[int, ...]) -> torch.Tensor:
        """``xray`` brought to the native projection size of a volume of ``spatial`` size."""
        plane = view_plane(spatial, self.projector.views[0])
        return resize_2d(xray.float(), plane)

    def forward(self, volume: torch.Tensor, xray: torch.Tensor) -> torch.Tensor:
        predicted = self.projector.project_native(volume)
        target = self.target(xray, tuple(volume.shape[2:]))
        return (predicted - target).abs().flatten(1).mean(1)
