# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for common.metrics.image against closed forms and MONAI's own implementations."""

from __future__ import annotations

import math

import pytest
import torch
from monai.metrics import MultiScaleSSIMMetric, PSNRMetric, SSIMMetric
from monai.metrics.regression import compute_ms_ssim

from common.metrics.image import (
    MS_SSIM_WEIGHTS,
    VolumeMSSSIMMetric,
    image_quality_metrics,
    ms_ssim_scales,
    ms_ssim_weights,
)


def _dyadic_volume(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random volume of multiples of 1/128 in [0, 0.5): sums with 1/8 are exact in float32."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, shape, generator=gen).float() / 128.0


def _rand(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- PSNR


@pytest.mark.parametrize("data_range", [1.0, 2.0])
def test_psnr_constant_offset_closed_form(data_range: float) -> None:
    d = 0.125
    x = _dyadic_volume((2, 1, 8, 10, 6))
    psnr = image_quality_metrics(data_range=data_range)["psnr"]
    values = psnr(x + d, x)
    expected = 20 * math.log10(data_range) - 10 * math.log10(d**2)
    assert values.shape == (2, 1)
    assert torch.allclose(values, torch.full_like(values, expected), rtol=1e-6)
    if data_range == 1.0:
        assert expected == pytest.approx(10 * math.log10(1 / d**2))


def test_psnr_of_identical_volumes_is_inf() -> None:
    x = _rand((1, 1, 8, 8, 8))
    psnr = PSNRMetric(max_val=1.0)
    assert torch.isposinf(psnr(x, x)).all()
    # inf is not nan, so the mean over volumes including an identical pair is inf as well
    psnr(x + 0.1, x)
    assert math.isinf(psnr.aggregate().item())


# ---------------------------------------------------------------- SSIM


def test_ssim_identical_is_one_and_distortions_lower_it() -> None:
    ssim = image_quality_metrics()["ssim"]
    x = _rand((1, 1, 16, 16, 16))
    assert ssim(x, x).item() == pytest.approx(1.0, abs=1e-5)
    affine = ssim(0.5 * x + 0.2, x).item()
    noise = ssim(_rand((1, 1, 16, 16, 16), seed=1), x).item()
    assert affine < 0.999
    assert noise < 0.2
    assert noise < affine


@pytest.mark.parametrize(("c1", "c2", "data_range"), [(0.02, 0.05, 1.0), (0.01, 0.03, 1.0), (1.0, 2.5, 100.0)])
def test_ssim_constant_volumes_closed_form(c1: float, c2: float, data_range: float) -> None:
    # constant volumes: structure/contrast term is 1, only the luminance term remains.
    # Intensities are kept small relative to data_range: MONAI computes the local variance as
    # E[x^2] - E[x]^2 in float32, whose cancellation error (~1e-7 * c^2) is then divided by
    # C2 = (0.03 * L)^2; for bright constants (c ~ 0.5 L) this alone shifts SSIM by ~1e-3.
    k1_const = (0.01 * data_range) ** 2
    expected = (2 * c1 * c2 + k1_const) / (c1**2 + c2**2 + k1_const)
    a = torch.full((1, 1, 12, 12, 12), c1)
    b = torch.full((1, 1, 12, 12, 12), c2)
    ssim = SSIMMetric(spatial_dims=3, data_range=data_range, win_size=7)
    assert ssim(a, b).item() == pytest.approx(expected, abs=1e-5)
    # MS-SSIM of constants: contrast terms are 1, the coarsest scale contributes luminance ** weight
    ms_ssim = VolumeMSSSIMMetric(data_range=data_range)
    last_weight = ms_ssim_weights(3)[-1]
    assert ms_ssim(a, b).item() == pytest.approx(expected**last_weight, abs=1e-5)


def test_image_quality_metrics_parameters() -> None:
    metrics = image_quality_metrics(data_range=2.0, ssim_win_size=5, ms_ssim_kernel=5, ms_ssim_max_scales=2)
    assert set(metrics) == {"psnr", "ssim", "ms_ssim"}
    assert isinstance(metrics["psnr"], PSNRMetric) and metrics["psnr"].max_val == 2.0
    assert isinstance(metrics["ssim"], SSIMMetric)
    assert metrics["ssim"].data_range == 2.0 and tuple(metrics["ssim"].kernel_size) == (5, 5, 5)
    ms = metrics["ms_ssim"]
    assert isinstance(ms, VolumeMSSSIMMetric)
    assert ms.data_range == 2.0 and tuple(ms.kernel_size) == (5, 5, 5) and ms.max_scales == 2
    with pytest.raises(ValueError, match="-1.0"):
        image_quality_metrics(data_range=-1.0)


# ---------------------------------------------------------------- MS-SSIM scale choice


@pytest.mark.parametrize(
    ("side", "max_scales", "expected"),
    [(16, 3, 3), (24, 3, 3), (32, 3, 3), (64, 3, 3), (16, 5, 3), (24, 5, 3), (32, 5, 4), (64, 5, 5), (8, 3, 2)],
)
def test_ms_ssim_scales_for_cubes(side: int, max_scales: int, expected: int) -> None:
    assert ms_ssim_scales((side,) * 3, kernel_size=3, max_scales=max_scales) == expected


@pytest.mark.parametrize("kernel_size", [1, 3, 5])
def test_ms_ssim_scales_matches_what_monai_accepts(kernel_size: int) -> None:
    # the rule is dimension independent; check it against MONAI on cheap 2D inputs
    for side in range(1, 70):
        shape = (side, 64)
        try:
            n = ms_ssim_scales(shape, kernel_size=kernel_size, max_scales=5)
        except ValueError:
            n = 0
        x = _rand((1, 1, *shape))
        if n > 0:
            compute_ms_ssim(x, x, spatial_dims=2, kernel_size=kernel_size, weights=MS_SSIM_WEIGHTS[:n])
        if n < 5:
            with pytest.raises((ValueError, RuntimeError)):
                compute_ms_ssim(x, x, spatial_dims=2, kernel_size=kernel_size, weights=MS_SSIM_WEIGHTS[: n + 1])


def test_ms_ssim_scales_too_small_names_shape() -> None:
    with pytest.raises(ValueError, match=r"\(2, 16, 16\)"):
        ms_ssim_scales((2, 16, 16), kernel_size=3)
    with pytest.raises(ValueError, match="max_scales"):
        ms_ssim_scales((16, 16, 16), max_scales=0)
    metric = VolumeMSSSIMMetric()
    with pytest.raises(ValueError, match=r"\(2, 16, 16\)"):
        metric(torch.rand(1, 1, 2, 16, 16), torch.rand(1, 1, 2, 16, 16))


def test_ms_ssim_weights_renormalised() -> None:
    w = ms_ssim_weights(3)
    assert sum(w) == pytest.approx(1.0)
    total = sum(MS_SSIM_WEIGHTS[:3])
    assert w == pytest.approx(tuple(v / total for v in MS_SSIM_WEIGHTS[:3]))
    assert ms_ssim_weights(5) == pytest.approx(tuple(v / sum(MS_SSIM_WEIGHTS) for v in MS_SSIM_WEIGHTS))
    with pytest.raises(ValueError, match="6"):
        ms_ssim_weights(6)


# ---------------------------------------------------------------- MS-SSIM values


def test_volume_ms_ssim_identical_is_one() -> None:
    x = _rand((2, 1, 24, 24, 24))
    assert torch.allclose(VolumeMSSSIMMetric()(x, x), torch.ones(2, 1), atol=1e-5)


@pytest.mark.parametrize(("max_scales", "n_scales"), [(3, 3), (5, 4)])
def test_volume_ms_ssim_equals_monai_on_32_cube(max_scales: int, n_scales: int) -> None:
    y = _rand((2, 1, 32, 32, 32))
    x = (0.7 * y + 0.3 * _rand((2, 1, 32, 32, 32), seed=1)).clamp(0, 1)
    ours = VolumeMSSSIMMetric(kernel_size=3, max_scales=max_scales)
    assert ours.scales_for((32, 32, 32)) == n_scales
    weights = ms_ssim_weights(n_scales)
    reference = MultiScaleSSIMMetric(spatial_dims=3, data_range=1.0, kernel_size=3, weights=weights)
    expected = reference(x, y)
    actual = ours(x, y)
    assert 0.0 < actual.min().item() < 1.0
    assert torch.allclose(actual, expected, atol=1e-6)


def test_volume_ms_ssim_non_cubic_and_mixed_sizes() -> None:
    metric = VolumeMSSSIMMetric()
    y = _rand((1, 1, 40, 48, 36))
    x = (y + 0.05 * _rand((1, 1, 40, 48, 36), seed=3)).clamp(0, 1)
    value = metric(x, y).item()
    assert 0.0 < value < 1.0
    # a list of channel-first volumes of different sizes is processed item by item
    small = _rand((1, 10, 12, 9), seed=4)
    values = metric([x[0], small], [y[0], small])
    assert values.shape == (2, 1)
    assert values[0].item() == pytest.approx(value, abs=1e-6)
    assert values[1].item() == pytest.approx(1.0, abs=1e-5)
    assert metric.scales_for((10, 12, 9)) == 2


def test_volume_ms_ssim_is_cumulative() -> None:
    metric = VolumeMSSSIMMetric()
    y = _rand((3, 1, 16, 16, 16))
    x = (y + 0.1 * _rand((3, 1, 16, 16, 16), seed=5)).clamp(0, 1)
    first = metric(x[:2], y[:2])
    second = metric(x[2:], y[2:])
    expected = torch.cat([first, second]).mean().item()
    assert metric.aggregate().item() == pytest.approx(expected, rel=1e-6)
    metric.reset()
    metric(x[:1], x[:1])
    assert metric.aggregate().item() == pytest.approx(1.0, abs=1e-5)


def test_volume_ms_ssim_argument_checks() -> None:
    with pytest.raises(ValueError, match="6"):
        VolumeMSSSIMMetric(max_scales=6)
    with pytest.raises(ValueError, match="4"):
        VolumeMSSSIMMetric(spatial_dims=4)
    with pytest.raises(ValueError):
        VolumeMSSSIMMetric(kernel_type="box")
