# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The checks of the survival family's settings, one per concern (see :mod:`common.config_checks`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common.config_checks import CASE_RUN_CHECKS, TRAINING_RUN_CHECKS, SettingsChecks, choice_problems, switches
from common.data.intensity import intensity_problems
from common.data.pipeline import cache_problems, orientation_problems, spacing_problems
from common.engines.trainer import accumulation_problems
from common.survival.cohort import SPLIT_NAMES, TIME_UNITS
from common.survival.networks import BACKBONES, HEADS, widen_factor_problem

__all__ = [
    "INFERENCE",
    "TRAINING",
    "cache_rate_problems",
    "check_training_size",
    "covariate_problems",
    "image_size_problems",
    "inference_batch_problems",
    "key_metric_problems",
    "network_problems",
    "size_problems",
    "split_problems",
    "time_axis_problems",
]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_training_size(num_cases: int, batch_size: int) -> None:
    """The training loader drops an incomplete last batch (a batch of one case breaks BatchNorm in training mode and
    gives the Cox partial likelihood no risk set), so the training split must fill at least one total batch.

    Raises:
        ValueError: naming ``batch_size`` when the training split is smaller than it.
    """
    if int(num_cases) < int(batch_size):
        raise ValueError(
            f"the training split has {num_cases} case(s), fewer than 'batch_size' {batch_size} (the total batch "
            "across all GPUs; an incomplete last batch is dropped): lower --batch_size."
        )


def network_problems(survival_head: str, backbone: str, widen_factor: float, conv1_t_stride: int) -> list[str]:
    """A known head and backbone, a valid width and a positive stem stride."""
    problems = choice_problems(survival_head=(survival_head, HEADS), backbone=(backbone, BACKBONES))
    width_problem = widen_factor_problem(widen_factor)
    if width_problem:
        problems.append(width_problem)
    if not _positive_int(conv1_t_stride):
        problems.append(
            f"'conv1_t_stride' must be a positive integer (2 is the usual ResNet stem; 1 costs ~8x the FLOPs), "
            f"got {conv1_t_stride!r}."
        )
    return problems


def time_axis_problems(
    survival_head: str,
    num_intervals: int | None,
    cut_points: Sequence[float] | None,
    horizons: Sequence[float],
    time_unit: str,
) -> list[str]:
    """The discrete-time head's intervals (``num_intervals``, or ``cut_points`` from 0, increasing), the evaluation
    ``horizons`` (positive, increasing years) and a known ``time_unit``."""
    problems = []
    if survival_head == "logistic_hazard" and cut_points is None and not _positive_int(num_intervals):
        problems.append(f"'num_intervals' must be a positive integer, got {num_intervals!r}.")
    if cut_points is not None:
        points = list(cut_points) if isinstance(cut_points, (list, tuple)) else None
        if not points or len(points) < 2 or any(isinstance(c, bool) or not isinstance(c, (int, float)) for c in points):
            problems.append(f"'cut_points' must be a list of at least 2 numbers (years, from 0), got {cut_points!r}.")
        elif points[0] != 0 or any(b <= a for a, b in zip(points, points[1:])):
            problems.append(f"'cut_points' must start at 0 and increase strictly, got {points}.")
    values = list(horizons) if isinstance(horizons, (list, tuple)) else None
    if not values or any(isinstance(h, bool) or not isinstance(h, (int, float)) or not h > 0 for h in values):
        problems.append(f"'horizons' must be a non-empty list of positive numbers of years, got {horizons!r}.")
    elif any(b <= a for a, b in zip(values, values[1:])):
        problems.append(f"'horizons' must increase strictly, got {values}.")
    return problems + choice_problems(time_unit=(time_unit, TIME_UNITS))


def size_problems(batch_size: int, image_size: Sequence[int], val_fraction: float) -> list[str]:
    """A positive batch, a 3D ``image_size`` and a validation share in [0, 1)."""
    problems = []
    if not _positive_int(batch_size):
        problems.append(
            f"'batch_size' (the total batch across all GPUs) must be a positive integer, got {batch_size!r}."
        )
    problems += image_size_problems(image_size)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        problems.append(f"'val_fraction' must be in [0, 1), got {val_fraction!r}.")
    return problems


def image_size_problems(image_size: Sequence[int]) -> list[str]:
    """The size every volume is padded or cropped to: 3 positive integers (the network is 3D)."""
    size = list(image_size) if isinstance(image_size, (list, tuple)) else None
    if not size or len(size) != 3 or not all(_positive_int(s) for s in size):
        return [f"'image_size' must be 3 positive integers, got {image_size!r}."]
    return []


def covariate_problems(covariates: Sequence[str]) -> list[str]:
    """``covariates``: distinct CSV column names."""
    names = list(covariates) if isinstance(covariates, (list, tuple)) else None
    if names is None or not all(isinstance(c, str) and c for c in names) or len(set(names)) != len(names):
        return [f"'covariates' must be a list of distinct CSV column names, got {covariates!r}."]
    return []


def key_metric_problems(key_metric: str) -> list[str]:
    """A metric the survival evaluator reports."""
    known = ("uno_c", "harrell_c", "auc_mean", "ibs")
    if key_metric not in known and not str(key_metric).startswith(("auc_", "brier_")):
        return [f"'key_metric' must be one of {known} or auc_<h>/brier_<h>, got {key_metric!r}."]
    return []


def cache_rate_problems(cache_rate: float, replace_rate: float, calibration_cache_rate: float) -> list[str]:
    """:func:`common.data.pipeline.cache_problems`, with the calibration set's cache rate."""
    return cache_problems(cache_rate, replace_rate, calibration_cache_rate=calibration_cache_rate)


TRAINING = SettingsChecks(
    "survival",
    network_problems,
    time_axis_problems,
    size_problems,
    accumulation_problems,
    covariate_problems,
    key_metric_problems,
    switches(
        "compile", "sync_batchnorm", "augment", "crop_foreground", "preflight", "allow_irregular_series", "oom_backoff"
    ),
    intensity_problems,
    cache_rate_problems,
    *TRAINING_RUN_CHECKS,
)
"""The checks of a survival training run (``train.json``, and evaluation on top of it): besides the checks above,
on/off settings that are not booleans (a string ``"false"`` is true) and an invalid ``intensity``
(:func:`common.data.intensity.intensity_problems`)."""


def inference_batch_problems(batch_size: int) -> list[str]:
    """Inference's cases per forward pass: a positive integer."""
    if _positive_int(batch_size):
        return []
    return [f"'batch_size' must be a positive integer (cases per forward pass), got {batch_size!r}."]


def split_problems(split: str | None) -> list[str]:
    """The split of the cohort CSV inference keeps: a split column value of :data:`common.survival.cohort.SPLIT_NAMES`
    (any case), or ``null`` for every row."""
    if split is None or SPLIT_NAMES.get(str(split).strip().lower()):
        return []
    return [f"'split' must be one of {'/'.join(SPLIT_NAMES)} or null (every row), got {split!r}."]


INFERENCE = SettingsChecks(
    "survival inference",
    network_problems,
    time_axis_problems,
    image_size_problems,
    inference_batch_problems,
    covariate_problems,
    split_problems,
    intensity_problems,
    spacing_problems,
    orientation_problems,
    *CASE_RUN_CHECKS,
    switches("crop_foreground"),
)
"""The checks of a survival inference run (``inference.json``), before any case is read: the trained network's head
and time axis, the volume size (``image_size``, 3 positive integers), the batch, the covariates and CSV split, the
preprocessing (``intensity``, ``spacing``, ``orientation``), how the command runs
(:data:`common.config_checks.CASE_RUN_CHECKS`) and the on/off settings."""
