# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Discriminators for volume GANs: a 2D "image" discriminator on random slices and a 3D "video" discriminator."""

from __future__ import annotations

import torch
from monai.networks.nets import PatchDiscriminator
from torch import nn

__all__ = ["SliceVolumeDiscriminator"]


class SliceVolumeDiscriminator(nn.Module):
    """The two discriminators of TATS / MedicalDiffusion's VQ-GAN as one module.

    ``forward(x, views)`` returns ``{"image": [...], "video": [...]}``: each a list of the MONAI
    ``PatchDiscriminator`` feature maps whose last entry is the logit map. The 2D head sees one slice per volume
    along ``slice_axis``, at the indices ``views`` (``(B,)``, drawn by :meth:`sample_views`); passing the same
    ``views`` for real and reconstructed volumes makes them compare the same slices, which feature matching
    needs. A head is built only when enabled, so a zero GAN weight costs nothing.

    Args:
        in_channels: image channels.
        channels: width of the first discriminator layer.
        num_layers: downsampling layers of each discriminator.
        slice_axis: spatial axis (0, 1 or 2; negative counts from the last) the 2D slices are taken across.
        image: build the 2D slice discriminator.
        video: build the 3D volume discriminator.
        norm: normalisation of both (``BATCH``, as in TATS; ``INSTANCE`` for tiny batches).
    """

    def __init__(
        self,
        in_channels: int = 1,
        channels: int = 64,
        num_layers: int = 3,
        slice_axis: int = -1,
        image: bool = True,
        video: bool = True,
        norm: str | tuple = "BATCH",
    ) -> None:
        super().__init__()
        if not (image or video):
            raise ValueError("SliceVolumeDiscriminator needs at least one of image=True or video=True.")
        if not -3 <= int(slice_axis) <= 2:
            raise ValueError(f"slice_axis must be a spatial axis in [-3, 2], got {slice_axis!r}.")
        self.slice_axis = int(slice_axis) % 3
        common = {"num_layers_d": int(num_layers), "channels": int(channels), "in_channels": int(in_channels)}
        self.image = PatchDiscriminator(spatial_dims=2, norm=norm, **common) if image else None
        self.video = PatchDiscriminator(spatial_dims=3, norm=norm, **common) if video else None

    def sample_views(self, x: torch.Tensor) -> torch.Tensor:
        """One random slice index per volume of ``x`` (``(B, C, X, Y, Z)``) along ``slice_axis``."""
        return torch.randint(0, x.shape[2 + self.slice_axis], (x.shape[0],)).to(x.device)

    def slices(self, x: torch.Tensor, views: torch.Tensor) -> torch.Tensor:
        """The 2D slices ``(B, C, ., .)`` of ``x`` at ``views`` along ``slice_axis``."""
        axis = 2 + self.slice_axis
        moved = x.movedim(axis, 2)  # (B, C, S, ., .)
        batch = torch.arange(x.shape[0], device=x.device)
        return moved[batch, :, views.to(x.device).long()]

    def forward(self, x: torch.Tensor, views: torch.Tensor | None = None) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        if self.image is not None:
            if views is None:
                views = self.sample_views(x)
            out["image"] = self.image(self.slices(x, views).contiguous())
        if self.video is not None:
            out["video"] = self.video(x)
        return out
