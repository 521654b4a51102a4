# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Metrics of generative models: diversity of generated volumes (mean pairwise MS-SSIM between the samples drawn
for one input) and per-volume values an evaluator computes itself (e.g. a held-out denoising loss).

Generative models of medical images report sample diversity as the MS-SSIM between pairs of samples (lower is
more diverse; Pinaya et al. 2022 for 3D brain MRI): a model that collapses to one output scores 1. The MS-SSIM
itself is :class:`common.metrics.image.VolumeMSSSIMMetric` (MONAI's ``compute_ms_ssim`` with scales that fit
the volume).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import combinations

import torch
from monai.handlers import IgniteMetricHandler, from_engine
from monai.metrics import CumulativeIterationMetric
from monai.metrics.utils import do_metric_reduction
from monai.utils import MetricReduction

from common.metrics.image import VolumeMSSSIMMetric, image_quality_handlers

__all__ = [
    "OutputValueMetric",
    "SampleDiversityMetric",
    "diffusion_metric_handlers",
    "output_value_handler",
    "sample_diversity_handler",
]


class _ReducedMetric(CumulativeIterationMetric):
    """A cumulative metric of one value per volume, reduced by ``reduction`` in :meth:`aggregate`."""

    def __init__(self, reduction: MetricReduction | str = MetricReduction.MEAN) -> None:
        super().__init__()
        self.reduction = reduction

    def aggregate(self, reduction: MetricReduction | str | None = None) -> torch.Tensor:
        value, _ = do_metric_reduction(self.get_buffer(), reduction or self.reduction)
        return value


class SampleDiversityMetric(_ReducedMetric):
    """Mean MS-SSIM over all pairs of the ``num_samples`` consecutive samples of each input (one value per input).

    Predictions are batch-first ``(B x num_samples, C, *spatial)`` with the samples of one input next to each
    other (what :class:`common.diffusion.engines.DiffusionEvaluator` returns). ``y`` is ignored.

    Args:
        num_samples: samples per input (at least 2).
        data_range: value range of the samples (1.0 for ``[0, 1]``).
        kernel_size: MS-SSIM window size.
        max_scales: upper bound on the number of MS-SSIM scales.
        reduction: reduction of :meth:`aggregate` over inputs.
    """

    def __init__(
        self,
        num_samples: int,
        data_range: float = 1.0,
        kernel_size: int = 3,
        max_scales: int = 3,
        reduction: MetricReduction | str = MetricReduction.MEAN,
    ) -> None:
        super().__init__(reduction)
        if isinstance(num_samples, bool) or int(num_samples) < 2:
            raise ValueError(f"sample diversity needs at least 2 samples per input, got num_samples={num_samples!r}.")
        self.num_samples = int(num_samples)
        self.ms_ssim = VolumeMSSSIMMetric(
            spatial_dims=3, data_range=data_range, kernel_size=kernel_size, max_scales=max_scales
        )

    def _compute_tensor(self, y_pred: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        if y_pred.shape[0] % self.num_samples:
            raise ValueError(
                f"{y_pred.shape[0]} predictions are not a multiple of num_samples={self.num_samples}: the samples "
                "of each input must be consecutive."
            )
        pairs = list(combinations(range(self.num_samples), 2))
        first = [i for i, _ in pairs]
        second = [j for _, j in pairs]
        values = []
        for group in y_pred.float().split(self.num_samples):
            values.append(self.ms_ssim._compute_metric(group[first], group[second]).mean().reshape(1, 1))
        return torch.cat(values)


def sample_diversity_handler(
    num_samples: int, output_transform: Callable | None = None, save_details: bool = False, **kwargs
) -> IgniteMetricHandler:
    """:class:`SampleDiversityMetric` as an ``IgniteMetricHandler`` of a MONAI evaluator (``pred`` samples)."""
    transform = from_engine(["pred", "pred"]) if output_transform is None else output_transform
    return IgniteMetricHandler(
        metric_fn=SampleDiversityMetric(num_samples, **kwargs), output_transform=transform, save_details=save_details
    )


class OutputValueMetric(_ReducedMetric):
    """Collects a per-volume value the evaluator already computed (``y_pred``: ``(B,)`` or ``(B, 1)``), reduced
    over volumes (and gathered over ranks by ``IgniteMetricHandler``) like any other metric."""

    def _compute_tensor(self, y_pred: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        return torch.as_tensor(y_pred).detach().float().reshape(-1, 1)


def output_value_handler(key: str, save_details: bool = False) -> IgniteMetricHandler:
    """:class:`OutputValueMetric` of ``engine.state.output[key]`` as an ``IgniteMetricHandler``."""
    return IgniteMetricHandler(
        metric_fn=OutputValueMetric(), output_transform=from_engine([key, key]), save_details=save_details
    )


def diffusion_metric_handlers(
    conditional: bool = True,
    num_samples: int = 1,
    denoise_loss: bool = True,
    prefix: str = "val_",
    save_details: bool = False,
) -> dict[str, IgniteMetricHandler]:
    """The validation metrics of a diffusion model, keyed ``prefix + name``.

    ``psnr``, ``ssim``, ``ms_ssim`` of every sample against the real target (conditional tasks, see
    :func:`common.metrics.image.image_quality_handlers`); ``sample_ms_ssim``, the mean MS-SSIM between the samples
    of one input (with ``num_samples >= 2``; lower is more diverse); ``denoise_loss``, the held-out denoising
    loss per volume (the evaluator's ``denoise_loss`` output).
    """
    metrics: dict[str, IgniteMetricHandler] = {}
    if conditional:
        metrics.update(image_quality_handlers(prefix=prefix, save_details=save_details))
    if int(num_samples) >= 2:
        metrics[f"{prefix}sample_ms_ssim"] = sample_diversity_handler(int(num_samples), save_details=save_details)
    if denoise_loss:
        metrics[f"{prefix}denoise_loss"] = output_value_handler("denoise_loss", save_details=save_details)
    if not metrics:
        raise ValueError("no validation metric: an unconditional model needs num_samples >= 2 or denoise_loss.")
    return metrics
