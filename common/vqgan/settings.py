# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The checks of the VQ-GAN family's settings, one per concern (see :mod:`common.config_checks`)."""

from __future__ import annotations

from collections.abc import Sequence

from common.config_checks import SettingsChecks
from common.data.pipeline import cache_problems, intensity_problems
from common.vqgan.networks import downsample_levels

__all__ = ["TRAINING", "codebook_problems", "downsample_problems", "patch_sampling_problems"]


def downsample_problems(patch_size: Sequence[int], downsample: Sequence[int] | int) -> list[str]:
    """``downsample`` must be powers of two that divide ``patch_size`` on every axis."""
    try:
        factors = [2**level for level in downsample_levels(downsample, len(patch_size))]
    except ValueError as exc:
        return [f"'downsample': {exc}"]
    if any(int(p) % f for p, f in zip(patch_size, factors)):
        return [
            f"'patch_size' {list(patch_size)} must be divisible by the total downsampling 'downsample' {factors} "
            "on every axis."
        ]
    return []


def codebook_problems(n_codes: int, discriminator_iter_start: int) -> list[str]:
    """At least 2 codes; the discriminator starts at an iteration >= 0."""
    problems = []
    if isinstance(n_codes, bool) or int(n_codes) < 2:
        problems.append(f"'n_codes' must be >= 2, got {n_codes!r}.")
    if isinstance(discriminator_iter_start, bool) or int(discriminator_iter_start) < 0:
        problems.append(f"'discriminator_iter_start' must be >= 0 (iterations), got {discriminator_iter_start!r}.")
    return problems


def patch_sampling_problems(patches_per_volume: int, micro_batch_size: int | None) -> list[str]:
    """At least one patch per volume; a micro-batch of at least one patch, or none (``null``)."""
    problems = []
    if int(patches_per_volume) < 1:
        problems.append(f"'patches_per_volume' must be >= 1, got {patches_per_volume!r}.")
    if micro_batch_size is not None and int(micro_batch_size) < 1:
        problems.append(f"'micro_batch_size' must be >= 1 or null, got {micro_batch_size!r}.")
    return problems


TRAINING = SettingsChecks(
    "VQ-GAN",
    downsample_problems,
    codebook_problems,
    intensity_problems,
    patch_sampling_problems,
    cache_problems,
)
"""The checks of a VQ-GAN training run (``train.json``): besides the checks above, an invalid ``intensity``
(:func:`common.data.pipeline.intensity_problems`: an inverted HU window, bad percentiles, an unknown mode), a
``cache_rate`` outside [0, 1] or a ``replace_rate`` outside (0, 1] (:func:`common.data.pipeline.cache_problems`:
MONAI's ``SmartCacheDataset`` refuses 0)."""
