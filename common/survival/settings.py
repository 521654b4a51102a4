# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The checks of the survival family's settings, run first in a bundle's ``initialize`` (through
:func:`common.bundle.check_settings`) before anything is built or written."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from common.data.pipeline import cache_problems, intensity_problems
from common.survival.cohort import TIME_UNITS
from common.survival.networks import BACKBONES, HEADS, widen_factor_problem
from common.utils import flag_problems

__all__ = ["check_survival_settings", "check_training_size"]


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


def check_survival_settings(
    survival_head: str,
    backbone: str,
    conv1_t_stride: int,
    num_intervals: int | None,
    horizons: Sequence[float],
    batch_size: int,
    image_size: Sequence[int],
    val_fraction: float,
    time_unit: str,
    covariates: Sequence[str] = (),
    cut_points: Sequence[float] | None = None,
    accumulation_steps: int = 1,
    key_metric: str = "uno_c",
    flags: Mapping[str, Any] | None = None,
    intensity: Mapping[str, Any] | None = None,
    cache_rate: float = 1.0,
    replace_rate: float = 0.1,
    calibration_cache_rate: float = 1.0,
    widen_factor: float = 1.0,
) -> None:
    """Check a survival bundle's settings before anything is built or written.

    ``flags`` maps the ids of on/off switches (``amp`` excluded) to their values, which must be booleans (the command
    line reads ``true`` as a string, and a string ``"false"`` is true).

    Raises:
        ValueError: listing every problem, each naming its config id and value, among them an invalid ``intensity``
            (:func:`common.data.pipeline.intensity_problems`), a ``cache_rate`` or ``calibration_cache_rate`` outside
            [0, 1] and a ``replace_rate`` outside (0, 1] (MONAI's ``SmartCacheDataset`` refuses 0: with
            ``cache_rate`` 1 nothing is replaced anyway), see :func:`common.data.pipeline.cache_problems`.
    """
    problems = []
    if survival_head not in HEADS:
        problems.append(f"'survival_head' must be one of {HEADS}, got {survival_head!r}.")
    if backbone not in BACKBONES:
        problems.append(f"'backbone' must be one of {BACKBONES}, got {backbone!r}.")
    width_problem = widen_factor_problem(widen_factor)
    if width_problem:
        problems.append(width_problem)
    if isinstance(conv1_t_stride, bool) or not isinstance(conv1_t_stride, int) or conv1_t_stride < 1:
        problems.append(
            f"'conv1_t_stride' must be a positive integer (2 is the usual ResNet stem; 1 costs ~8x the FLOPs), "
            f"got {conv1_t_stride!r}."
        )
    if survival_head == "logistic_hazard" and cut_points is None:
        if isinstance(num_intervals, bool) or not isinstance(num_intervals, int) or num_intervals < 1:
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
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        problems.append(
            f"'batch_size' (the total batch across all GPUs) must be a positive integer, got {batch_size!r}."
        )
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        problems.append(f"'accumulation_steps' must be a positive integer, got {accumulation_steps!r}.")
    size = list(image_size) if isinstance(image_size, (list, tuple)) else None
    if not size or len(size) != 3 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in size):
        problems.append(f"'image_size' must be 3 positive integers, got {image_size!r}.")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        problems.append(f"'val_fraction' must be in [0, 1), got {val_fraction!r}.")
    if time_unit not in TIME_UNITS:
        problems.append(f"'time_unit' must be one of {tuple(TIME_UNITS)}, got {time_unit!r}.")
    names = list(covariates) if isinstance(covariates, (list, tuple)) else None
    if names is None or not all(isinstance(c, str) and c for c in names) or len(set(names)) != len(names):
        problems.append(f"'covariates' must be a list of distinct CSV column names, got {covariates!r}.")
    known = ("uno_c", "harrell_c", "auc_mean", "ibs")
    if key_metric not in known and not str(key_metric).startswith(("auc_", "brier_")):
        problems.append(f"'key_metric' must be one of {known} or auc_<h>/brier_<h>, got {key_metric!r}.")
    problems += flag_problems(flags)
    problems += intensity_problems(intensity)
    problems += cache_problems(cache_rate, replace_rate, calibration_cache_rate=calibration_cache_rate)
    if problems:
        raise ValueError("invalid survival configuration:\n  " + "\n  ".join(problems))
