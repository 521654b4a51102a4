# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The checks of the autoencoder family's settings, run first in a bundle's ``initialize`` (through
:func:`common.bundle.check_settings`) before anything is built or written."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from common.data.pipeline import cache_problems, intensity_problems
from common.utils import flag_problems, is_positive_int

__all__ = ["check_autoencoder_settings"]


def check_autoencoder_settings(
    patch_size: Sequence[int],
    channels: Sequence[int],
    norm_num_groups: int,
    attention_levels: Sequence[bool],
    latent_channels: int,
    batch_size: int,
    num_samples: int,
    kl_weight: float,
    adv_weight: float,
    perceptual_weight: float,
    adv_warmup_iterations: int,
    intensity: Mapping[str, Any] | None = None,
    flags: Mapping[str, Any] | None = None,
    cache_rate: float = 1.0,
    replace_rate: float = 0.1,
) -> None:
    """Check the ``autoencoder_3d`` hyperparameters before anything is built or written.

    The AutoencoderKL halves the patch ``len(channels) - 1`` times and its decoder doubles it back, so a patch that
    is not a multiple of ``2 ** (len(channels) - 1)`` would only fail at the first loss, after the run folder is
    made; group normalisation needs ``norm_num_groups`` to divide every entry of ``channels``.

    Raises:
        ValueError: naming the config id and the value, for: ``channels`` not positive integers, ``attention_levels``
            of another length, ``norm_num_groups`` not dividing every channel count, ``patch_size`` not 3 positive
            integers or not divisible by the total downsampling, ``latent_channels``/``batch_size``/``num_samples``
            below 1, a negative loss weight or ``adv_warmup_iterations``, an invalid ``intensity``
            (:func:`common.data.pipeline.intensity_problems`), on/off settings in ``flags`` (id -> value) that are
            not booleans, a ``cache_rate`` outside [0, 1] and a ``replace_rate`` outside (0, 1] (MONAI's
            ``SmartCacheDataset`` refuses 0: with ``cache_rate`` 1 nothing is replaced anyway).
    """
    problems = []
    channels = list(channels) if isinstance(channels, (list, tuple)) else []
    if not channels or not all(is_positive_int(c) for c in channels):
        problems.append(f"'channels' must be a list of positive integers, got {channels or None!r}.")
    elif not is_positive_int(norm_num_groups) or any(c % norm_num_groups for c in channels):
        problems.append(
            f"'norm_num_groups' {norm_num_groups!r} must divide every entry of 'channels' {channels} (group "
            "normalisation)."
        )
    if channels and len(list(attention_levels)) != len(channels):
        problems.append(
            f"'attention_levels' must have one entry per level of 'channels' ({len(channels)}), got "
            f"{list(attention_levels)}."
        )
    patch = list(patch_size) if isinstance(patch_size, (list, tuple)) else []
    if len(patch) != 3 or not all(is_positive_int(p) for p in patch):
        problems.append(f"'patch_size' must be 3 positive integers, got {patch_size!r}.")
    elif channels:
        factor = 2 ** (len(channels) - 1)
        if any(p % factor for p in patch):
            problems.append(
                f"'patch_size' {patch} must be divisible by {factor} on every axis (the autoencoder downsamples "
                f"{len(channels) - 1} times: one fewer than the levels of 'channels')."
            )
    for name, value in (("latent_channels", latent_channels), ("batch_size", batch_size), ("num_samples", num_samples)):
        if not is_positive_int(value):
            problems.append(f"{name!r} must be an integer >= 1, got {value!r}.")
    for name, value in (("kl_weight", kl_weight), ("adv_weight", adv_weight), ("perceptual_weight", perceptual_weight)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            problems.append(f"{name!r} must be a number >= 0, got {value!r}.")
    if (
        isinstance(adv_warmup_iterations, bool)
        or not isinstance(adv_warmup_iterations, int)
        or adv_warmup_iterations < 0
    ):
        problems.append(f"'adv_warmup_iterations' must be an integer >= 0 (iterations), got {adv_warmup_iterations!r}.")
    problems += intensity_problems(intensity)
    problems += flag_problems(flags)
    problems += cache_problems(cache_rate, replace_rate)
    if problems:
        raise ValueError("invalid autoencoder configuration:\n  " + "\n  ".join(problems))
