# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The checks of the vqgan family's settings, run first in a bundle's ``initialize`` (through
:func:`common.bundle.check_settings`) before anything is built or written."""

from __future__ import annotations

from collections.abc import Sequence

from common.data.pipeline import cache_problems, intensity_problems
from common.vqgan.networks import (
    downsample_levels,
)

__all__ = ["check_vqgan_settings"]


def check_vqgan_settings(
    patch_size: Sequence[int],
    downsample: Sequence[int] | int,
    n_codes: int,
    discriminator_iter_start: int,
    intensity: dict | None = None,
    patches_per_volume: int = 1,
    micro_batch_size: int | None = None,
    cache_rate: float = 1.0,
    replace_rate: float = 0.1,
) -> None:
    """Check the VQ-GAN hyperparameters before anything is built or written.

    Raises:
        ValueError: naming the config id and the value, for: ``downsample`` not powers of two, ``patch_size``
            not divisible by ``downsample`` on every axis, ``n_codes < 2``, negative ``discriminator_iter_start``,
            an invalid ``intensity`` (:func:`common.data.pipeline.intensity_problems`: an inverted HU window, bad
            percentiles, an unknown mode), ``patches_per_volume < 1``, ``micro_batch_size < 1``, a ``cache_rate``
            outside [0, 1] or a ``replace_rate`` outside (0, 1] (MONAI's ``SmartCacheDataset`` refuses 0: with
            ``cache_rate`` 1 nothing is replaced anyway).
    """
    problems = []
    try:
        levels = downsample_levels(downsample, len(patch_size))
        factors = [2**lv for lv in levels]
        bad = [p for p, f in zip(patch_size, factors) if int(p) % f]
        if bad:
            problems.append(
                f"'patch_size' {list(patch_size)} must be divisible by the total downsampling 'downsample' {factors} "
                "on every axis."
            )
    except ValueError as exc:
        problems.append(f"'downsample': {exc}")
    if isinstance(n_codes, bool) or int(n_codes) < 2:
        problems.append(f"'n_codes' must be >= 2, got {n_codes!r}.")
    if isinstance(discriminator_iter_start, bool) or int(discriminator_iter_start) < 0:
        problems.append(f"'discriminator_iter_start' must be >= 0 (iterations), got {discriminator_iter_start!r}.")
    problems += intensity_problems(intensity)
    if int(patches_per_volume) < 1:
        problems.append(f"'patches_per_volume' must be >= 1, got {patches_per_volume!r}.")
    if micro_batch_size is not None and int(micro_batch_size) < 1:
        problems.append(f"'micro_batch_size' must be >= 1 or null, got {micro_batch_size!r}.")
    problems += cache_problems(cache_rate, replace_rate)
    if problems:
        raise ValueError("invalid VQ-GAN configuration:\n  " + "\n  ".join(problems))
