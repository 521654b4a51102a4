# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Differentiable digitally reconstructed radiographs (DRRs) of CT volumes, parallel-beam or cone-beam, and
back-projection of X-rays into a volume.

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
* ``geometry="cone"``: a point source on the view axis at ``source_to_isocenter_mm`` from the volume's centre, on
  the anterior side for AP and the right side (RAS ``+X``) for the lateral view, and a flat detector at
  ``source_to_detector_mm`` from the source covering the field of view magnified by their ratio (so its image is
  that of a virtual detector through the centre, one pixel per voxel of the plane before resizing). Each ray is
  integrated by Joseph's method: in every slice across the view axis, the ray's point is interpolated bilinearly
  (air outside the volume) and weighted by the ray's path length through the slice. The projection is exactly
  linear in the attenuation, and is the parallel projection when the source is infinitely far;
* the stored X-ray is the normalised line integral ``p = k L`` with ``k = 2 / (mu_water * mean FOV in cm)``
  (a water slab through half the field of view gives ``p = 1``), the log-domain signal ``-log(I / I0)`` of a
  calibrated detector, resized to ``view_size``;
* the displayed/encoded intensity is ``1 - exp(-p)`` in ``[0, 1)`` (bone bright, air dark), mapped to
  ``[-1, 1]`` for the X-ray encoder.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GEOMETRIES",
    "MISMATCH_STATISTICS",
    "VIEW_AXES",
    "DRRProjector",
    "consistency_bounds",
    "noise_level",
    "resize_2d",
    "view_plane",
]

#: the spatial axis (of ``X, Y, Z`` in RAS) each view integrates along
VIEW_AXES = {"ap": 1, "lateral": 0}
#: the beam geometries of :class:`DRRProjector`
GEOMETRIES = ("parallel", "cone")
#: the statistics of :meth:`DRRProjector.mismatch`, each with its bound in a consistency check's reference
MISMATCH_STATISTICS = ("residual", "relation")


def consistency_bounds(reference: Any, views: Sequence[str]) -> dict[str, list[float]] | None:
    """The bounds of a consistency check's ``reference``: per statistic of :meth:`DRRProjector.mismatch`, one
    number > 0 per view. ``reference`` is ``None`` (no check), a mapping from statistics to their per-view bounds
    (as :class:`common.xray2ct.metrics.SamplerCalibration` fits them; a statistic left out is not checked), or a
    list of per-view bounds of the ``residual`` alone (calibrations made before the ``relation`` statistic).

    Raises:
        ValueError: naming the views and the forms accepted.
    """
    if reference is None:
        return None
    bounds = {"residual": reference} if isinstance(reference, (list, tuple)) else reference

    def per_view(values: Any) -> bool:
        return (
            isinstance(values, (list, tuple))
            and len(values) == len(views)
            and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in values
            )
        )

    if not (isinstance(bounds, Mapping) and bounds and set(bounds) <= set(MISMATCH_STATISTICS)) or not all(
        per_view(b) for b in bounds.values()
    ):
        raise ValueError(
            f"'consistency_reference' must be null (no check), a mapping from statistics out of "
            f"{list(MISMATCH_STATISTICS)} to {len(views)} numbers > 0 each, one per view {list(views)} (fitted by "
            f"evaluate.json --calibrate True), or {len(views)} residual bounds; got {reference!r}."
        )
    return {name: [float(v) for v in b] for name, b in bounds.items()}


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


def noise_level(images: torch.Tensor) -> torch.Tensor:
    """The standard deviation of white noise in each ``(B, V, H, W)`` image, ``(B, V)``: Immerkaer's estimator
    (J. Immerkaer, "Fast noise variance estimation", CVIU 1996), the mean absolute response to the difference of two
    Laplacians, which cancels smooth structure, times ``sqrt(pi / 2) / 6``. Edges leak into it a little: on
    noise-free images it is small, not zero."""
    kernel = torch.tensor([[1.0, -2.0, 1.0], [-2.0, 4.0, -2.0], [1.0, -2.0, 1.0]], dtype=images.dtype)
    b, v, h, w = images.shape
    if h < 3 or w < 3:
        return torch.zeros((b, v), dtype=images.dtype, device=images.device)
    response = F.conv2d(images.reshape(b * v, 1, h, w), kernel.to(images.device)[None, None])
    return (response.abs().mean(dim=(1, 2, 3)) * math.sqrt(math.pi / 2) / 6.0).reshape(b, v)


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
        geometry: ``parallel`` or ``cone`` (see the module docstring).
        source_to_isocenter_mm: distance of the source from the volume's centre (``cone``).
        source_to_detector_mm: distance of the detector from the source (``cone``): with the first, it sets the
            magnification, hence the detector's pixel size (:attr:`detector_pixel_mm`); the image is the same.

    Raises:
        ValueError: for an unknown view or geometry, a window with ``hu_min >= hu_max`` or ``hu_min < -1000``
            (negative attenuation), non-positive sizes, a source inside the volume or a detector nearer the source
            than the volume's centre.
    """

    def __init__(
        self,
        hu_window: Sequence[float] = (-1000.0, 1000.0),
        fov_mm: float | Sequence[float] = 350.0,
        views: Sequence[str] = ("ap", "lateral"),
        view_size: Sequence[int] = (128, 128),
        mu_water: float = 0.2,
        geometry: str = "parallel",
        source_to_isocenter_mm: float = 1000.0,
        source_to_detector_mm: float = 1500.0,
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
        if geometry not in GEOMETRIES:
            raise ValueError(f"geometry must be one of {GEOMETRIES}, got {geometry!r}.")
        self.fov_mm = _triple("fov_mm", fov_mm)
        self.source_to_isocenter_mm = float(source_to_isocenter_mm)
        self.source_to_detector_mm = float(source_to_detector_mm)
        if geometry == "cone":
            reach = math.sqrt(sum((f / 2) ** 2 for f in self.fov_mm))
            if not self.source_to_isocenter_mm > reach:
                raise ValueError(
                    f"source_to_isocenter_mm must put the source outside the volume (> {reach:.1f} mm, the "
                    f"half-diagonal of fov_mm), got {source_to_isocenter_mm!r}."
                )
            if not self.source_to_detector_mm >= self.source_to_isocenter_mm:
                raise ValueError(
                    "source_to_detector_mm must be at least source_to_isocenter_mm (the detector is behind the "
                    f"patient), got {source_to_detector_mm!r} < {source_to_isocenter_mm!r}."
                )
        self.geometry = geometry
        self.hu_min, self.hu_max = hu_min, hu_max
        self.views = list(views)
        self.view_size = tuple(size)
        self.mu_water = float(mu_water)
        self.k = 2.0 / (self.mu_water * sum(self.fov_mm) / 30.0)  # 2 / (mu_water * mean FOV in cm)
        self._rays: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # cone: sampling grid and path lengths
        self._coverage: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # cone: ray lengths, rays per voxel

    @property
    def num_views(self) -> int:
        return len(self.views)

    @property
    def magnification(self) -> float:
        """Detector size over the size of what it images at the volume's centre (1 for parallel beams)."""
        return self.source_to_detector_mm / self.source_to_isocenter_mm if self.geometry == "cone" else 1.0

    def detector_pixel_mm(self, view: str) -> tuple[float, float]:
        """``(H, W)`` pixel size in mm of ``view``'s X-rays of :attr:`view_size` on the detector."""
        rest = [f for i, f in enumerate(self.fov_mm) if i != VIEW_AXES[view]]
        return rest[0] * self.magnification / self.view_size[0], rest[1] * self.magnification / self.view_size[1]

    def extra_repr(self) -> str:
        cone = (
            f", source_to_isocenter_mm={self.source_to_isocenter_mm}, source_to_detector_mm="
            f"{self.source_to_detector_mm}"
            if self.geometry == "cone"
            else ""
        )
        return (
            f"views={self.views}, view_size={list(self.view_size)}, fov_mm={list(self.fov_mm)}, "
            f"hu_window={[self.hu_min, self.hu_max]}, mu_water={self.mu_water}, geometry={self.geometry}{cone}"
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
    def _ray_grid(self, spatial: Sequence[int], view: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Cone beam: the sampling points ``(1, Na, Nb, Nc, 3)`` of ``grid_sample`` (the rays' points in every slice
        across the view axis ``a``, for a detector pixel per voxel of the plane ``(b, c)``) and the rays' path
        lengths through one slice in cm, ``(Nb, Nc)``."""
        key = (tuple(int(s) for s in spatial), view, str(device))
        if key not in self._rays:
            axis = VIEW_AXES[view]
            plane = [i for i in range(3) if i != axis]
            fov = [self.fov_mm[i] for i in (axis, *plane)]
            sizes = [int(spatial[i]) for i in (axis, *plane)]
            centres = [
                (torch.arange(n, dtype=torch.float64) + 0.5) * (f / n) - f / 2 for n, f in zip(sizes, fov)
            ]  # mm, voxel centres along a, b, c
            depth, u, v = centres
            source = self.source_to_isocenter_mm
            shrink = ((source - depth) / source).view(-1, 1, 1)  # where a ray through (u, v) at the centre is
            nb = (u.view(1, -1, 1) * shrink / (fov[1] / 2)).expand(sizes)
            nc = (v.view(1, 1, -1) * shrink / (fov[2] / 2)).expand(sizes)
            na = (depth / (fov[0] / 2)).view(-1, 1, 1).expand(sizes)
            grid = torch.stack((nc, nb, na), dim=-1).unsqueeze(0).float().to(device)
            slope = torch.sqrt(1 + (u.view(-1, 1) / source) ** 2 + (v.view(1, -1) / source) ** 2)
            self._rays[key] = grid, (slope * fov[0] / sizes[0] / 10.0).float().to(device)
        return self._rays[key]

    def _line_integrals(self, mu: torch.Tensor, view: str) -> torch.Tensor:
        """Line integrals in 1/cm x cm of the attenuation ``mu`` ``(B, 1, X, Y, Z)`` along ``view``'s rays, one
        per voxel of its plane: ``(B, 1, Nb, Nc)``."""
        axis = VIEW_AXES[view]
        spatial = mu.shape[2:]
        if self.geometry == "parallel":
            return mu.sum(dim=2 + axis) * (self.fov_mm[axis] / spatial[axis] / 10.0)
        grid, length = self._ray_grid(spatial, view, mu.device)
        slices = mu.movedim(2 + axis, 2)  # (B, 1, Na, Nb, Nc): the view axis first
        points = F.grid_sample(slices, grid.expand(mu.shape[0], -1, -1, -1, -1).to(mu.dtype), align_corners=False)
        return (points * length.to(mu.dtype)).sum(dim=2)

    def _spread(self, plane: torch.Tensor, view: str, spatial: Sequence[int]) -> torch.Tensor:
        """The transpose of :meth:`_line_integrals` (cone beam): ``(B, 1, Nb, Nc)`` values along ``view``'s rays
        into ``(B, 1, X, Y, Z)``, each voxel getting a ray's value times the weight the projection gives it (the
        backward of ``grid_sample``, called as a function: it needs no autograd, and runs under inference mode)."""
        axis = VIEW_AXES[view]
        grid, length = self._ray_grid(spatial, view, plane.device)
        batch, depth = plane.shape[0], int(spatial[axis])
        per_slice = (plane * length.to(plane.dtype)).unsqueeze(2).expand(-1, -1, depth, -1, -1).contiguous()
        shape = (batch, 1, depth, *per_slice.shape[3:])
        spread, _ = torch.ops.aten.grid_sampler_3d_backward(
            per_slice,
            torch.zeros(shape, dtype=plane.dtype, device=plane.device),
            grid.expand(batch, -1, -1, -1, -1).to(plane.dtype),
            0,  # bilinear
            0,  # zeros outside
            False,  # align_corners
            [True, False],
        )
        return spread.movedim(2, 2 + axis)

    def _cone_coverage(self, spatial: Sequence[int], view: str, device: torch.device):
        """Cone beam: each ray's length inside the volume (cm, ``(1, 1, Nb, Nc)``) and the summed weights of the
        rays through each voxel (``(1, 1, X, Y, Z)``)."""
        key = (tuple(int(s) for s in spatial), view, str(device))
        if key not in self._coverage:
            ones = torch.ones((1, 1, *spatial), device=device)
            lengths = self._line_integrals(ones, view)
            self._coverage[key] = lengths, self._spread(torch.ones_like(lengths), view, spatial)
        return self._coverage[key]

    def project(self, volume: torch.Tensor, size: Sequence[int] | None = None) -> torch.Tensor:
        """Normalised line integrals ``p = k L`` of ``volume`` ``(B, 1, X, Y, Z)``: ``(B, V, H, W)``.

        Each view is integrated at the volume's own resolution (a ray per voxel of its plane), then resized to
        ``size`` (default ``view_size``) with :func:`resize_2d`.
        """
        if volume.ndim != 5 or volume.shape[1] != 1:
            raise ValueError(f"project expects a (B, 1, X, Y, Z) volume, got shape {tuple(volume.shape)}.")
        mu = self.attenuation(volume.float())
        out = [resize_2d(self._line_integrals(mu, view) * self.k, size or self.view_size) for view in self.views]
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
        unfiltered back-projection estimate of the CT. With a cone beam, several rays pass through a voxel: its value
        is their mean attenuations averaged with the weights the projection gives the voxel on each ray (the
        transpose of the projection, normalised), and a voxel no ray reaches is air.
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
            if self.geometry == "parallel":
                mean_mu = plane / (self.k * self.fov_mm[axis] / 10.0)
                out.append(self._mu_to_value(mean_mu).unsqueeze(2 + axis).expand(-1, -1, *spatial))
                continue
            # each voxel: the mean over the rays through it, weighted as the projection weights it
            lengths, weights = self._cone_coverage(spatial, view, plane.device)
            per_ray = torch.where(lengths > 0, plane / (self.k * lengths.clamp(min=1e-12)), 0.0)
            spread = self._spread(per_ray, view, spatial)
            out.append(self._mu_to_value(torch.where(weights > 0, spread / weights.clamp(min=1e-12), 0.0)))
        return torch.cat(out, dim=1)

    def _mu_to_value(self, mu: torch.Tensor) -> torch.Tensor:
        """Attenuation (1/cm) -> volume value (the inverse of :meth:`attenuation`)."""
        return self.from_hu((mu / self.mu_water - 1.0) * 1000.0)

    def mismatch(self, volume: torch.Tensor, xray: torch.Tensor) -> dict[str, torch.Tensor]:
        """How far each view's X-ray is from the volumes' native projection, ``(B, V)`` per statistic of
        :data:`MISMATCH_STATISTICS` (the X-rays area-averaged to the native plane, as :meth:`data_consistency`
        compares them):

        - ``residual``: the root mean square of measured minus projected, the size of the disagreement;
        - ``relation``: its systematic part. The line ``measured = a + b * projected`` is fitted over the view's
          pixels (least squares), and the statistic is the root mean square over the view of ``a + (b - 1) *
          projected``, the line's departure from the identity. A detector or geometry that does not match the
          projector (a gain or offset, a nonlinear response, scatter, blur) bends the relation between what is
          measured and what is projected; the error of a volume that is merely off leaves it near the identity on
          average, however large the residual. A view with a uniform projection has no slope: the mean offset.

        Args:
            volume: ``(B, 1, X, Y, Z)`` volumes in ``[-1, 1]``.
            xray: ``(B, V, H, W)`` normalised line integrals of the same cases.
        """
        by_plane: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # a volume that is not a cube: planes of sizes
        columns: dict[str, list[torch.Tensor]] = {name: [] for name in MISMATCH_STATISTICS}
        for i, view in enumerate(self.views):
            plane = view_plane(volume.shape[2:], view)
            if plane not in by_plane:
                measured = resize_2d(xray.to(volume.device).float(), plane).flatten(2)
                projected = self.project(volume, plane).float().flatten(2)
                offset = measured.mean(2) - projected.mean(2)
                centred, spread = projected - projected.mean(2, keepdim=True), projected.var(2, correction=0)
                slope = (centred * measured).mean(2) / spread.clamp_min(1e-12)
                bend = torch.where(spread > 1e-12, slope - 1.0, torch.zeros_like(slope))
                by_plane[plane] = {
                    "residual": (projected - measured).pow(2).mean(2).sqrt(),
                    "relation": (offset.pow(2) + bend.pow(2) * spread).sqrt(),
                }
            for name in MISMATCH_STATISTICS:
                columns[name].append(by_plane[plane][name][:, i])
        return {name: torch.stack(column, dim=1) for name, column in columns.items()}

    def data_consistency(
        self,
        volume: torch.Tensor,
        xray: torch.Tensor,
        weight: float = 1.0,
        noise_tolerance: float | None = None,
        view_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``volume`` moved towards agreeing with ``xray``: one simultaneous algebraic reconstruction (SIRT) step.

        For each view, the residual of the volume's native projection against the X-rays (area-averaged to the
        native plane, as the projection loss compares them) is spread uniformly along its rays as the volume value
        that projects to it (:meth:`backproject` is affine, so the difference of two back-projections is exactly
        that correction); the views' corrections are averaged and added with ``weight``. With one view and
        ``weight`` 1 the result projects exactly to the X-rays (parallel beams); with several views, or a cone beam
        (whose rays share voxels), repeated steps converge to a volume consistent with all of them: it is the
        SIRT step with the projection's exact transpose. ``weight`` 0 returns ``volume`` unchanged.

        Args:
            volume: ``(B, 1, X, Y, Z)`` volumes in ``[-1, 1]``.
            xray: ``(B, V, H, W)`` normalised line integrals of the same cases.
            weight: step size, 1 for a full step.
            noise_tolerance: with a number ``tau``, a view whose residual (root mean square, at the native plane)
                is already within ``tau`` times its X-ray's noise level (:func:`noise_level`) gives no correction:
                Morozov's discrepancy principle, so that noisy X-rays are not fitted into the volume. ``None``:
                every view corrects.
            view_weight: ``(B, V)`` factors of each view's correction (0 leaves a view out, as a view that does not
                match the projector; :class:`common.xray2ct.networks.XrayCTSampler`'s consistency check), or
                ``None`` for all 1.
        """
        if not weight:
            return volume
        spatial = volume.shape[2:]
        xray = xray.to(volume.device)
        projected = self.project_native(volume)
        difference = self.backproject(xray, spatial) - self.backproject(projected, spatial)
        if noise_tolerance is not None:  # the discrepancy principle: leave the views already within their noise
            measured = resize_2d(xray.float(), projected.shape[-2:])
            residual = (projected - measured).pow(2).mean(dim=(2, 3)).sqrt()
            outside = residual > float(noise_tolerance) * noise_level(measured)
            difference = difference * outside[:, :, None, None, None].to(difference.dtype)
        if view_weight is not None:
            difference = difference * view_weight.to(difference)[:, :, None, None, None]
        correction = difference.mean(1, keepdim=True)
        return volume + float(weight) * correction.to(volume.dtype)

    @torch.jit.unused  # a physics operator (view caches, Python geometry), not TorchScript: left out of a scripted net
    def forward(self, volume: torch.Tensor) -> torch.Tensor:
        return self.xrays(volume)
