# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Texture metrics of X-ray -> CT predictions: the high-frequency energy ratio, the radial power spectrum and the
log-spectral distance, their MONAI metric classes and ignite handlers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from monai.data import DataLoader
from monai.engines import SupervisedEvaluator

from common.xray2ct.metrics import (
    HighFrequencyRatioMetric,
    SpectralDistanceMetric,
    high_frequency_energy_ratio,
    log_spectral_distance,
    radial_frequency,
    radial_power_spectrum,
    texture_handlers,
)

torch.set_num_threads(1)


def _rand(n: int, seed: int, size: int | tuple[int, int, int] = 16, channels: int = 1) -> torch.Tensor:
    shape = (size,) * 3 if isinstance(size, int) else size
    return torch.rand(n, channels, *shape, generator=torch.Generator().manual_seed(seed))


def _blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur with circular padding (a pure low-pass filter: a product in the Fourier domain)."""
    radius = max(1, math.ceil(3 * sigma))
    t = torch.arange(-radius, radius + 1, dtype=x.dtype)
    kernel = torch.exp(-(t**2) / (2 * sigma**2))
    kernel = kernel / kernel.sum()
    channels = x.shape[1]
    for dim in range(3):
        shape = [1, 1, 1]
        shape[dim] = 2 * radius + 1
        weight = kernel.reshape(1, 1, *shape).repeat(channels, 1, 1, 1, 1)
        pad = [0] * 6
        pad[2 * (2 - dim)] = pad[2 * (2 - dim) + 1] = radius  # F.pad lists the last dimension first
        x = F.conv3d(F.pad(x, pad, mode="circular"), weight, groups=channels)
    return x


def _integer_frequencies(shape: tuple[int, int, int]) -> tuple[np.ndarray, int]:
    """``q = L^2 |f|^2`` as exact integers for every coefficient of ``np.fft.fftn``, with ``L = lcm(shape)``."""
    lcm = math.lcm(*shape)
    axes = [np.rint(np.fft.fftfreq(n) * n).astype(np.int64) * (lcm // n) for n in shape]
    kx, ky, kz = np.meshgrid(*axes, indexing="ij")
    return kx**2 + ky**2 + kz**2, lcm


def _numpy_power(volume: torch.Tensor) -> np.ndarray:
    """|FFT|^2 summed over channels, (B, X, Y, Z), with numpy."""
    spectrum = np.fft.fftn(volume.double().numpy(), axes=(-3, -2, -1))
    return (np.abs(spectrum) ** 2).sum(axis=1)


# ---------------------------------------------------------------------------------------------- radial frequency
def test_radial_frequency_matches_numpy():
    shape = (4, 5, 6)
    freq = radial_frequency(shape)
    assert freq.shape == shape and freq.dtype == torch.float64
    fx, fy, fz = np.meshgrid(*(np.fft.fftfreq(n) for n in shape), indexing="ij")
    np.testing.assert_allclose(freq.numpy(), np.sqrt(fx**2 + fy**2 + fz**2), rtol=1e-15, atol=0)
    assert freq[0, 0, 0].item() == 0.0
    assert freq[1, 0, 0].item() == 0.25 and freq[0, 1, 0].item() == pytest.approx(0.2)
    assert freq.max().item() == pytest.approx(math.sqrt(0.5**2 + 0.4**2 + 0.5**2))
    assert radial_frequency((8, 8, 8)).max().item() == pytest.approx(math.sqrt(3) / 2)


# ---------------------------------------------------------------------------------------------- known values
def test_identical_volume_scores_exactly_one_and_zero():
    target = _rand(2, 0, 20)
    for pred in (target, target.clone()):
        assert torch.equal(high_frequency_energy_ratio(pred, target), torch.ones(2, dtype=torch.float64))
        assert torch.equal(log_spectral_distance(pred, target), torch.zeros(2, dtype=torch.float64))


def test_blurred_prediction_scores_below_one():
    target = _blur(_rand(2, 1, 20), 0.6)  # texture with energy above the cutoff
    mild, strong = _blur(target, 0.5), _blur(target, 1.5)
    ratio_mild, ratio_strong = high_frequency_energy_ratio(mild, target), high_frequency_energy_ratio(strong, target)
    assert ratio_mild.shape == (2,)
    assert (ratio_mild < 0.6).all() and (ratio_mild > 0.1).all()
    assert (ratio_strong < 1e-3).all()
    dist_mild, dist_strong = log_spectral_distance(mild, target), log_spectral_distance(strong, target)
    assert (dist_mild > 0.1).all()
    assert (dist_strong > dist_mild + 1.0).all()


def test_noise_on_a_smooth_volume_scores_above_one():
    smooth = _blur(_rand(2, 2, 20), 1.5)
    noisy = smooth + 0.05 * torch.randn(smooth.shape, generator=torch.Generator().manual_seed(3))
    assert (high_frequency_energy_ratio(noisy, smooth) > 10.0).all()
    assert (log_spectral_distance(noisy, smooth) > 1.0).all()
    # and the other way round: the smooth volume as a prediction of the noisy one is "blurred"
    assert (high_frequency_energy_ratio(smooth, noisy) < 0.1).all()


def test_scaling_by_two_multiplies_ratio_by_four_and_distance_is_log10_4():
    target = _rand(2, 4, 18)
    pred = _blur(target, 0.7)
    ratio = high_frequency_energy_ratio(pred, target)
    assert torch.equal(high_frequency_energy_ratio(2 * pred, target), 4 * ratio)
    assert torch.equal(high_frequency_energy_ratio(2 * target, target), torch.full((2,), 4.0, dtype=torch.float64))
    log10_4 = torch.full((2,), math.log10(4), dtype=torch.float64)
    torch.testing.assert_close(log_spectral_distance(2 * target, target), log10_4, rtol=0, atol=1e-12)
    torch.testing.assert_close(log_spectral_distance(target, 2 * target), log10_4, rtol=0, atol=1e-12)
    torch.testing.assert_close(log_spectral_distance(2 * pred, 2 * target), log_spectral_distance(pred, target))


# ---------------------------------------------------------------------------------------------- numpy reference
@pytest.mark.parametrize("cutoff", [0.1, 0.25, 0.4])
def test_ratio_matches_numpy_reference(cutoff):
    shape = (16, 18, 20)
    target = _rand(2, 5, shape, channels=2)
    pred = _blur(target, 0.8) + 0.02 * _rand(2, 6, shape, channels=2)
    q, lcm = _integer_frequencies(shape)
    scaled = round(cutoff * lcm)
    assert scaled == cutoff * lcm  # the cutoff is on the integer grid: |f| == cutoff occurs and is not "above"
    high = q > scaled**2
    expected = _numpy_power(pred)[:, high].sum(axis=1) / _numpy_power(target)[:, high].sum(axis=1)
    np.testing.assert_allclose(high_frequency_energy_ratio(pred, target, cutoff).numpy(), expected, rtol=1e-10)


def _numpy_radial_spectrum(volume: torch.Tensor, bins: int) -> np.ndarray:
    """Mean |FFT|^2 (channels summed) per bin ``(i / (2 bins), (i + 1) / (2 bins)]``, binned in exact integers."""
    q, lcm = _integer_frequencies(tuple(volume.shape[2:]))
    q4 = q * (2 * bins) ** 2  # 4 bins^2 L^2 |f|^2, compared with (i L)^2
    power = _numpy_power(volume)
    masks = [(q4 > (i * lcm) ** 2) & (q4 <= ((i + 1) * lcm) ** 2) for i in range(bins)]
    return np.stack([power[:, mask].mean(axis=1) for mask in masks], axis=1)


@pytest.mark.parametrize(
    "shape, num_bins", [((16, 18, 20), None), ((16, 18, 20), 5), ((16, 18, 20), 3), ((17, 19, 21), None)]
)
def test_radial_spectrum_and_distance_match_numpy_reference(shape, num_bins):
    volume, other = _rand(2, 7, shape, channels=2), _rand(2, 8, shape, channels=2)
    bins = min(shape) // 2 if num_bins is None else num_bins
    expected = _numpy_radial_spectrum(volume, bins)
    frequencies, spectrum = radial_power_spectrum(volume, num_bins)
    assert spectrum.shape == (2, bins) and spectrum.dtype == torch.float64
    np.testing.assert_allclose(frequencies.numpy(), (np.arange(bins) + 0.5) / (2 * bins), rtol=1e-15)
    np.testing.assert_allclose(spectrum.numpy(), expected, rtol=1e-10)
    log_diff = np.log10(_numpy_radial_spectrum(other, bins) + 1e-12) - np.log10(expected + 1e-12)
    np.testing.assert_allclose(
        log_spectral_distance(other, volume, num_bins).numpy(), np.sqrt((log_diff**2).mean(axis=1)), rtol=1e-10
    )


def test_white_noise_has_a_flat_spectrum_at_the_parseval_level():
    size, n_volumes = 16, 32
    noise = torch.randn(n_volumes, 1, size, size, size, generator=torch.Generator().manual_seed(9))
    frequencies, spectrum = radial_power_spectrum(noise)
    assert frequencies.shape == (size // 2,)
    # E|FFT|^2 = N * variance for every coefficient of unit-variance white noise (unnormalised FFT, N voxels)
    relative = spectrum.mean(dim=0) / size**3
    assert relative.mean().item() == pytest.approx(1.0, abs=0.05)
    assert ((relative - 1.0).abs() < 0.2).all(), relative
    # the power of the channels is summed
    _, two = radial_power_spectrum(torch.cat([noise, noise], dim=1))
    assert torch.equal(two, 2 * spectrum)


# ---------------------------------------------------------------------------------------------- metrics, handlers
def test_metric_classes_aggregate_the_per_volume_values():
    batches = [(_blur(t, 0.7), t) for t in (_rand(2, 10), _rand(3, 11))]
    ratio_metric, distance_metric = HighFrequencyRatioMetric(cutoff=0.3), SpectralDistanceMetric(num_bins=4)
    for pred, target in batches:
        values = ratio_metric(y_pred=pred, y=target)
        assert values.shape == (pred.shape[0], 1)
        torch.testing.assert_close(values[:, 0], high_frequency_energy_ratio(pred, target, 0.3), rtol=0, atol=0)
        assert distance_metric(y_pred=pred, y=target).shape == (pred.shape[0], 1)
    ratios = torch.cat([high_frequency_energy_ratio(p, t, 0.3) for p, t in batches])
    distances = torch.cat([log_spectral_distance(p, t, 4) for p, t in batches])
    # MONAI's do_metric_reduction reduces in float32
    assert ratio_metric.aggregate().item() == pytest.approx(ratios.mean().item(), rel=1e-6)
    assert distance_metric.aggregate().item() == pytest.approx(distances.mean().item(), rel=1e-6)
    torch.testing.assert_close(ratio_metric.get_buffer()[:, 0], ratios, rtol=0, atol=0)  # float64 per volume
    assert ratio_metric.aggregate("none").shape == (5, 1)
    assert 0 < ratio_metric.aggregate().item() < 1 and distance_metric.aggregate().item() > 0
    ratio_metric.reset()
    ratio_metric(y_pred=batches[0][1], y=batches[0][1])
    assert ratio_metric.aggregate().item() == 1.0


@pytest.mark.parametrize("decollate", [True, False])
def test_texture_handlers_in_an_evaluator(decollate):
    labels = _rand(3, 12)
    images = _blur(labels, 0.7)
    data = [{"image": images[i], "label": labels[i]} for i in range(3)]
    handlers = texture_handlers(save_details=True, cutoff=0.3)
    assert list(handlers) == ["val_hf_ratio", "val_spectral_distance"]
    evaluator = SupervisedEvaluator(
        device=torch.device("cpu"),
        val_data_loader=DataLoader(data, batch_size=2, shuffle=False, num_workers=0),
        network=torch.nn.Identity(),
        key_val_metric={"val_hf_ratio": handlers["val_hf_ratio"]},  # MONAI attaches metrics only with a key metric
        additional_metrics={"val_spectral_distance": handlers["val_spectral_distance"]},
        decollate=decollate,
    )
    evaluator.run()
    ratios = high_frequency_energy_ratio(images, labels, cutoff=0.3)
    distances = log_spectral_distance(images, labels)
    assert 0 < ratios.mean().item() < 0.5 and distances.mean().item() > 0.1
    assert evaluator.state.metrics["val_hf_ratio"] == pytest.approx(ratios.mean().item(), rel=1e-6)
    assert evaluator.state.metrics["val_spectral_distance"] == pytest.approx(distances.mean().item(), rel=1e-6)
    details = evaluator.state.metric_details["val_hf_ratio"]
    np.testing.assert_allclose(torch.as_tensor(details).reshape(-1).numpy(), ratios.numpy(), rtol=1e-10)


def test_texture_handlers_prefix_transform_and_parameters():
    transform = lambda output: (output["p"], output["t"])  # noqa: E731
    handlers = texture_handlers(prefix="test_", output_transform=transform, cutoff=0.125, num_bins=6)
    assert list(handlers) == ["test_hf_ratio", "test_spectral_distance"]
    assert handlers["test_hf_ratio"].metric_fn.cutoff == 0.125
    assert handlers["test_spectral_distance"].metric_fn.num_bins == 6
    assert all(h._output_transform is transform for h in handlers.values())


# ---------------------------------------------------------------------------------------------- bad input
def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match=r"same shape.*\(1, 1, 16, 16, 16\).*\(1, 1, 16, 16, 18\)"):
        high_frequency_energy_ratio(_rand(1, 0), _rand(1, 0, (16, 16, 18)))
    with pytest.raises(ValueError, match="same shape"):
        log_spectral_distance(_rand(2, 0), _rand(1, 0))


def test_non_5d_input_is_rejected():
    with pytest.raises(ValueError, match=r"pred must be a batch-first 5D tensor.*\(1, 16, 16, 16\)"):
        high_frequency_energy_ratio(_rand(1, 0)[0], _rand(1, 0)[0])
    with pytest.raises(ValueError, match="volume must be a batch-first 5D tensor"):
        radial_power_spectrum(_rand(1, 0)[0])
    with pytest.raises(ValueError, match="target must be a batch-first 5D tensor"):
        log_spectral_distance(_rand(1, 0), _rand(1, 0)[0])


@pytest.mark.parametrize("cutoff", [0, 0.0, -0.1, 0.9, math.sqrt(3) / 2])
def test_cutoff_out_of_range_is_rejected(cutoff):
    with pytest.raises(ValueError, match=f"cutoff must be in .*got {cutoff!r}"):
        high_frequency_energy_ratio(_rand(1, 0), _rand(1, 0), cutoff=cutoff)
    with pytest.raises(ValueError, match="cutoff must be in"):
        HighFrequencyRatioMetric(cutoff=cutoff)


def test_target_without_high_frequency_energy_is_rejected():
    target = torch.cat([_rand(1, 0), torch.full((1, 1, 16, 16, 16), 0.7)])  # volume 1 is constant
    with pytest.raises(ValueError, match="target volume 1 has no energy above cutoff=0.25"):
        high_frequency_energy_ratio(_rand(2, 1), target)
    with pytest.raises(ValueError, match="target volume 0 has no energy"):
        high_frequency_energy_ratio(_rand(1, 1), torch.zeros(1, 1, 16, 16, 16))
    # a target band-limited below the cutoff (a cosine along x at 2/16 cycles per voxel) has no energy above it,
    # also with float32 rounding
    x = torch.arange(16, dtype=torch.float64)
    cosine = (0.5 + 0.3 * torch.cos(2 * math.pi * 2 / 16 * x)).reshape(1, 1, 16, 1, 1).expand(1, 1, 16, 16, 16)
    for target in (cosine, cosine.float()):
        with pytest.raises(ValueError, match="target volume 0"):
            high_frequency_energy_ratio(_rand(1, 1), target, cutoff=0.2)
    assert high_frequency_energy_ratio(cosine, cosine, cutoff=0.1).item() == 1.0


def test_bad_bins_eps_and_shape_are_rejected():
    with pytest.raises(ValueError, match=r"num_bins=20 leaves radial bins"):
        radial_power_spectrum(_rand(1, 0), num_bins=20)
    with pytest.raises(ValueError, match="num_bins must be a positive integer"):
        radial_power_spectrum(_rand(1, 0), num_bins=0)
    with pytest.raises(ValueError, match="num_bins must be a positive integer"):
        SpectralDistanceMetric(num_bins=2.5)
    with pytest.raises(ValueError, match="too small for a radial spectrum"):
        radial_power_spectrum(_rand(1, 0, (1, 16, 16)))
    with pytest.raises(ValueError, match="eps must be positive, got 0.0"):
        log_spectral_distance(_rand(1, 0), _rand(1, 1), eps=0.0)
    with pytest.raises(ValueError, match=r"shape must be three positive integers.*\(16, 16\)"):
        radial_frequency((16, 16))
    with pytest.raises(ValueError, match="needs the ground truth"):
        HighFrequencyRatioMetric()(y_pred=_rand(1, 0))


# ---------------------------------------------------------------------------------------------- uncertainty
def _gaussian_case(seed: int, shape=(1, 1, 24, 24, 24)):
    """A prediction whose errors are Gaussian with exactly the spread ``std`` it states (varying per voxel)."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.rand(shape, generator=gen)
    std = 0.02 + 0.1 * torch.rand(shape, generator=gen)
    target = mean + std * torch.randn(shape, generator=gen, dtype=torch.float64).float()
    return mean, std, target


def test_a_right_spread_covers_the_gaussian_fractions():
    from common.xray2ct.metrics import uncertainty_scores

    mean, std, target = _gaussian_case(0)
    scores = uncertainty_scores(mean, std, target)
    assert float(scores["coverage_1std"]) == pytest.approx(0.6827, abs=0.01)
    assert float(scores["coverage_2std"]) == pytest.approx(0.9545, abs=0.006)
    half = uncertainty_scores(mean, std, target, scale=0.5)  # a spread half too small covers +-1 and +-0.5 sigma
    assert float(half["coverage_2std"]) == pytest.approx(float(scores["coverage_1std"]), abs=1e-6)


def test_rank_correlations_match_scipy_and_a_regression_on_the_edge_map():
    """Spearman against scipy; the partial rank correlation against the correlation of the residuals of both ranks
    regressed on the edge map's ranks (numpy least squares), a computation of its own."""
    from scipy.stats import rankdata, spearmanr

    from common.xray2ct.metrics import uncertainty_scores

    mean, std, target = _gaussian_case(1, (2, 1, 12, 12, 12))
    std = std + 0.5 * torch.stack(torch.gradient(mean, dim=(2, 3, 4))).pow(2).sum(0).sqrt()  # partly an edge map
    std[0, 0, :2] = 0.05  # ties
    scores = uncertainty_scores(mean, std, target)
    for i in range(2):
        error = (mean[i] - target[i]).abs().double().numpy().ravel()
        spread = std[i].double().numpy().ravel()
        assert float(scores["std_error_spearman"][i]) == pytest.approx(spearmanr(spread, error)[0], abs=1e-6)
        edges = np.sqrt(sum(g**2 for g in np.gradient(mean[i, 0].double().numpy()))).ravel()
        design = np.stack([np.ones_like(edges), rankdata(edges)], axis=1)

        def residual(values):
            ranks = rankdata(values)
            return ranks - design @ np.linalg.lstsq(design, ranks, rcond=None)[0]

        partial = np.corrcoef(residual(spread), residual(error))[0, 1]
        assert float(scores["std_error_partial_spearman"][i]) == pytest.approx(partial, abs=1e-6)


def test_a_spread_that_is_only_an_edge_map_says_nothing_beyond_it():
    from common.xray2ct.metrics import uncertainty_scores

    gen = torch.Generator().manual_seed(2)
    mean = torch.rand((1, 1, 16, 16, 16), generator=gen, dtype=torch.float64)  # no rounding ties in 3 x edges
    edges = torch.stack(torch.gradient(mean, dim=(2, 3, 4))).pow(2).sum(0).sqrt()
    target = mean + edges * torch.randn(mean.shape, generator=gen, dtype=torch.float64)  # errors grow with the edges
    scores = uncertainty_scores(mean, edges * 3 + 0.01, target)  # a spread that is the edge map itself
    assert float(scores["std_error_spearman"]) > 0.3
    assert abs(float(scores["std_error_partial_spearman"])) < 1e-6


def test_the_fitted_scale_covers_what_it_was_fitted_for():
    from common.xray2ct.metrics import fit_uncertainty_scale, uncertainty_scores

    mean, std, target = _gaussian_case(3)
    scale = fit_uncertainty_scale(mean - target, std * 3, coverage=0.95, width=2.0)  # a spread 3x too wide
    assert scale == pytest.approx(1.96 / 2 / 3, rel=0.03)
    covered = float(uncertainty_scores(mean, std * 3, target, scale=scale)["coverage_2std"])
    assert 0.95 <= covered < 0.95 + 1 / mean.numel() + 1e-9
    with pytest.raises(ValueError, match="error but no spread"):
        fit_uncertainty_scale(torch.ones(100), torch.zeros(100))
    # a floor gives voxels where every sample agreed an interval: |e| / (0 + 0.5) = 2, so s = 2 / width
    assert fit_uncertainty_scale(torch.ones(100), torch.zeros(100), floor=0.5) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="same number of voxels"):
        fit_uncertainty_scale(torch.ones(10), torch.ones(9))
    with pytest.raises(ValueError, match="three"):
        uncertainty_scores(mean, std[..., :3], target)
