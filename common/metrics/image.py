# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Whole-volume image-quality metrics (PSNR, SSIM, MS-SSIM) and their ignite handlers.

All metric math is delegated to :mod:`monai.metrics`; this module only chooses parameters that work for
3D volumes of arbitrary size and wraps the metrics for MONAI evaluators.

Notes on MONAI's behaviour (MONAI 1.6.1):

- ``PSNRMetric`` of two identical volumes is ``+inf`` (``-10 * log10(0)``); ``inf`` is not ``nan``, so a mean
  over volumes that contains one identical pair is ``inf`` as well.
- ``compute_ms_ssim`` checks ``side // max(1, n_scales - 1) ** 2 > kernel_size - 1`` for every spatial side, but
  the pyramid itself additionally needs ``side // 2 ** (n_scales - 1) >= max(kernel_size, 2)`` (a valid
  convolution at the coarsest scale followed by one more 2x average pooling). :func:`ms_ssim_scales` applies
  both rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from monai.handlers import IgniteMetricHandler, from_engine
from monai.metrics import Metric, MultiScaleSSIMMetric, PSNRMetric, SSIMMetric
from monai.metrics.regression import KernelType, compute_ms_ssim
from monai.utils import MetricReduction, ensure_tuple_rep

__all__ = [
    "MS_SSIM_WEIGHTS",
    "VolumeMSSSIMMetric",
    "image_quality_handlers",
    "image_quality_metrics",
    "ms_ssim_scales",
    "ms_ssim_weights",
]

MS_SSIM_WEIGHTS: tuple[float, ...] = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)
"""Standard MS-SSIM scale weights (Wang et al., 2003), finest scale first; MONAI's default."""


def _kernel_per_dim(kernel_size: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    """Expand ``kernel_size`` to one positive integer per spatial dimension.

    Args:
        kernel_size: one kernel size for all dimensions or one per dimension.
        ndim: number of spatial dimensions.
    """
    kernel = tuple(int(k) for k in ensure_tuple_rep(kernel_size, ndim))
    if any(k < 1 for k in kernel):
        raise ValueError(f"kernel_size must be positive, got {kernel_size!r}.")
    return kernel


def _scales_fit(spatial_shape: Sequence[int], kernel: Sequence[int], n_scales: int) -> bool:
    """Whether ``compute_ms_ssim`` runs with ``n_scales`` weights on a volume of ``spatial_shape``.

    Args:
        spatial_shape: spatial sizes of the volume.
        kernel: kernel size per spatial dimension.
        n_scales: number of scales (length of the weights sequence).
    """
    weights_div = max(1, n_scales - 1) ** 2  # MONAI's explicit size check
    for side, k in zip(spatial_shape, kernel):
        if side // weights_div <= k - 1:
            return False
        # valid convolution at the coarsest scale, then one more 2x average pooling
        if side // 2 ** (n_scales - 1) < max(k, 2):
            return False
    return True


def ms_ssim_scales(spatial_shape: Sequence[int], kernel_size: int | Sequence[int] = 3, max_scales: int = 3) -> int:
    """Largest number of MS-SSIM scales (at most ``max_scales``) that MONAI's ``compute_ms_ssim`` accepts.

    Args:
        spatial_shape: spatial sizes of the volume, without batch and channel dimensions, e.g. ``(96, 96, 64)``.
        kernel_size: SSIM window size, one for all dimensions or one per dimension.
        max_scales: upper bound on the number of scales.

    Raises:
        ValueError: when the arguments are invalid or not even a single scale fits ``spatial_shape``.
    """
    shape = tuple(int(s) for s in spatial_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"spatial_shape must be a non-empty sequence of positive sizes, got {spatial_shape!r}.")
    if int(max_scales) < 1:
        raise ValueError(f"max_scales must be at least 1, got {max_scales!r}.")
    if isinstance(kernel_size, Sequence) and len(kernel_size) != len(shape):
        raise ValueError(f"kernel_size must have one entry per spatial dimension of {shape}, got {kernel_size!r}.")
    kernel = _kernel_per_dim(kernel_size, len(shape))
    for n_scales in range(int(max_scales), 0, -1):
        if _scales_fit(shape, kernel, n_scales):
            return n_scales
    raise ValueError(f"spatial shape {shape} is too small for MS-SSIM with kernel_size {kernel_size!r}.")


def ms_ssim_weights(n_scales: int, weights: Sequence[float] = MS_SSIM_WEIGHTS) -> tuple[float, ...]:
    """The first ``n_scales`` of ``weights``, renormalised to sum to 1.

    Args:
        n_scales: number of scales to keep.
        weights: per-scale weights, finest scale first.

    Raises:
        ValueError: when ``n_scales`` is not in ``[1, len(weights)]`` or the kept weights do not sum
            to a positive value.
    """
    if not 1 <= int(n_scales) <= len(weights):
        raise ValueError(f"n_scales must be in [1, {len(weights)}], got {n_scales!r}.")
    kept = [float(w) for w in weights[: int(n_scales)]]
    total = sum(kept)
    if total <= 0:
        raise ValueError(f"the first {n_scales} weights must sum to a positive value, got {tuple(kept)!r}.")
    return tuple(w / total for w in kept)


class VolumeMSSSIMMetric(MultiScaleSSIMMetric):
    """MS-SSIM for volumes of arbitrary size, with the number of scales chosen per input.

    For every input the number of scales is the largest ``n <= max_scales`` that fits the spatial shape
    (see :func:`ms_ssim_scales`), and the weights are the first ``n`` of ``weights`` renormalised to sum to 1.
    The computation itself is MONAI's ``compute_ms_ssim``. Inputs given as a list of channel-first tensors are
    processed one by one, so volumes of different sizes may be mixed. This is a MONAI cumulative metric:
    call it on batches, then ``aggregate()`` and ``reset()``; it can be wrapped by
    ``monai.handlers.IgniteMetricHandler``.

    Args:
        spatial_dims: number of spatial dimensions of the inputs (2 or 3).
        data_range: value range of the inputs (e.g. 1.0 for intensities in [0, 1]).
        kernel_type: ``"gaussian"`` or ``"uniform"``.
        kernel_size: SSIM window size, one for all dimensions or one per dimension.
        kernel_sigma: standard deviation of the Gaussian window.
        k1: stability constant of the luminance term.
        k2: stability constant of the contrast term.
        max_scales: upper bound on the number of scales.
        weights: per-scale weights, finest scale first; at least ``max_scales`` of them.
        reduction: MONAI metric reduction mode applied by ``aggregate()``.
        get_not_nans: whether ``aggregate()`` also returns the count of not-nan values.
    """

    def __init__(
        self,
        spatial_dims: int = 3,
        data_range: float = 1.0,
        kernel_type: KernelType | str = KernelType.GAUSSIAN,
        kernel_size: int | Sequence[int] = 3,
        kernel_sigma: float | Sequence[float] = 1.5,
        k1: float = 0.01,
        k2: float = 0.03,
        max_scales: int = 3,
        weights: Sequence[float] = MS_SSIM_WEIGHTS,
        reduction: MetricReduction | str = MetricReduction.MEAN,
        get_not_nans: bool = False,
    ) -> None:
        if spatial_dims not in (2, 3):
            raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims!r}.")
        if data_range <= 0:
            raise ValueError(f"data_range must be positive, got {data_range!r}.")
        if not 1 <= int(max_scales) <= len(weights):
            raise ValueError(f"max_scales must be in [1, {len(weights)}] (one weight per scale), got {max_scales!r}.")
        super().__init__(
            spatial_dims=spatial_dims,
            data_range=data_range,
            kernel_type=KernelType(kernel_type),
            kernel_size=_kernel_per_dim(kernel_size, spatial_dims),
            kernel_sigma=kernel_sigma,
            k1=k1,
            k2=k2,
            weights=tuple(float(w) for w in weights),
            reduction=reduction,
            get_not_nans=get_not_nans,
        )
        self.max_scales = int(max_scales)

    def scales_for(self, spatial_shape: Sequence[int]) -> int:
        """Number of scales used for an input with the given spatial shape.

        Args:
            spatial_shape: spatial sizes of one input, without batch and channel dimensions.
        """
        return ms_ssim_scales(spatial_shape, kernel_size=self.kernel_size, max_scales=self.max_scales)

    def weights_for(self, spatial_shape: Sequence[int]) -> tuple[float, ...]:
        """Renormalised per-scale weights used for an input with the given spatial shape.

        Args:
            spatial_shape: spatial sizes of one input, without batch and channel dimensions.
        """
        return ms_ssim_weights(self.scales_for(spatial_shape), self.weights)

    def _compute_metric(self, y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """MS-SSIM per batch item, shape (B, 1).

        Args:
            y_pred: batch-first prediction, (B, C, *spatial).
            y: batch-first reference, same shape as ``y_pred``.
        """
        if y_pred.ndim != self.spatial_dims + 2:
            raise ValueError(
                f"expected a batch-first tensor with {self.spatial_dims} spatial dimensions, "
                f"got shape {tuple(y_pred.shape)}."
            )
        return compute_ms_ssim(
            y_pred=y_pred,
            y=y,
            spatial_dims=self.spatial_dims,
            data_range=self.data_range,
            kernel_type=self.kernel_type,
            kernel_size=self.kernel_size,
            kernel_sigma=self.kernel_sigma,
            k1=self.k1,
            k2=self.k2,
            weights=self.weights_for(y_pred.shape[2:]),
        )


def image_quality_metrics(
    data_range: float = 1.0, ssim_win_size: int = 7, ms_ssim_kernel: int = 3, ms_ssim_max_scales: int = 3
) -> dict[str, Metric]:
    """PSNR, SSIM and MS-SSIM metrics for 3D volumes, keyed ``"psnr"``, ``"ssim"``, ``"ms_ssim"``.

    Every metric returns one value per volume (PSNR over the whole volume, SSIM/MS-SSIM averaged over the
    whole volume) and reduces with the mean over volumes.

    Args:
        data_range: value range of the intensities (PSNR's ``max_val``, SSIM's ``data_range``).
        ssim_win_size: Gaussian window size of SSIM.
        ms_ssim_kernel: Gaussian window size of MS-SSIM.
        ms_ssim_max_scales: upper bound on the number of MS-SSIM scales.
    """
    if data_range <= 0:
        raise ValueError(f"data_range must be positive, got {data_range!r}.")
    if ssim_win_size < 1:
        raise ValueError(f"ssim_win_size must be positive, got {ssim_win_size!r}.")
    return {
        "psnr": PSNRMetric(max_val=data_range),
        "ssim": SSIMMetric(spatial_dims=3, data_range=data_range, win_size=ssim_win_size),
        "ms_ssim": VolumeMSSSIMMetric(
            spatial_dims=3, data_range=data_range, kernel_size=ms_ssim_kernel, max_scales=ms_ssim_max_scales
        ),
    }


def image_quality_handlers(
    prefix: str = "val_",
    output_transform: Callable | None = None,
    save_details: bool = False,
    **kwargs: float | int,
) -> dict[str, IgniteMetricHandler]:
    """The metrics of :func:`image_quality_metrics` wrapped as ``IgniteMetricHandler``, keyed ``prefix + name``.

    The result can be passed as ``key_val_metric`` (its first entry, PSNR, is then the key metric) and/or
    ``additional_metrics`` of a MONAI ``SupervisedEvaluator``; after an epoch, ``engine.state.metrics`` holds
    e.g. ``"val_psnr"``: the mean over all volumes, gathered across ranks by MONAI.

    Args:
        prefix: prefix of the metric names.
        output_transform: maps ``engine.state.output`` to ``(y_pred, y)``; default
            ``monai.handlers.from_engine(["pred", "label"])``, which handles decollated (list of dicts)
            and batched (dict) outputs.
        save_details: whether to store per-volume values in ``engine.state.metric_details``.
        kwargs: forwarded to :func:`image_quality_metrics` (``data_range``, ``ssim_win_size``,
            ``ms_ssim_kernel``, ``ms_ssim_max_scales``).
    """
    transform = from_engine(["pred", "label"]) if output_transform is None else output_transform
    return {
        f"{prefix}{name}": IgniteMetricHandler(metric_fn=metric, output_transform=transform, save_details=save_details)
        for name, metric in image_quality_metrics(**kwargs).items()  # type: ignore[arg-type]
    }
