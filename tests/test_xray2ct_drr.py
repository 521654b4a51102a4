# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the DRR projector (analytic line integrals of water and bone cubes, linearity under area averaging,
units, gradients, back-projection, argument checks; the cone beam against Siddon's exact voxel tracer and closed-form
line integrals, its transpose, its limit and its magnification) and the projection ("physics") loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.xray2ct.drr import VIEW_AXES, DRRProjector
from common.xray2ct.losses import ProjectionLoss, physics_noise_weight

AIR, WATER, BONE = -1.0, 0.0, 1.0  # volume values of -1000, 0 and 1000 HU in the default window (-1000, 1000)


def cube_volume(side: int, lo: tuple[int, int, int], length: tuple[int, int, int], value: float) -> torch.Tensor:
    """An air volume ``(1, 1, side, side, side)`` holding a box of ``value`` at ``lo`` with edge ``length``."""
    volume = torch.full((1, 1, side, side, side), AIR)
    (x, y, z), (a, b, c) = lo, length
    volume[:, :, x : x + a, y : y + b, z : z + c] = value
    return volume


def random_volume(shape=(2, 1, 16, 16, 16), seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen) * 2 - 1


# ---------------------------------------------------------------------------------------------- analytic cubes
@pytest.mark.parametrize("fov_mm", [(160.0, 160.0, 160.0), (160.0, 240.0, 320.0)])
def test_water_cube_gives_the_analytic_normalised_line_integral(fov_mm):
    side, lo, length = 16, (3, 5, 2), (4, 6, 7)
    projector = DRRProjector(fov_mm=fov_mm, view_size=(side, side), mu_water=0.2)
    mean_fov_cm = sum(fov_mm) / 3 / 10
    assert projector.k == pytest.approx(2.0 / (0.2 * mean_fov_cm))
    xray = projector.project(cube_volume(side, lo, length, WATER))
    assert xray.shape == (1, 2, side, side)

    voxel_cm = [f / side / 10 for f in fov_mm]
    # AP integrates along Y (axis 1) -> an (X, Z) image; lateral along X (axis 0) -> a (Y, Z) image
    for channel, axis, (h_lo, h_len), (w_lo, w_len) in [
        (0, 1, (lo[0], length[0]), (lo[2], length[2])),
        (1, 0, (lo[1], length[1]), (lo[2], length[2])),
    ]:
        expected = torch.zeros(side, side)
        path_cm = length[axis] * voxel_cm[axis]
        expected[h_lo : h_lo + h_len, w_lo : w_lo + w_len] = projector.k * 0.2 * path_cm
        torch.testing.assert_close(xray[0, channel], expected, rtol=1e-6, atol=1e-6)
        outside = expected == 0
        assert torch.equal(xray[0, channel][outside], torch.zeros(int(outside.sum())))  # air: exactly 0


def test_water_slab_through_half_the_fov_gives_one():
    side = 16
    projector = DRRProjector(fov_mm=200.0, view_size=(side, side))
    slab = torch.full((1, 1, side, side, side), AIR)
    slab[:, :, :, : side // 2] = WATER  # half of the AP ray length is water
    assert projector.project(slab)[0, 0] == pytest.approx(torch.ones(side, side), abs=1e-6)


def test_bone_cube_doubles_the_water_line_integral():
    side, lo, length = 12, (2, 3, 4), (5, 4, 3)
    projector = DRRProjector(fov_mm=(120.0, 180.0, 150.0), view_size=(side, side))
    water = projector.project(cube_volume(side, lo, length, WATER))
    bone = projector.project(cube_volume(side, lo, length, BONE))
    assert water.max() > 0
    torch.testing.assert_close(bone, 2 * water, rtol=1e-6, atol=1e-6)
    assert projector.attenuation(torch.tensor(BONE)).item() == pytest.approx(2 * 0.2)
    assert projector.attenuation(torch.tensor(AIR)).item() == 0.0


def test_hu_conversions_follow_the_window():
    projector = DRRProjector(hu_window=(-1000.0, 2000.0))
    hu = torch.tensor([-1000.0, 0.0, 500.0, 2000.0])
    values = projector.from_hu(hu)
    torch.testing.assert_close(values, torch.tensor([-1.0, -1.0 / 3.0, 0.0, 1.0]))
    torch.testing.assert_close(projector.to_hu(values), hu)
    torch.testing.assert_close(projector.attenuation(values), 0.2 * (1 + hu / 1000))


# ---------------------------------------------------------------------------------------------- linearity
def test_projection_of_an_area_averaged_volume_is_the_averaged_projection():
    projector = DRRProjector(fov_mm=(160.0, 240.0, 320.0), view_size=(8, 8))
    volume = random_volume()
    low = projector.project(F.avg_pool3d(volume, 2), (8, 8))
    high = projector.project(volume, (16, 16))
    torch.testing.assert_close(low, F.avg_pool2d(high, 2), rtol=0, atol=1e-5)
    # the default size (view_size) area-averages the full-resolution projection to the same values
    torch.testing.assert_close(projector.project(volume), low, rtol=0, atol=1e-5)


@pytest.mark.parametrize("view", sorted(VIEW_AXES))
def test_area_averaging_commutes_with_projection_for_non_cubic_volumes(view):
    projector = DRRProjector(fov_mm=(200.0, 150.0, 100.0), views=(view,), view_size=(4, 4))
    volume = random_volume((1, 1, 16, 12, 8), seed=3)
    high = projector.project_native(volume)
    low = projector.project_native(F.avg_pool3d(volume, 2))
    expected_plane = {"ap": (16, 8), "lateral": (12, 8)}[view]
    assert high.shape == (1, 1, *expected_plane)
    torch.testing.assert_close(low, F.avg_pool2d(high, 2), rtol=0, atol=1e-5)


def test_project_native_refuses_views_of_different_sizes():
    projector = DRRProjector(view_size=(8, 8))
    with pytest.raises(ValueError, match="different sizes"):
        projector.project_native(torch.zeros(1, 1, 16, 12, 8))


# ---------------------------------------------------------------------------------------------- intensity
@pytest.mark.parametrize("spatial", [(8, 8, 8), (8, 12, 6)])
def test_mismatch_is_each_views_residual_and_its_fitted_line_at_its_own_plane(spatial):
    """``mismatch``: per case and view, at the view's own plane (the X-ray area-averaged to it), ``residual`` is the
    root mean square of projected minus measured and ``relation`` the root mean square of the least-squares line
    ``measured = a + b projected`` minus the identity (numpy ``polyfit`` reference), for cubes and for volumes whose
    views differ in size. The volume's own X-rays leave neither; a detector gain and offset leave the relation
    equal to the residual (the whole disagreement is systematic), while noise leaves the relation a small part."""
    projector = DRRProjector(views=("ap", "lateral"), view_size=(24, 24))
    gen = torch.Generator().manual_seed(4)
    volume = torch.rand((2, 1, *spatial), generator=gen) * 2 - 1
    xray = torch.rand((2, 2, 24, 24), generator=gen)
    got = projector.mismatch(volume, xray)
    assert set(got) == {"residual", "relation"} and all(v.shape == (2, 2) for v in got.values())
    for v, view in enumerate(("ap", "lateral")):
        axis = VIEW_AXES[view]
        plane = [s for a, s in enumerate(spatial) if a != axis]
        projected = projector.project(volume, plane)[:, v].numpy().astype(np.float64)
        blocks = xray[:, v].numpy().reshape(2, plane[0], 24 // plane[0], plane[1], 24 // plane[1]).mean(axis=(2, 4))
        expected = np.sqrt(((projected - blocks) ** 2).mean(axis=(1, 2)))
        np.testing.assert_allclose(got["residual"][:, v].numpy(), expected, rtol=1e-5)
        for case in range(2):
            p, m = projected[case].ravel(), blocks[case].ravel()
            b, a = np.polyfit(p, m, 1)
            line = np.sqrt(((a + (b - 1) * p) ** 2).mean())
            np.testing.assert_allclose(float(got["relation"][case, v]), line, rtol=1e-3, atol=1e-6)
    if len(set(spatial)) == 1:
        native = projector.project_native(volume)
        assert all(float(s.abs().max()) < 1e-5 for s in projector.mismatch(volume, native).values())
        gained = projector.mismatch(volume, native * 1.1 + 0.05)
        torch.testing.assert_close(gained["relation"], gained["residual"], rtol=1e-4, atol=1e-6)
        noisy = projector.mismatch(volume, native + 0.05 * torch.randn(native.shape, generator=gen))
        assert bool((noisy["relation"] < 0.5 * noisy["residual"]).all())


def test_intensity_and_line_integral_are_inverse():
    p = torch.linspace(0.0, 5.0, 101)
    intensity = DRRProjector.intensity(p)
    assert intensity[0].item() == -1.0  # no attenuation: dark
    assert bool((intensity < 1).all()) and bool((intensity[1:] > intensity[:-1]).all())  # monotone, below 1
    torch.testing.assert_close(DRRProjector.line_integral(intensity), p, rtol=1e-4, atol=1e-5)
    saturated = DRRProjector.line_integral(torch.tensor([1.0, 2.0]))  # clamped at eps: finite
    assert bool(torch.isfinite(saturated).all())
    torch.testing.assert_close(saturated, torch.full((2,), -torch.log(torch.tensor(1e-6)).item()))


# ---------------------------------------------------------------------------------------------- gradients
def test_gradients_flow_back_to_the_volume():
    fov_mm = (160.0, 240.0, 320.0)
    projector = DRRProjector(fov_mm=fov_mm, view_size=(8, 8))
    volume = random_volume((1, 1, 8, 8, 8)).requires_grad_(True)
    projector.project(volume).sum().backward()
    grad = volume.grad
    assert grad is not None and bool(torch.isfinite(grad).all())
    # d p / d x of one voxel: k * voxel_cm * mu_water * (hu_max - hu_min) / 2000, summed over the two views
    per_view = [projector.k * f / 8 / 10 * 0.2 * 2000 / 2000 for f in (fov_mm[1], fov_mm[0])]
    torch.testing.assert_close(grad, torch.full_like(grad, sum(per_view)))


def test_projection_passes_gradcheck():
    projector = DRRProjector(fov_mm=(60.0, 80.0, 100.0), view_size=(2, 2))
    volume = random_volume((1, 1, 4, 4, 4), seed=1).double().requires_grad_(True)
    # the projector computes in float32: a linear map, so wide finite differences are exact up to float32 rounding
    assert torch.autograd.gradcheck(lambda v: projector.project(v).double(), (volume,), eps=1e-2, atol=1e-4)


# ---------------------------------------------------------------------------------------------- back-projection
def test_backproject_shapes_and_rays_for_non_cubic_sizes():
    projector = DRRProjector(fov_mm=(160.0, 240.0, 320.0), view_size=(16, 16))
    xray = torch.rand(2, 2, 16, 16, generator=torch.Generator().manual_seed(0)) * 2
    out = projector.backproject(xray, (8, 12, 6))
    assert out.shape == (2, 2, 8, 12, 6)
    ap, lateral = out[:, 0], out[:, 1]
    # AP rays run along Y, lateral rays along X: each channel is constant along its ray axis
    assert torch.equal(ap, ap[:, :, :1].expand_as(ap))
    assert torch.equal(lateral, lateral[:, :1].expand_as(lateral))
    assert not torch.equal(ap, ap[:, :1].expand_as(ap))  # but not along the other axes


@pytest.mark.parametrize("spatial", [(16, 16, 16), (8, 12, 6), (32, 32, 32)])
def test_backprojecting_a_uniform_volume_returns_its_value(spatial):
    projector = DRRProjector(fov_mm=(160.0, 240.0, 320.0), view_size=(16, 16))
    value = 0.3
    xray = projector.xrays(torch.full((1, 1, 16, 16, 16), value))
    out = projector.backproject(xray, spatial)
    torch.testing.assert_close(out, torch.full((1, 2, *spatial), value), rtol=0, atol=1e-5)


def test_backprojection_is_the_mean_along_each_ray():
    projector = DRRProjector(fov_mm=(160.0, 240.0, 320.0), view_size=(8, 8))
    volume = random_volume((2, 1, 8, 8, 8), seed=4)
    out = projector.backproject(projector.project_native(volume), (8, 8, 8))
    torch.testing.assert_close(out[:, 0:1], volume.mean(3, keepdim=True).expand_as(volume), rtol=0, atol=1e-5)
    torch.testing.assert_close(out[:, 1:2], volume.mean(2, keepdim=True).expand_as(volume), rtol=0, atol=1e-5)


def test_backproject_rejects_the_wrong_number_of_views():
    projector = DRRProjector(view_size=(8, 8))
    with pytest.raises(ValueError, match=r"\(1, 3, 8, 8\)"):
        projector.backproject(torch.zeros(1, 3, 8, 8), (8, 8, 8))


# ---------------------------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"views": ("ap", "pa")}, "'pa'"),
        ({"views": ("ap", "ap")}, "['ap', 'ap']"),
        ({"hu_window": (500.0, 500.0)}, "[500.0, 500.0]"),
        ({"hu_window": (800.0, -200.0)}, "[800.0, -200.0]"),
        ({"hu_window": (-1024.0, 1000.0)}, "-1024"),
        ({"view_size": (0, 16)}, "(0, 16)"),
        ({"view_size": (16,)}, "(16,)"),
        ({"fov_mm": (100.0, -5.0, 100.0)}, "-5.0"),
        ({"mu_water": 0.0}, "0.0"),
    ],
)
def test_constructor_rejects_bad_settings_naming_the_value(kwargs, text):
    with pytest.raises(ValueError) as info:
        DRRProjector(**kwargs)
    assert text in str(info.value)


@pytest.mark.parametrize("shape", [(1, 16, 16, 16), (1, 2, 8, 8, 8)])
def test_project_rejects_other_shapes(shape):
    with pytest.raises(ValueError, match=str(shape).replace("(", r"\(").replace(")", r"\)")):
        DRRProjector(view_size=(8, 8)).project(torch.zeros(shape))


# ---------------------------------------------------------------------------------------------- projection loss
def test_projection_loss_of_the_ground_truth_is_exactly_zero():
    projector = DRRProjector(fov_mm=(160.0, 240.0, 320.0), view_size=(16, 16))
    volume = random_volume((3, 1, 16, 16, 16))
    loss = ProjectionLoss(projector)(volume, projector.xrays(volume))
    assert loss.shape == (3,)
    assert torch.equal(loss, torch.zeros(3))


@pytest.mark.parametrize("view_size, source, factor", [((32, 32), 32, 2), ((16, 16), 32, 2), ((32, 32), 32, 4)])
def test_projection_loss_of_xrays_made_from_a_finer_volume_is_zero(view_size, source, factor):
    projector = DRRProjector(fov_mm=(160.0, 240.0, 320.0), view_size=view_size)
    fine = random_volume((2, 1, source, source, source), seed=2)
    coarse = F.avg_pool3d(fine, factor)
    xray = projector.xrays(fine)
    loss = ProjectionLoss(projector)(coarse, xray)
    assert loss.shape == (2,)
    # equal in exact arithmetic; in float32 the two paths sum the same attenuations in another grouping (box means
    # of factor^3 voxels, then rays of source / factor, against rays of source voxels area-averaged per pixel), each
    # path within about n eps32 |p| for sums of n <= source terms
    assert float(loss.max()) < source * torch.finfo(torch.float32).eps * float(xray.abs().max())
    assert float(ProjectionLoss(projector)(fine[:, :, ::factor, ::factor, ::factor], projector.xrays(fine)).min()) > 0


def test_projection_loss_of_a_shifted_volume_is_known_and_has_a_gradient():
    projector = DRRProjector(fov_mm=200.0, view_size=(8, 8))  # isotropic: k * mu_water * fov_cm = 2
    volume = random_volume((2, 1, 8, 8, 8), seed=5)
    xray = projector.xrays(volume)
    shifts = torch.tensor([0.05, -0.1]).view(2, 1, 1, 1, 1)
    perturbed = (volume + shifts).requires_grad_(True)
    loss = ProjectionLoss(projector)(perturbed, xray)
    # a value shift d moves mu by mu_water * d (window width 2000 HU) and p by k * mu_water * d * fov_cm = 2 d
    torch.testing.assert_close(loss.detach(), torch.tensor([0.1, 0.2]), rtol=1e-4, atol=1e-6)
    loss.sum().backward()
    assert perturbed.grad is not None and float(perturbed.grad.abs().sum()) > 0
    assert bool(torch.isfinite(perturbed.grad).all())
    assert bool((perturbed.grad[0] > 0).all()) and bool((perturbed.grad[1] < 0).all())  # towards the truth


def test_physics_noise_weight():
    alpha_bar = torch.tensor([0.9, 0.5, 0.01], dtype=torch.float64).view(3, 1, 1, 1, 1)
    weights = physics_noise_weight(alpha_bar, "alpha_bar")
    assert weights.shape == (3,) and weights.dtype == torch.float32
    torch.testing.assert_close(weights, torch.tensor([0.9, 0.5, 0.01]))
    assert torch.equal(physics_noise_weight(alpha_bar, "none"), torch.ones(3))
    with pytest.raises(ValueError, match="'snr'"):
        physics_noise_weight(alpha_bar, "snr")


# ---------------------------------------------------------------------------------------------- cone beam
FOV = (160.0, 200.0, 240.0)  # mm; half-diagonal 175 mm


def cone(n: int, source: float = 300.0, detector: float = 450.0, view_size=None) -> DRRProjector:
    return DRRProjector(
        fov_mm=FOV,
        view_size=view_size or (n, n),
        geometry="cone",
        source_to_isocenter_mm=source,
        source_to_detector_mm=detector,
    )


def voxel_centres(n: int) -> list[np.ndarray]:
    return [(np.arange(n) + 0.5) * f / n - f / 2 for f in FOV]


def rays(view: str, n: int, source: float) -> tuple[np.ndarray, list[np.ndarray]]:
    """The source and the points where the rays of ``view``'s detector pixels cross the centre's plane (mm)."""
    axis = VIEW_AXES[view]
    plane = [i for i in range(3) if i != axis]
    centres = voxel_centres(n)
    src = np.zeros(3)
    src[axis] = source
    points = []
    for u in centres[plane[0]]:
        for v in centres[plane[1]]:
            point = np.zeros(3)
            point[plane[0]], point[plane[1]] = u, v
            points.append(point)
    return src, points


def siddon(mu: np.ndarray, source: np.ndarray, target: np.ndarray) -> float:
    """The exact line integral (mm) of a piecewise-constant voxel volume over ``FOV`` along the segment
    ``source -> target`` (Siddon's algorithm: the segment cut at every voxel plane it crosses)."""
    n = np.array(mu.shape)
    size, low = np.array(FOV) / n, -np.array(FOV) / 2
    direction = target - source
    cuts = [np.array([0.0, 1.0])]
    for a in range(3):
        if abs(direction[a]) > 1e-12:
            cuts.append((low[a] + size[a] * np.arange(n[a] + 1) - source[a]) / direction[a])
    alpha = np.unique(np.concatenate(cuts))
    alpha = alpha[(alpha >= 0) & (alpha <= 1)]
    middle = source + ((alpha[:-1] + alpha[1:]) / 2)[:, None] * direction
    index = np.floor((middle - low) / size).astype(int)
    inside = np.all((index >= 0) & (index < n), axis=1)
    lengths = np.diff(alpha) * np.linalg.norm(direction)
    return float(np.sum(mu[tuple(index[inside].T)] * lengths[inside]))


@pytest.mark.parametrize("view", ["ap", "lateral"])
def test_cone_beam_matches_an_independent_siddon_ray_tracer(view):
    """Joseph's interpolating projector against Siddon's exact voxel tracer on a smooth volume that fades to air at
    the border (where the two treat the volume's edge differently): within 1.5% of the largest value, 0.25% on
    average; the parallel projection of the same volume is off by more, so the comparison sees the geometry."""
    n, source = 24, 300.0
    grid = np.meshgrid(*[np.linspace(-1, 1, n)] * 3, indexing="ij")
    window = np.prod([np.cos(np.pi / 2 * g) ** 2 for g in grid], axis=0)
    mu = 0.2 * (1.2 + np.sin(2 * grid[0]) * np.cos(1.5 * grid[1]) + 0.5 * grid[2]) * window
    src, points = rays(view, n, source)
    reference = np.array([siddon(mu, src, src + 3 * (p - src)) for p in points]).reshape(n, n) / 10.0  # cm
    volume = torch.tensor(mu, dtype=torch.float64)[None, None]
    ours = cone(n, source)._line_integrals(volume, view)[0, 0].numpy()
    parallel = DRRProjector(fov_mm=FOV, view_size=(n, n))._line_integrals(volume, view)[0, 0].numpy()
    error = np.abs(ours - reference) / reference.max()
    assert error.max() < 0.015 and error.mean() < 0.0025, (error.max(), error.mean())
    assert (np.abs(parallel - reference) / reference.max()).max() > 2 * error.max()


@pytest.mark.parametrize("view", ["ap", "lateral"])
def test_cone_beam_line_integrals_of_gaussian_blobs_are_the_closed_form(view):
    """Two Gaussian blobs, one towards the source and one towards the detector: the line integral of
    ``A exp(-r^2 / 2 s^2)`` along a line at distance ``d`` from its centre is ``A s sqrt(2 pi) exp(-d^2 / 2 s^2)``."""
    n, source, sigma, peak = 48, 300.0, 12.0, 0.3
    blobs = [np.array([30.0, 50.0, -20.0]), np.array([-25.0, -45.0, 30.0])]
    grid = np.meshgrid(*voxel_centres(n), indexing="ij")
    mu = sum(peak * np.exp(-sum((grid[i] - c[i]) ** 2 for i in range(3)) / (2 * sigma**2)) for c in blobs)
    src, points = rays(view, n, source)
    expected = []
    for point in points:
        direction = (point - src) / np.linalg.norm(point - src)
        total = 0.0
        for centre in blobs:
            offset = centre - src
            distance2 = offset @ offset - (offset @ direction) ** 2
            total += peak * sigma * np.sqrt(2 * np.pi) * np.exp(-distance2 / (2 * sigma**2))
        expected.append(total / 10.0)  # mm -> cm
    expected = np.array(expected).reshape(n, n)
    ours = cone(n, source)._line_integrals(torch.tensor(mu)[None, None], view)[0, 0].numpy()
    error = np.abs(ours - expected) / expected.max()
    assert error.max() < 0.04 and error.mean() < 0.002, (error.max(), error.mean())


def test_a_far_source_gives_the_parallel_projection_and_back_projection():
    volume = random_volume((2, 1, 16, 16, 16), 3)
    parallel = DRRProjector(fov_mm=FOV, view_size=(16, 16))
    far = cone(16, source=1e8, detector=1e8)
    torch.testing.assert_close(far.xrays(volume), parallel.xrays(volume), rtol=1e-4, atol=1e-4)
    xray = parallel.xrays(volume)
    torch.testing.assert_close(far.backproject(xray, (16, 16, 16)), parallel.backproject(xray, (16, 16, 16)))
    assert far.magnification == pytest.approx(1.0) and parallel.magnification == 1.0


@pytest.mark.parametrize("view", ["ap", "lateral"])
def test_cone_back_projection_is_the_exact_transpose_of_the_projection(view):
    projector = cone(12)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand((2, 1, 12, 12, 12), generator=gen, dtype=torch.float64)
    y = torch.rand((2, 1, 12, 12), generator=gen, dtype=torch.float64)
    ax, aty = projector._line_integrals(x, view), projector._spread(y, view, (12, 12, 12))
    assert float((ax * y).sum()) == pytest.approx(float((x * aty).sum()), rel=1e-12)


def test_cone_projection_is_affine_in_the_volume_and_has_gradients():
    projector = cone(16)
    a, b = random_volume((1, 1, 16, 16, 16), 1), random_volume((1, 1, 16, 16, 16), 2)
    torch.testing.assert_close(
        projector.xrays(0.3 * a + 0.7 * b), 0.3 * projector.xrays(a) + 0.7 * projector.xrays(b), rtol=1e-5, atol=1e-5
    )
    volume = a.clone().requires_grad_(True)
    projector.project_native(volume).sum().backward()
    assert volume.grad is not None and float(volume.grad.abs().sum()) > 0


def test_cone_data_consistency_converges_and_runs_without_autograd():
    """SIRT steps with the cone projector's transpose bring any start to the X-rays of a consistent volume; they
    also run under ``torch.inference_mode`` (evaluation), where no autograd graph can be built."""
    projector = cone(16)
    truth = random_volume((1, 1, 16, 16, 16), 4) * 0.8
    xray = projector.xrays(truth)
    volume = torch.zeros_like(truth)
    start = float((projector.project_native(volume) - xray).abs().mean())
    with torch.inference_mode():
        for _ in range(30):
            volume = projector.data_consistency(volume, xray, 1.0)
    assert float((projector.project_native(volume) - xray).abs().mean()) < 0.05 * start


def test_cone_beam_magnifies_what_is_nearer_the_source():
    """AP: the source is anterior (RAS +Y). A small dense ball 60 mm anterior of the centre casts its shadow
    farther from the image centre than the same ball 60 mm posterior (magnification ``D / (D - y)``)."""
    n, source = 32, 400.0
    grid = np.meshgrid(*voxel_centres(n), indexing="ij")
    shadows = {}
    for y in (60.0, -60.0):
        ball = ((grid[0] - 40.0) ** 2 + (grid[1] - y) ** 2 + grid[2] ** 2 < 10.0**2).astype(np.float32)
        volume = torch.tensor(ball * 2 - 1)[None, None]  # 1000 HU in air
        image = cone(n, source).project_native(volume)[0, 0]  # (X, Z)
        weight = (image - image.min()).sum(dim=1).numpy()
        shadows[y] = float((weight * voxel_centres(n)[0]).sum() / weight.sum())
    assert shadows[60.0] == pytest.approx(40.0 * source / (source - 60.0), abs=2.0)
    assert shadows[-60.0] == pytest.approx(40.0 * source / (source + 60.0), abs=2.0)
    projector = cone(16, source=1000.0, detector=1500.0)
    assert projector.detector_pixel_mm("ap") == pytest.approx((160.0 * 1.5 / 16, 240.0 * 1.5 / 16))


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"geometry": "fan"}, "'fan'"),
        ({"geometry": "cone", "source_to_isocenter_mm": 150.0}, "outside the volume"),
        ({"geometry": "cone", "source_to_isocenter_mm": 500.0, "source_to_detector_mm": 400.0}, "behind the patient"),
    ],
)
def test_cone_settings_are_checked(kwargs, text):
    with pytest.raises(ValueError, match=text):
        DRRProjector(fov_mm=FOV, **kwargs)


# ---------------------------------------------------------------------------------------------- discrepancy principle
def test_noise_level_estimates_white_noise_on_smooth_images():
    from common.xray2ct.drr import noise_level

    rows, cols = torch.meshgrid(torch.linspace(0, 1, 96), torch.linspace(0, 1, 96), indexing="ij")
    smooth = (1 + torch.sin(3 * rows) * torch.cos(2 * cols)).expand(2, 2, 96, 96)
    noise = torch.randn((2, 2, 96, 96), generator=torch.Generator().manual_seed(0))
    for sigma in (0.01, 0.05):
        estimate = noise_level(smooth + sigma * noise)
        assert estimate.shape == (2, 2)
        torch.testing.assert_close(estimate, torch.full((2, 2), sigma), rtol=0.08, atol=0)
    assert float(noise_level(smooth).max()) < 0.002  # smooth structure barely leaks in


def test_a_view_within_its_noise_is_not_fitted_and_one_outside_is():
    projector = DRRProjector(fov_mm=350.0, view_size=(32, 32))
    truth = random_volume((1, 1, 32, 32, 32), 5) * 0.5
    noise = 0.05 * torch.randn((1, 2, 32, 32), generator=torch.Generator().manual_seed(1))
    noisy = projector.xrays(truth) + noise
    kept = projector.data_consistency(truth, noisy, 1.0, noise_tolerance=1.5)
    assert torch.equal(kept, truth)  # within 1.5 x the noise level: nothing to correct
    fitted = projector.data_consistency(truth, noisy, 1.0)
    assert float((fitted - truth).abs().max()) > 0.01  # without the principle the noise goes into the volume
    far = truth.clone()
    far[..., :16, :, :] += 0.3  # the AP view's left half and the whole lateral view disagree
    moved = projector.data_consistency(far, noisy, 1.0, noise_tolerance=1.5)
    error = {name: float((v - truth).abs().mean()) for name, v in (("before", far), ("after", moved))}
    assert error["after"] < 0.7 * error["before"], error
