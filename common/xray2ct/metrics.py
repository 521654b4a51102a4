# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Texture metrics of a predicted CT volume against its ground truth: does the prediction carry the ground truth's
high-frequency energy, or is it a blurred regression to the mean?

PSNR and SSIM reward the conditional mean: when the X-rays leave the fine structure of a CT undetermined, the
prediction that minimises the expected squared error is the average over all plausible volumes, which is blurred.
A realistic sample, with texture of the right strength but not at the right place, scores a lower PSNR than that
blur. The two measures below compare energies, not voxel values, and so tell the two apart.

Frequencies are in cycles per voxel: the 3D FFT coefficient with indices ``(kx, ky, kz)`` of a volume of shape
``(X, Y, Z)`` has the frequency vector ``(kx / X, ky / Y, kz / Z)`` with every component folded into
``[-0.5, 0.5)`` (``torch.fft.fftfreq``), and the radial frequency ``|f|`` is its Euclidean norm. The Nyquist
frequency of each axis is 0.5; ``|f|`` reaches ``sqrt(3) / 2`` in the corners of the frequency cube. The FFT is the
unnormalised full (complex) FFT, computed in float64, and the power of a coefficient is ``|FFT|^2`` summed over
channels.

- **High-frequency energy ratio** (:func:`high_frequency_energy_ratio`): for each volume, the power of ``pred``
  summed over all coefficients with ``|f| > cutoff``, divided by the same sum for ``target``. The default cutoff
  0.25 is half the Nyquist frequency: wavelengths below 4 voxels, i.e. structures smaller than about 4 voxels.
  1 is right, a blurred prediction scores below 1, noise pushes it above 1. It does not depend on where the
  texture is, only on how strong it is.
- **Log-spectral distance** (:func:`log_spectral_distance`): for each volume, the root mean square over radial
  frequency bins of ``log10(P_pred + eps) - log10(P_target + eps)``, where ``P`` is the radially averaged power
  spectrum (:func:`radial_power_spectrum`: the mean power of the coefficients with ``|f|`` in a bin, ``num_bins``
  equal bins over ``(0, 0.5]``, DC and the cube's corners beyond 0.5 excluded). 0 for identical spectra, in decades:
  a prediction with the whole spectrum off by a factor ``a`` in amplitude scores ``|log10(a^2)|``.

:class:`HighFrequencyRatioMetric` and :class:`SpectralDistanceMetric` wrap both for MONAI evaluators, and
:func:`texture_handlers` wraps those as ``IgniteMetricHandler`` (like
:func:`common.metrics.image.image_quality_handlers`).

The spread of several samples per case is scored as an uncertainty estimate (:func:`uncertainty_scores`): how often
the truth lies within 1 and 2 standard deviations of the mean, how well the spread ranks the voxels by their error
(Spearman), and how much of that ranking is more than an edge map: the partial rank correlation given the mean's
gradient magnitude. :func:`fit_uncertainty_scale` fits the factor that makes ``+-2`` scaled standard deviations
cover a wanted fraction of voxels.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from monai.handlers import IgniteMetricHandler, from_engine
from monai.metrics import CumulativeIterationMetric
from monai.metrics.utils import do_metric_reduction
from monai.utils import MetricReduction, convert_to_tensor

from common.runs import record_calibration
from common.utils import write_text_atomic
from common.xray2ct.drr import MISMATCH_STATISTICS

logger = logging.getLogger(__name__)

__all__ = [
    "UNCERTAINTY_SCORES",
    "HighFrequencyRatioMetric",
    "SamplerCalibration",
    "SpectralDistanceMetric",
    "conformal_bound",
    "conformal_cases",
    "fit_uncertainty_scale",
    "high_frequency_energy_ratio",
    "log_spectral_distance",
    "radial_frequency",
    "radial_power_spectrum",
    "texture_handlers",
    "uncertainty_scores",
]

_MAX_RADIAL_FREQUENCY = math.sqrt(3.0) / 2.0
"""Largest ``|f|`` of a 3D FFT (the corners of the frequency cube, reached for even sides)."""

_NEGLIGIBLE_ENERGY = torch.finfo(torch.float32).eps ** 2
"""Fraction of a target's total energy at or below which its energy above the cutoff counts as none: relative
amplitudes of about 1e-7, the rounding noise of float32 voxel values (a constant or band-limited volume)."""

_EDGE_TOLERANCE = 1e-10
"""Relative tolerance of the cutoff and the bin edges (in bin widths), far above the rounding of ``|f|``: a
coefficient whose ``|f|`` equals the cutoff up to rounding is not above it, and one on a bin edge belongs to the bin
below (bins are ``(lower, upper]``), as in exact arithmetic."""


def radial_frequency(shape: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """The radial spatial frequency ``|f|`` (cycles per voxel) of every coefficient of the full 3D FFT of a volume.

    Args:
        shape: the three spatial sizes ``(X, Y, Z)`` of the volume.
        device: device of the result.

    Returns:
        float64 tensor of shape ``(X, Y, Z)``: ``sqrt(fx^2 + fy^2 + fz^2)`` with ``fx = torch.fft.fftfreq(X)[kx]``
        etc., in the layout of ``torch.fft.fftn`` (DC at index ``(0, 0, 0)``).

    Raises:
        ValueError: when ``shape`` is not three positive integers.
    """
    sizes = tuple(shape)
    if len(sizes) != 3 or any(isinstance(s, bool) or int(s) != s or int(s) < 1 for s in sizes):
        raise ValueError(f"shape must be three positive integers (X, Y, Z), got {shape!r}.")
    fx, fy, fz = (torch.fft.fftfreq(int(n), dtype=torch.float64, device=device) for n in sizes)
    return torch.sqrt(fx[:, None, None] ** 2 + fy[None, :, None] ** 2 + fz[None, None, :] ** 2)


def _check_volume(volume: torch.Tensor, name: str) -> torch.Tensor:
    """``volume`` as a plain float64 tensor, after checking that it is batch-first 3D ``(B, C, X, Y, Z)``.

    Args:
        volume: the tensor to check.
        name: its name in the error message.

    Raises:
        ValueError: when ``volume`` is not 5D.
    """
    volume = convert_to_tensor(volume, track_meta=False)
    if volume.ndim != 5:
        raise ValueError(f"{name} must be a batch-first 5D tensor (B, C, X, Y, Z), got shape {tuple(volume.shape)!r}.")
    return volume.to(torch.float64)


def _check_pair(pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pred`` and ``target`` as float64 tensors, after checking that both are 5D and of the same shape.

    Args:
        pred: predicted volumes.
        target: ground-truth volumes.

    Raises:
        ValueError: when either is not 5D or their shapes differ.
    """
    pred, target = _check_volume(pred, "pred"), _check_volume(target, "target")
    if pred.shape != target.shape:
        raise ValueError(
            f"pred and target must have the same shape, got {tuple(pred.shape)!r} and {tuple(target.shape)!r}."
        )
    return pred, target


def _check_cutoff(cutoff: float) -> float:
    """``cutoff`` as a float, after checking that it lies in ``(0, sqrt(3) / 2)``.

    Args:
        cutoff: radial frequency in cycles per voxel.

    Raises:
        ValueError: when ``cutoff`` is not in ``(0, sqrt(3) / 2)``.
    """
    if isinstance(cutoff, bool) or not 0.0 < float(cutoff) < _MAX_RADIAL_FREQUENCY:
        raise ValueError(
            f"cutoff must be in (0, sqrt(3)/2 = {_MAX_RADIAL_FREQUENCY:.4f}) cycles per voxel, got {cutoff!r}."
        )
    return float(cutoff)


def _power(volume: torch.Tensor) -> torch.Tensor:
    """``|FFT|^2`` of each float64 ``(B, C, X, Y, Z)`` volume summed over channels, shape ``(B, X, Y, Z)``.

    Args:
        volume: float64 batch-first volumes.
    """
    spectrum = torch.fft.fftn(volume, dim=(-3, -2, -1))
    return (spectrum.real**2 + spectrum.imag**2).sum(dim=1)


def high_frequency_energy_ratio(pred: torch.Tensor, target: torch.Tensor, cutoff: float = 0.25) -> torch.Tensor:
    """Energy of ``pred`` above the radial frequency ``cutoff`` relative to that of ``target``, per volume.

    The energy is ``|FFT|^2`` (unnormalised 3D FFT, float64) summed over all channels and all coefficients with
    ``|f| > cutoff`` (:func:`radial_frequency`; ``|f| == cutoff`` is not above). 1 is right, a blurred prediction
    scores below 1, added noise above 1; scaling ``pred`` by ``a`` multiplies the ratio by ``a^2``.

    Args:
        pred: predicted volumes, batch-first ``(B, C, X, Y, Z)``.
        target: ground-truth volumes of the same shape.
        cutoff: radial frequency in cycles per voxel, in ``(0, sqrt(3) / 2)``; 0.25 (half the Nyquist frequency)
            keeps structures smaller than about 4 voxels.

    Returns:
        float64 tensor of shape ``(B,)``.

    Raises:
        ValueError: when the inputs are not 5D or differ in shape, when ``cutoff`` is out of range, or when a target
            volume has no energy above ``cutoff`` (at most ``float32_eps ** 2`` times its total energy, about
            1e-14: float32 rounding noise, e.g. a constant or band-limited volume), since the ratio is then undefined.
    """
    cutoff = _check_cutoff(cutoff)
    pred, target = _check_pair(pred, target)
    high = radial_frequency(pred.shape[2:], device=pred.device) > cutoff * (1.0 + _EDGE_TOLERANCE)
    target_power = _power(target)
    target_high = target_power[:, high].sum(dim=1)
    negligible = target_high <= _NEGLIGIBLE_ENERGY * target_power.flatten(1).sum(dim=1)
    if bool(negligible.any()):
        index = int(torch.nonzero(negligible)[0, 0])
        raise ValueError(
            f"target volume {index} has no energy above cutoff={cutoff!r} cycles per voxel "
            f"(high-frequency energy {float(target_high[index])!r}): the ratio is undefined."
        )
    return _power(pred)[:, high].sum(dim=1) / target_high


def _radial_bins(shape: Sequence[int], num_bins: int | None, device: torch.device) -> tuple[torch.Tensor, int]:
    """Radial bin index of every FFT coefficient of a volume of ``shape`` (-1 for DC and ``|f| > 0.5``).

    Args:
        shape: the three spatial sizes of the volume.
        num_bins: number of equal bins over ``(0, 0.5]``; ``None`` for ``min(shape) // 2``.
        device: device of the result.

    Returns:
        the int64 bin index of shape ``shape`` and the number of bins.

    Raises:
        ValueError: when ``num_bins`` is not a positive integer or leaves a bin without coefficients.
    """
    if num_bins is None:
        num_bins = min(int(s) for s in shape) // 2
        if num_bins < 1:
            raise ValueError(f"a volume of spatial shape {tuple(shape)!r} is too small for a radial spectrum.")
    elif isinstance(num_bins, bool) or int(num_bins) != num_bins or int(num_bins) < 1:
        raise ValueError(f"num_bins must be a positive integer or None, got {num_bins!r}.")
    num_bins = int(num_bins)
    # |f| in bin widths: bin i is (i, i + 1], up to rounding of the bin edges
    position = radial_frequency(shape, device=device) * (2 * num_bins)
    index = torch.ceil(position - _EDGE_TOLERANCE).long().clamp(min=1) - 1
    inside = (position > 0) & (position <= num_bins + _EDGE_TOLERANCE)
    index = torch.where(inside, index, torch.full_like(index, -1))
    counts = torch.bincount(index[inside], minlength=num_bins)
    if bool((counts == 0).any()):
        empty = torch.nonzero(counts == 0).flatten().tolist()
        raise ValueError(
            f"num_bins={num_bins!r} leaves radial bins {empty} of a volume of spatial shape {tuple(shape)!r} without "
            f"FFT coefficients; use at most min(shape) // 2 = {min(int(s) for s in shape) // 2} bins."
        )
    return index, num_bins


def radial_power_spectrum(volume: torch.Tensor, num_bins: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Radially averaged power spectrum of each volume.

    The power of a coefficient is ``|FFT|^2`` (unnormalised 3D FFT, float64) summed over channels; the power of a
    bin is the mean over the coefficients with ``|f|`` in that bin. The bins split ``(0, 0.5]`` cycles per voxel
    into ``num_bins`` equal half-open intervals ``(lower, upper]``; DC and the coefficients beyond 0.5 (the corners
    of the frequency cube, where only some directions are resolved) are left out. Unit-variance white noise of
    ``N`` voxels and ``C`` channels has the expected power ``C * N`` in every bin (Parseval).

    Args:
        volume: batch-first volumes ``(B, C, X, Y, Z)``.
        num_bins: number of bins; ``None`` for ``min(X, Y, Z) // 2``, so that every bin holds a coefficient
            on the shortest axis.

    Returns:
        ``(frequencies, power)``: the float64 bin centres in cycles per voxel, shape ``(num_bins,)``, and the float64
        power per volume and bin, shape ``(B, num_bins)``.

    Raises:
        ValueError: when ``volume`` is not 5D, or ``num_bins`` is not a positive integer or leaves a bin empty.
    """
    volume = _check_volume(volume, "volume")
    index, num_bins = _radial_bins(volume.shape[2:], num_bins, volume.device)
    inside = index >= 0
    bins = index[inside]
    power = _power(volume)[:, inside]
    totals = torch.zeros(power.shape[0], num_bins, dtype=torch.float64, device=volume.device)
    totals.index_add_(1, bins, power)
    counts = torch.bincount(bins, minlength=num_bins).to(torch.float64)
    frequencies = (torch.arange(num_bins, dtype=torch.float64, device=volume.device) + 0.5) / (2 * num_bins)
    return frequencies, totals / counts


def log_spectral_distance(
    pred: torch.Tensor, target: torch.Tensor, num_bins: int | None = None, eps: float = 1e-12
) -> torch.Tensor:
    """Root mean square over radial bins of the difference of the log10 radial power spectra, per volume.

    ``sqrt(mean_bins((log10(P_pred + eps) - log10(P_target + eps))^2))`` with ``P`` from
    :func:`radial_power_spectrum`: exactly 0 for identical volumes, ``log10(a^2)`` (up to ``eps``) for ``pred``
    equal to ``a`` times ``target``, positive for any other difference of the spectra. Phases are ignored: two
    volumes with the same texture strength at every scale score 0 wherever the texture is.

    Args:
        pred: predicted volumes, batch-first ``(B, C, X, Y, Z)``.
        target: ground-truth volumes of the same shape.
        num_bins: number of radial bins (see :func:`radial_power_spectrum`).
        eps: positive floor added to the power before the logarithm (for bins without energy).

    Returns:
        float64 tensor of shape ``(B,)``, in decades of power.

    Raises:
        ValueError: when the inputs are not 5D or differ in shape, ``eps`` is not positive, or ``num_bins`` is
            invalid.
    """
    if isinstance(eps, bool) or not float(eps) > 0.0:
        raise ValueError(f"eps must be positive, got {eps!r}.")
    pred, target = _check_pair(pred, target)
    _, pred_power = radial_power_spectrum(pred, num_bins)
    _, target_power = radial_power_spectrum(target, num_bins)
    difference = torch.log10(pred_power + float(eps)) - torch.log10(target_power + float(eps))
    return torch.sqrt((difference**2).mean(dim=1))


class _PerVolumeMetric(CumulativeIterationMetric):
    """A cumulative metric of one value per volume of ``(y_pred, y)``, reduced by ``reduction`` in
    :meth:`aggregate` (as in :mod:`common.diffusion.metrics`)."""

    def __init__(self, reduction: MetricReduction | str = MetricReduction.MEAN) -> None:
        super().__init__()
        self.reduction = reduction

    def _values(self, y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One value per volume, shape ``(B,)``."""
        raise NotImplementedError

    def _compute_tensor(  # type: ignore[override]
        self, y_pred: torch.Tensor, y: torch.Tensor | None = None
    ) -> torch.Tensor:
        if y is None:
            raise ValueError(f"{type(self).__name__} needs the ground truth y, got y=None.")
        return self._values(y_pred.detach(), y.detach()).reshape(-1, 1)

    def aggregate(self, reduction: MetricReduction | str | None = None) -> torch.Tensor:
        value, _ = do_metric_reduction(self.get_buffer(), reduction or self.reduction)
        return value


class HighFrequencyRatioMetric(_PerVolumeMetric):
    """:func:`high_frequency_energy_ratio` of each predicted volume against its ground truth, as a MONAI
    cumulative metric (one float64 value per volume, ``(B, 1)``; :meth:`aggregate` reduces in float32 like MONAI's
    metrics); 1 is right, below 1 is blurred.

    Args:
        cutoff: radial frequency in cycles per voxel, in ``(0, sqrt(3) / 2)``.
        reduction: reduction of :meth:`aggregate` over volumes.

    Raises:
        ValueError: when ``cutoff`` is out of range.
    """

    def __init__(self, cutoff: float = 0.25, reduction: MetricReduction | str = MetricReduction.MEAN) -> None:
        super().__init__(reduction)
        self.cutoff = _check_cutoff(cutoff)

    def _values(self, y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return high_frequency_energy_ratio(y_pred, y, cutoff=self.cutoff)


class SpectralDistanceMetric(_PerVolumeMetric):
    """:func:`log_spectral_distance` of each predicted volume against its ground truth, as a MONAI cumulative
    metric (one float64 value per volume, ``(B, 1)``; :meth:`aggregate` reduces in float32); 0 is right.

    Args:
        num_bins: number of radial bins; ``None`` for ``min(X, Y, Z) // 2`` of each volume.
        reduction: reduction of :meth:`aggregate` over volumes.

    Raises:
        ValueError: when ``num_bins`` is neither ``None`` nor a positive integer.
    """

    def __init__(self, num_bins: int | None = None, reduction: MetricReduction | str = MetricReduction.MEAN) -> None:
        super().__init__(reduction)
        if num_bins is not None and (isinstance(num_bins, bool) or int(num_bins) != num_bins or int(num_bins) < 1):
            raise ValueError(f"num_bins must be a positive integer or None, got {num_bins!r}.")
        self.num_bins = None if num_bins is None else int(num_bins)

    def _values(self, y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return log_spectral_distance(y_pred, y, num_bins=self.num_bins)


def texture_handlers(
    prefix: str = "val_",
    output_transform: Callable | None = None,
    save_details: bool = False,
    cutoff: float = 0.25,
    num_bins: int | None = None,
) -> dict[str, IgniteMetricHandler]:
    """:class:`HighFrequencyRatioMetric` and :class:`SpectralDistanceMetric` as ``IgniteMetricHandler``, keyed
    ``prefix + "hf_ratio"`` and ``prefix + "spectral_distance"``.

    Pass them as ``additional_metrics`` of a MONAI evaluator, next to a key metric such as PSNR (MONAI attaches
    metrics only when ``key_val_metric`` is given): neither is "higher is better" (the ratio is best at 1, the
    distance at 0), so neither suits model selection by the key metric as is. After an epoch,
    ``engine.state.metrics`` holds the mean over all volumes (MONAI's float32 reduction), gathered across ranks.

    Args:
        prefix: prefix of the metric names.
        output_transform: maps ``engine.state.output`` to ``(y_pred, y)``; default
            ``monai.handlers.from_engine(["pred", "label"])``.
        save_details: whether to store per-volume values in ``engine.state.metric_details``.
        cutoff: cutoff of the high-frequency energy ratio, cycles per voxel.
        num_bins: number of radial bins of the spectral distance (``None``: ``min(X, Y, Z) // 2``).

    Raises:
        ValueError: when ``cutoff`` or ``num_bins`` is invalid.
    """
    transform = from_engine(["pred", "label"]) if output_transform is None else output_transform
    metrics = {
        "hf_ratio": HighFrequencyRatioMetric(cutoff=cutoff),
        "spectral_distance": SpectralDistanceMetric(num_bins=num_bins),
    }
    return {
        f"{prefix}{name}": IgniteMetricHandler(metric_fn=metric, output_transform=transform, save_details=save_details)
        for name, metric in metrics.items()
    }


#: the per-case uncertainty scores of :func:`uncertainty_scores`, by name
UNCERTAINTY_SCORES = ("coverage_1std", "coverage_2std", "std_error_spearman", "std_error_partial_spearman")


def _ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks ``0 .. n-1`` of each row of ``(B, n)`` values, tied values sharing their average rank (as
    ``scipy.stats.rankdata(method="average") - 1``)."""
    rows = []
    for row in values:
        ordered, order = row.sort(stable=True)
        _, inverse, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
        average = counts.cumsum(0).double() - (counts.double() + 1) / 2  # the mean 0-based position of each group
        ranks = torch.empty(row.numel(), dtype=torch.float64, device=row.device)
        ranks[order] = average[inverse]
        rows.append(ranks)
    return torch.stack(rows)


def _correlation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of each row pair of ``(B, n)``; 0 for a constant row."""
    a = a - a.mean(1, keepdim=True)
    b = b - b.mean(1, keepdim=True)
    norm = (a.pow(2).sum(1) * b.pow(2).sum(1)).sqrt()
    return torch.where(norm > 0, (a * b).sum(1) / norm.clamp_min(1e-300), torch.zeros_like(norm))


def uncertainty_scores(
    mean: torch.Tensor, std: torch.Tensor, target: torch.Tensor, scale: float = 1.0
) -> dict[str, torch.Tensor]:
    """Per-case scores ``(B,)`` of a per-voxel standard deviation ``std`` (times ``scale``) as the uncertainty of the
    prediction ``mean`` against ``target`` (all ``(B, C, X, Y, Z)`` on one scale):

    - ``coverage_1std``, ``coverage_2std``: the fraction of voxels with ``|mean - target| <= k * scale * std``
      (for Gaussian errors with the right spread: 0.683 and 0.954);
    - ``std_error_spearman``: Spearman's rank correlation of ``std`` with ``|mean - target|`` over the voxels;
    - ``std_error_partial_spearman``: the same given the edge map ``|grad mean|`` (central differences), i.e. what
      the spread says about the error beyond where the edges are: ``(r_se - r_sg r_eg) / sqrt((1 - r_sg^2)(1 - r_eg^2))``
      of the rank correlations (0 when the edge map explains one of them entirely).

    Raises:
        ValueError: for shapes that differ or are not 5D, or a ``scale`` that is not positive.
    """
    if mean.shape != std.shape or mean.shape != target.shape or mean.ndim != 5:
        raise ValueError(
            f"uncertainty_scores expects three (B, C, X, Y, Z) tensors of one shape, got {tuple(mean.shape)}, "
            f"{tuple(std.shape)} and {tuple(target.shape)}."
        )
    if not float(scale) > 0:
        raise ValueError(f"scale must be positive, got {scale!r}.")
    mean, std, target = (t.detach().double() for t in (mean, std, target))
    error = (mean - target).abs()
    spread = std * float(scale)
    batch = mean.shape[0]
    scores = {f"coverage_{k}std": (error <= k * spread).flatten(1).double().mean(1) for k in (1, 2)}
    gradients = torch.gradient(mean, dim=(2, 3, 4))
    edges = torch.stack(gradients).pow(2).sum(0).sqrt()
    r_std, r_error, r_edge = (_ranks(t.reshape(batch, -1)) for t in (std, error, edges))
    se, sg, eg = _correlation(r_std, r_error), _correlation(r_std, r_edge), _correlation(r_error, r_edge)
    denominator = ((1 - sg.pow(2)) * (1 - eg.pow(2))).sqrt()
    scores["std_error_spearman"] = se
    scores["std_error_partial_spearman"] = torch.where(
        denominator > 1e-12, (se - sg * eg) / denominator.clamp_min(1e-12), torch.zeros_like(se)
    )
    return {name: value.float() for name, value in scores.items()}


def fit_uncertainty_scale(
    error: torch.Tensor, std: torch.Tensor, coverage: float = 0.95, width: float = 2.0, floor: float = 0.0
) -> float:
    """The factor ``s`` such that ``|error| <= width * s * (std + floor)`` holds for the fraction ``coverage`` of the
    voxels given (the validation cases' errors and spreads, any shapes of equal size): the ``coverage`` quantile of
    the normalised error ``|error| / (std + floor)``, divided by ``width`` - split conformal prediction with that
    score, so held-out cases like these are covered at ``coverage``. ``floor`` > 0 keeps voxels where every sample
    agrees (all clipped to air, say: no spread) from dominating the quantile; a voxel with no spread, no floor and an
    error counts as infinitely far out.

    Raises:
        ValueError: for sizes that differ, nothing given, ``coverage`` outside ``(0, 1)``, ``width`` <= 0 or
            ``floor`` < 0, or when the quantile is infinite (more than ``1 - coverage`` of the voxels have errors but
            no spread).
    """
    if error.numel() != std.numel() or error.numel() == 0:
        raise ValueError(
            f"error and std must hold the same number of voxels (> 0), got {error.numel()} and {std.numel()}."
        )
    if not 0 < float(coverage) < 1 or not float(width) > 0 or not float(floor) >= 0:
        raise ValueError(
            f"coverage must be in (0, 1), width > 0 and floor >= 0, got {coverage!r}, {width!r}, {floor!r}."
        )
    error = error.detach().double().abs().reshape(-1)
    spread = std.detach().double().reshape(-1) + float(floor)
    ratio = torch.where(spread > 0, error / spread.clamp_min(1e-300), torch.where(error > 0, torch.inf, 0.0))
    quantile = float(ratio.kthvalue(max(1, math.ceil(float(coverage) * ratio.numel()))).values)  # any size
    if not math.isfinite(quantile):
        raise ValueError(
            f"more than {1 - coverage:.1%} of the voxels have an error but no spread: no scale of the spread covers "
            f"{coverage:.0%} of them (give the spread a floor)."
        )
    return quantile / float(width)


def _conformal_rank(n: int, coverage: float) -> int:
    """``ceil((n + 1) * coverage)``, the rank of the split-conformal bound of ``n`` cases (rounded first, so that
    0.95 * 20 is 19, not 19.000000000000004)."""
    return math.ceil(round((n + 1) * float(coverage), 9))


def conformal_cases(coverage: float) -> int:
    """The fewest calibration cases whose split-conformal bound holds ``coverage``: ``n`` with a rank of at most
    ``n`` (19 for 0.95)."""
    n = 1
    while _conformal_rank(n, coverage) > n:
        n += 1
    return n


def conformal_bound(values: torch.Tensor, coverage: float) -> list[float]:
    """Per column of ``values`` (``(cases, V)``), the split-conformal ``coverage`` bound: the
    ``ceil((n + 1) * coverage)``-th smallest of the ``n`` cases, which a new case exchangeable with them exceeds with
    probability at most ``1 - coverage``. With fewer than :func:`conformal_cases` cases the largest is taken, and a
    warning gives the probability (up to ``1 / (n + 1)``) and the cases needed."""
    n = values.shape[0]
    k = _conformal_rank(n, coverage)
    if k > n:
        logger.warning(
            "calibration on %d case(s): no %.0f%% bound can be had from so few, so the largest is taken, which a "
            "clean view exceeds with probability up to %.0f%% (left uncorrected); calibrate on at least %d cases.",
            n,
            100 * coverage,
            100 / (n + 1),
            conformal_cases(coverage),
        )
        k = n
    return [float(v) for v in values.double().kthvalue(k, dim=0).values]


class SamplerCalibration:
    """Fits what a sampler learns about itself on the cases an evaluator runs (validation cases like those it will
    meet), writes it as JSON to ``path`` and records it with the weights: into the settings of the run recorded in
    ``record_dir`` (:func:`common.runs.record_calibration`), so that evaluation and inference of that run use it
    (rank 0, after every rank's cases are gathered).

    - ``consistency_reference``: per mismatch statistic (``residual`` and ``relation``,
      :meth:`common.xray2ct.drr.DRRProjector.mismatch`; ``consistency_<statistic>`` of
      :class:`common.xray2ct.engines.XrayCTEvaluator`) and per view, the split-conformal ``coverage`` bound of the
      cases' first estimates: the ``ceil((n + 1) * coverage)``-th smallest of ``n`` cases, which a new case like
      them exceeds with probability at most ``1 - coverage``. The consistency check of
      :class:`common.xray2ct.networks.XrayCTSampler` then leaves out the views of a case that fit the projector
      markedly worse, or more systematically, than these cases did. With fewer cases than that rank needs
      (:func:`conformal_cases`: 19 for 95%) the largest is taken, which a clean view exceeds with probability up
      to ``1 / (n + 1)`` per statistic, and a warning says so. Fitted when the evaluation recorded the statistics
      (any mode with a correction: ``guidance_scale`` > 0, or ``direct``/``backprojection``/``residual``).
    - ``uncertainty_scale`` and ``uncertainty_floor``: the calibrated spread is ``scale * (std + floor)``, with
      ``floor`` the median spread of those voxels (so voxels where every sample agrees still get an interval) and
      ``scale`` from :func:`fit_uncertainty_scale` (``+-width`` calibrated spreads cover ``coverage`` of the
      voxels). Fitted when the evaluation drew several samples per case and has the real CTs. Each case gives at
      most ``max_voxels`` voxels (a seeded random subset of larger volumes: the quantile's sampling error stays
      below 1e-3 of coverage). ``pred_std`` is the spread the evaluator reports, ``applied_scale * (std +
      applied_floor)`` of the samples' own ``std``; the fit is of the samples' own spread, whatever was applied.

    Args:
        path: the JSON file to write (the fitted settings, ``coverage``, ``width``, ``num_samples``, ``cases``,
            ``voxels``, ``record``).
        record_dir: the run folder whose record takes the fitted settings (``None``, or a folder without a record:
            the JSON file only).
        coverage: the fraction of voxels ``+-width`` calibrated spreads should cover, and the quantile of the
            residuals.
        width: the interval's half-width in calibrated spreads.
        applied_scale, applied_floor: the evaluator's ``uncertainty_scale`` and ``uncertainty_floor``.
        num_samples: the samples per case of the evaluation (recorded: the spread's calibration holds for this
            number only).
        max_voxels: the most voxels taken from one case.

    Raises:
        ValueError: at the end of the evaluation, when it gave nothing to fit.
    """

    def __init__(
        self,
        path: str,
        record_dir: str | None = None,
        coverage: float = 0.95,
        width: float = 2.0,
        applied_scale: float = 1.0,
        applied_floor: float = 0.0,
        num_samples: int | None = None,
        max_voxels: int = 1 << 18,
    ) -> None:
        self.path = path
        self.record_dir = record_dir
        self.coverage, self.width = float(coverage), float(width)
        self.applied_scale, self.applied_floor = float(applied_scale), float(applied_floor)
        self.num_samples = num_samples
        self.max_voxels = int(max_voxels)
        self._errors: list[torch.Tensor] = []
        self._stds: list[torch.Tensor] = []
        self._mismatch: dict[str, list[torch.Tensor]] = {name: [] for name in MISMATCH_STATISTICS}

    def attach(self, engine: Engine) -> None:
        parts = (self._errors, self._stds, *self._mismatch.values())
        engine.add_event_handler(Events.EPOCH_STARTED, lambda _: [part.clear() for part in parts])
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.collect)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self.write)

    def collect(self, engine: Engine) -> None:
        output = engine.state.output
        for name, cases in self._mismatch.items():
            if output.get(f"consistency_{name}") is not None:
                cases.extend(output[f"consistency_{name}"].detach().float().cpu())
        if output.get("pred_std") is None or output.get("label") is None:
            return
        error = (output["pred"].detach().float() - output["label"].detach().float()).abs().cpu()
        own = output["pred_std"].detach().float().cpu() / self.applied_scale - self.applied_floor  # the samples'
        for case_error, case_std in zip(error, own.clamp_min(0)):
            case_error, case_std = case_error.reshape(-1), case_std.reshape(-1)
            if case_error.numel() > self.max_voxels:
                generator = torch.Generator().manual_seed(len(self._errors))
                keep = torch.randperm(case_error.numel(), generator=generator)[: self.max_voxels]
                case_error, case_std = case_error[keep], case_std[keep]
            self._errors.append(case_error)
            self._stds.append(case_std)

    def write(self, engine: Engine) -> None:
        parts = [(self._errors, self._stds, self._mismatch)]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, parts[0])
            parts = gathered
            if dist.get_rank() != 0:
                return
        errors = [e for rank in parts for e in rank[0]]
        stds = [s for rank in parts for s in rank[1]]
        mismatch = {name: [c for rank in parts for c in rank[2][name]] for name in MISMATCH_STATISTICS}
        fitted: dict = {}
        if all(mismatch.values()):
            fitted["consistency_reference"] = {
                name: conformal_bound(torch.stack(cases), self.coverage) for name, cases in mismatch.items()
            }
        if errors:
            all_errors, all_stds = torch.cat(errors), torch.cat(stds)
            floor = float(all_stds.double().median())
            fitted["uncertainty_scale"] = fit_uncertainty_scale(all_errors, all_stds, self.coverage, self.width, floor)
            fitted["uncertainty_floor"] = floor
        if not fitted:
            raise ValueError(
                "nothing to calibrate: the consistency reference needs a sampler that checks its first estimates "
                "(guidance_scale > 0 in the diffusion mode), the spread several samples per case (num_samples > 1 "
                "in a diffusion mode) and the real CT of every case."
            )
        record = record_calibration(self.record_dir, fitted) if self.record_dir is not None else None
        result = {
            **fitted,
            "coverage": self.coverage,
            "width": self.width,
            "num_samples": self.num_samples,
            "cases": max(len(mismatch["residual"]), len(errors)),
            "voxels": sum(int(e.numel()) for e in errors),
            "record": None if record is None else str(record),
        }
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(self.path), json.dumps(result, indent=2))
        where = (
            f"recorded in {record}: evaluation and inference of this run use it"
            if record
            else "no run record here: pass these settings to evaluation and inference"
        )
        logger.info("calibration %s (%s): %s", self.path, where, json.dumps(fitted))
