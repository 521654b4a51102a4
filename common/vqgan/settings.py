# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The checks of the VQ-GAN family's settings, one per concern (see :mod:`common.config_checks`)."""

from __future__ import annotations

from collections.abc import Sequence

from common.autoencoder.settings import output_problems
from common.config_checks import CASE_RUN_CHECKS, TRAINING_RUN_CHECKS, SettingsChecks, switches
from common.data.intensity import intensity_problems
from common.data.pipeline import cache_problems, orientation_problems, spacing_problems
from common.engines.trainer import micro_batch_problems
from common.networks.wrappers import memory_format_problems, window_problems
from common.utils import is_positive_int
from common.vqgan.networks import codebook_problems, downsample_levels

__all__ = ["INFERENCE", "TRAINING", "discriminator_start_problems", "downsample_problems", "patch_sampling_problems"]


def downsample_problems(patch_size: Sequence[int], downsample: Sequence[int] | int) -> list[str]:
    """``patch_size`` must be 3 positive integers, ``downsample`` powers of two that divide it on every axis."""
    if not isinstance(patch_size, (list, tuple)) or len(patch_size) != 3 or not all(map(is_positive_int, patch_size)):
        return [f"'patch_size' must be 3 positive integers, got {patch_size!r}."]
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


def discriminator_start_problems(discriminator_iter_start: int) -> list[str]:
    """The discriminator starts at an iteration >= 0."""
    if isinstance(discriminator_iter_start, bool) or int(discriminator_iter_start) < 0:
        return [f"'discriminator_iter_start' must be >= 0 (iterations), got {discriminator_iter_start!r}."]
    return []


def patch_sampling_problems(patches_per_volume: int) -> list[str]:
    """At least one patch per volume."""
    if int(patches_per_volume) < 1:
        return [f"'patches_per_volume' must be >= 1, got {patches_per_volume!r}."]
    return []


TRAINING = SettingsChecks(
    "VQ-GAN",
    downsample_problems,
    codebook_problems,
    discriminator_start_problems,
    intensity_problems,
    patch_sampling_problems,
    micro_batch_problems,
    cache_problems,
    switches("preflight", "allow_irregular_series"),
    *TRAINING_RUN_CHECKS,
)
"""The checks of a VQ-GAN training run (``train.json``): besides the checks above, an invalid ``intensity``
(:func:`common.data.intensity.intensity_problems`: an inverted HU window, bad percentiles, an unknown mode), a
``cache_rate`` outside [0, 1] or a ``replace_rate`` outside (0, 1] (:func:`common.data.pipeline.cache_problems`:
MONAI's ``SmartCacheDataset`` refuses 0)."""

INFERENCE = SettingsChecks(
    "VQ-GAN inference",
    downsample_problems,
    output_problems,
    intensity_problems,
    spacing_problems,
    orientation_problems,
    window_problems,
    memory_format_problems,
    *CASE_RUN_CHECKS,
    switches("oom_backoff"),
)
"""The checks of a VQ-GAN inference run (``inference.json``), before any case is read: the sliding window
(``patch_size``, a multiple of the network's ``downsample`` on every axis, or the reconstruction comes out smaller
than the input), what is written (``mode``, ``output_units``: :func:`common.autoencoder.settings.output_problems`),
the preprocessing (``intensity``, ``spacing``, ``orientation``), the windows
(:func:`common.networks.wrappers.window_problems`) and their ``memory_format``, how the command runs
(:data:`common.config_checks.CASE_RUN_CHECKS`) and the on/off settings."""
