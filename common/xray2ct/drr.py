# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Differentiable parallel-beam digitally reconstructed radiographs (DRRs) and back-projection of CT volumes.

One :class:`DRRProjector` makes the training X-rays from CT volumes, back-projects X-rays into the volume as
conditioning channels and computes the projection ("physics") loss, so the three always agree: projecting a
ground-truth volume reproduces its X-rays exactly.

Geometry and normalisation (volumes in the collection's ``[-1, 1]`` convention, RAS orientation, a cube of
``fov_mm`` per axis):

* value -> HU: ``hu = hu_min + (x + 1) / 2 (hu_max - hu_min)`` (the intensity window of the data pipeline);
* HU -> linear attenuation: ``mu = mu_water (1 + hu / 1000)`` in 1/cm (air 0, water ``mu_water``); affine, so
  projections of averaged volumes are averaged projections;
* line integral along the view axis: ``L = sum_j mu_j * voxel_cm``; the AP view integrates along the
  anterior-posterior axis (axis 1 of ``(X, Y, Z)``) and gives an ``(X, Z)`` image, the lateral view integrates
  along the left-right axis (axis 0) and gives a ``(Y, Z)`` image;
* the stored X-ray is the normalised line integral ``p = k L`` with ``k = 2 / (mu_water * mean FOV in cm)``
  (a water slab through half the field of view gives ``p = 1``), the log-domain signal ``-log(I / I0)`` of a
  calibrated detector, resized to ``view_size``;
* the displayed/encoded intensity is ``1 - exp(-p)`` in ``[0, 1)`` (bone bright, air dark), mapped to
  ``[-1, 1]`` for the X-ray encoder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VIEW_AXES", "DRRProjector", "resize_2d", "view_plane"]

#: the spatial axis (of ``X, Y, Z`` in RAS) each view integrates along
VIEW_AXES = {"ap": 1, "lateral": 0}


def view_plane(spatial: Sequence[int], view: str) -> tuple[int, int]:
    """``(H, W)`` of the native projection of a volume of ``spatial`` size onto ``view``."""
    rest = [int(s) for i, s in enumerate(spatial) if i != VIEW_AXES[view]]
    return rest[0], rest[1]


def resize_2d(image: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """Resize ``(B, C, H, W)`` images: area averaging when no side grows (exact block means for integer
    factors, so line integrals of a downsampled volume match), bilinear interpolation otherwise."""
    size = tuple(int(s) for s in size)
    if tuple(image.shape[-2:]) == size:
        return image
    if all(s <= i for s, i in zip(size, image.shape[-2:])):
        return F.adaptive_avg_pool2d(image, size)
    return F.interpolate(image, size=size, mode="bilinear", align_corners=False)


def _triple(name: str, value: float | Sequence[float]) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3 or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"{name} must be a positive number or 3 positive numbers, got {value!r}.")
    return values[0], values[1], values[2]


class DRRProjector(nn.Module):
    """Parallel-beam projector of CT volumes in ``[-1, 1]`` (see the module docstring for the geometry).

    Args:
        hu_window: ``(hu_min, hu_max)`` of the volumes' ``[-1, 1]`` range (the data pipeline's CT window).
        fov_mm: physical size of the volume cube per axis ``(X, Y, Z)`` in mm, whatever its voxel count.
        views: names of the views in channel order, each a key of :data:`VIEW_AXES`.
        view_size: ``(H, W)`` of the stored X-rays.
        mu_water: linear attenuation of water in 1/cm (0.2 at about 60 keV).

    Raises:
        ValueError: for an unknown view, a window with ``hu_min >= hu_max`` or ``hu_min < -1000`` (negative
            attenuation), or non-positive sizes.
    """

    def __init__(
        self,
        hu_window: Sequence[float] = (-1000.0, 1000.0),
        fov_mm: float | Sequence[float] = 350.0,
        views: Sequence[str] = ("ap", "lateral"),
        view_size: Sequence[int] = (128, 128),
        mu_water: float = 0.2,
    ) -> None:
        super().__init__()
        hu_min, hu_max = (float(v) for v in hu_window)
        if not hu_min < hu_max:
            raise ValueError(f"hu_window must be (hu_min, hu_max) with hu_min < hu_max, got {list(hu_window)}.")
        if hu_min < -1000.0:
            raise ValueError(f"hu_window starts below air (-1000 HU), which has no attenuation: got {hu_min}.")
        bad = [v for v in views if v not in VIEW_AXES]
        if bad or not views or len(set(views)) != len(views):
            raise ValueError(f"views must be distinct names out of {sorted(VIEW_AXES)}, got {list(views)}.")
        size = [int(s) for s in view_size]
        if len(size) != 2 or min(size) < 1:
            raise ValueError(f"view_size must be 2 positive integers (H, W), got {view_size!r}.")
        if not float(mu_water) > 0:
            raise ValueError(f"mu_water must be positive, got {mu_water!r}.")
        self.hu_min, self.hu_max = hu_min, hu_max
        self.fov_mm = _triple("fov_mm", fov_mm)
        self.views = list(views)
        self.view_size = tuple(size)
        self.mu_water = float(mu_water)
        self.k = 2.0 / (self.mu_water * sum(self.fov_mm) / 30.0)  # 2 / (mu_water * mean FOV in cm)

    @property
    def num_views(self) -> int:
        return len(self.views)

    def extra_repr(self) -> str:
        return (
            f"views={self.views}, view_size={list(self.view_size)}, fov_mm={list(self.fov_mm)}, "
            f"hu_window={[self.hu_min, self.hu_max]}, mu_water={self.mu_water}"
        )

    # ------------------------------------------------------------------ units
    def to_hu(self, volume: torch.Tensor) -> torch.Tensor:
        """Volume values in ``[-1, 1]`` -> Hounsfield units."""
        return self.hu_min + (volume + 1.0) * 0.5 * (self.hu_max - self.hu_min)

    def from_hu(self, hu: torch.Tensor) -> torch.Tensor:
        """Hounsfield units -> volume values (``[-1, 1]`` inside the window)."""
        return (hu - self.hu_min) / (self.hu_max - self.hu_min) * 2.0 - 1.0

    def attenuation(self, volume: torch.Tensor) -> torch.Tensor:
        """Linear attenuation in 1/cm of volume values (affine, no clipping: gradients everywhere)."""
        return self.mu_water * (1.0 + self.to_hu(volume) / 1000.0)

    # ------------------------------------------------------------------ projection
    def project(self, volume: torch.Tensor, size: Sequence[int] | None = None) -> torch.Tensor:
        """Normalised line integrals ``p = k L`` of ``volume`` ``(B, 1, X, Y, Z)``: ``(B, V, H, W)``.

        Each view is integrated at the volume's own resolution, then resized to ``size`` (default
        ``view_size``) with :func:`resize_2d`.
        """
        if volume.ndim != 5 or volume.shape[1] != 1:
            raise ValueError(f"project expects a (B, 1, X, Y, Z) volume, got shape {tuple(volume.shape)}.")
        spatial = volume.shape[2:]
        mu = self.attenuation(volume.float())
        out = []
        for view in self.views:
            axis = VIEW_AXES[view]
            voxel_cm = self.fov_mm[axis] / spatial[axis] / 10.0
            p = mu.sum(dim=2 + axis) * (voxel_cm * self.k)
            out.append(resize_2d(p, size or self.view_size))
        return torch.cat(out, dim=1)

    def project_native(self, volume: torch.Tensor) -> torch.Tensor:
        """:meth:`project` at the volume's own plane resolution (the resolution of the physics loss)."""
        planes = {view_plane(volume.shape[2:], v) for v in self.views}
        if len(planes) != 1:
            raise ValueError(f"the views of a {tuple(volume.shape[2:])} volume have different sizes {sorted(planes)}.")
        return self.project(volume, next(iter(planes)))

    def xrays(self, volume: torch.Tensor) -> torch.Tensor:
        """The stored X-rays of ``volume``: :meth:`project` at ``view_size``."""
        return self.project(volume, self.view_size)

    @staticmethod
    def intensity(xray: torch.Tensor) -> torch.Tensor:
        """Displayed radiograph ``2 (1 - exp(-p)) - 1`` in ``[-1, 1)`` of normalised line integrals ``p``."""
        return 1.0 - 2.0 * torch.exp(-xray)

    @staticmethod
    def line_integral(intensity: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        """Inverse of :meth:`intensity`: ``p`` from a radiograph in ``[-1, 1]`` (clamped below 1 by ``eps``)."""
        transmitted = ((1.0 - intensity) * 0.5).clamp(min=eps, max=1.0)
        return -torch.log(transmitted)

    # ------------------------------------------------------------------ back-projection
    def backproject(self, xray: torch.Tensor, spatial: Sequence[int]) -> torch.Tensor:
        """Each view smeared uniformly along its rays into a volume of ``spatial`` size: ``(B, V, X, Y, Z)``.

        A view's value at a voxel is the mean attenuation along the ray through it, expressed as a volume value
        (``[-1, 1]`` scale): the uniform volume that has the same projection. Averaging the channels is the
        unfiltered back-projection estimate of the CT.
        """
        if xray.ndim != 4 or xray.shape[1] != self.num_views:
            raise ValueError(
                f"backproject expects ({self.num_views} views) X-rays of shape (B, {self.num_views}, H, W), "
                f"got {tuple(xray.shape)}."
            )
        spatial = [int(s) for s in spatial]
        out = []
        for i, view in enumerate(self.views):
            axis = VIEW_AXES[view]
            plane = resize_2d(xray[:, i : i + 1].float(), view_plane(spatial, view))
            mean_mu = plane / (self.k * self.fov_mm[axis] / 10.0)  # p / (k * path length in cm)
            hu = (mean_mu / self.mu_water - 1.0) * 1000.0
            value = self.from_hu(hu).unsqueeze(2 + axis)
            out.append(value.expand(-1, -1, *spatial))
        return torch.cat(out, dim=1)

    def data_consistency(self, volume: torch.Tensor, xray: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        """``volume`` moved towards agreeing with ``xray``: one simultaneous algebraic reconstruction (SIRT) step.

        For each view, the residual of the volume's native projection against the X-rays (area-averaged to the
        native plane, as the projection loss compares them) is spread uniformly along its rays as the volume value
        that projects to it (:meth:`backproject` is affine, so the difference of two back-projections is exactly
        that correction); the views' corrections are averaged and added with ``weight``. With one view and
        ``weight`` 1 the result projects exactly to the X-rays; with several views, repeated steps converge to a
        volume consistent with all of them. ``weight`` 0 returns ``volume`` unchanged.

        Args:
            volume: ``(B, 1, X, Y, Z)`` volumes in ``[-1, 1]``.
            xray: ``(B, V, H, W)`` normalised line integrals of the same cases.
            weight: step size, 1 for a full step.
        """
        if not weight:
            return volume
        spatial = volume.shape[2:]
        wanted = self.backproject(xray.to(volume.device), spatial)
        current = self.backproject(self.project_native(volume), spatial)
        correction = (wanted - current).mean(1, keepdim=True)
        return volume + float(weight) * correction.to(volume.dtype)

    def forward(self, volume: torch.Tensor) -> torch.Tensor:
        return self.xrays(volume)
