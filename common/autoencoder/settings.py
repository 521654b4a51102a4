# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The checks of the autoencoder family's settings, one per concern (see :mod:`common.config_checks`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common.autoencoder.engines import warmup_problems
from common.autoencoder.published import network_problems, pretrained_problems, split_problems
from common.config_checks import CASE_RUN_CHECKS, TRAINING_RUN_CHECKS, SettingsChecks, switches
from common.data.intensity import intensity_problems
from common.data.pipeline import (
    cache_problems,
    check_output_units,
    orientation_problems,
    spacing_problems,
)
from common.networks.wrappers import INFERENCE_VIEWS, memory_format_problems, window_problems
from common.utils import is_positive_int

__all__ = [
    "INFERENCE",
    "TRAINING",
    "channel_problems",
    "count_problems",
    "latent_channel_problems",
    "loss_weight_problems",
    "output_problems",
    "patch_problems",
]


def _channels(channels: Any) -> list[int]:
    """``channels`` as a list when it is one of positive integers, else empty."""
    listed = list(channels) if isinstance(channels, (list, tuple)) else []
    return listed if listed and all(is_positive_int(c) for c in listed) else []


def channel_problems(channels: Sequence[int], norm_num_groups: int, attention_levels: Sequence[bool]) -> list[str]:
    """``channels`` must be positive integers that ``norm_num_groups`` divides (group normalisation), with one
    ``attention_levels`` entry per level."""
    problems = []
    listed = _channels(channels)
    if not listed:
        given = list(channels) if isinstance(channels, (list, tuple)) else []
        return [f"'channels' must be a list of positive integers, got {given or None!r}."]
    if not is_positive_int(norm_num_groups) or any(c % norm_num_groups for c in listed):
        problems.append(
            f"'norm_num_groups' {norm_num_groups!r} must divide every entry of 'channels' {listed} (group "
            "normalisation)."
        )
    if len(list(attention_levels)) != len(listed):
        problems.append(
            f"'attention_levels' must have one entry per level of 'channels' ({len(listed)}), got "
            f"{list(attention_levels)}."
        )
    return problems


def patch_problems(patch_size: Sequence[int], channels: Sequence[int]) -> list[str]:
    """The AutoencoderKL halves the patch ``len(channels) - 1`` times and its decoder doubles it back: a patch that
    is not a multiple of ``2 ** (len(channels) - 1)`` would only fail at the first loss, after the run folder is
    made."""
    patch = list(patch_size) if isinstance(patch_size, (list, tuple)) else []
    if len(patch) != 3 or not all(is_positive_int(p) for p in patch):
        return [f"'patch_size' must be 3 positive integers, got {patch_size!r}."]
    levels = _channels(channels)
    factor = 2 ** (len(levels) - 1)
    if levels and any(p % factor for p in patch):
        return [
            f"'patch_size' {patch} must be divisible by {factor} on every axis (the autoencoder downsamples "
            f"{len(levels) - 1} times: one fewer than the levels of 'channels')."
        ]
    return []


def count_problems(latent_channels: int, batch_size: int, num_samples: int) -> list[str]:
    """Sizes that must be integers >= 1."""
    counts = {"latent_channels": latent_channels, "batch_size": batch_size, "num_samples": num_samples}
    return [
        f"{name!r} must be an integer >= 1, got {value!r}."
        for name, value in counts.items()
        if not is_positive_int(value)
    ]


def loss_weight_problems(kl_weight: float, adv_weight: float, perceptual_weight: float) -> list[str]:
    """The loss weights must be numbers >= 0."""
    weights = {"kl_weight": kl_weight, "adv_weight": adv_weight, "perceptual_weight": perceptual_weight}
    return [
        f"{name!r} must be a number >= 0, got {value!r}."
        for name, value in weights.items()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0
    ]


TRAINING = SettingsChecks(
    "autoencoder",
    network_problems,
    split_problems,
    pretrained_problems,
    channel_problems,
    patch_problems,
    count_problems,
    loss_weight_problems,
    warmup_problems,
    intensity_problems,
    switches(
        "distributed",
        "compile",
        "deterministic",
        "cudnn_benchmark",
        "preflight",
        "allow_irregular_series",
        "lr_schedule",
        "with_nonlocal_attn",
        "use_checkpoint",
        "sync_batchnorm",
        "profile",
        "oom_backoff",
    ),
    cache_problems,
    *TRAINING_RUN_CHECKS,
)
"""The checks of an autoencoder training run (``train.json``): an invalid ``intensity``
(:func:`common.data.intensity.intensity_problems`), on/off settings that are not booleans, a ``cache_rate`` outside
[0, 1] and a ``replace_rate`` outside (0, 1] (:func:`common.data.pipeline.cache_problems`: MONAI's
``SmartCacheDataset`` refuses 0) besides the checks above."""


def latent_channel_problems(latent_channels: int) -> list[str]:
    """The latent's channels: an integer >= 1."""
    if is_positive_int(latent_channels):
        return []
    return [f"'latent_channels' must be an integer >= 1, got {latent_channels!r}."]


def output_problems(mode: str, output_units: str) -> list[str]:
    """What an autoencoder's inference writes: a known ``mode`` (the network's inference view) and ``output_units``
    (:func:`common.data.pipeline.check_output_units`)."""
    problems = []
    if mode not in INFERENCE_VIEWS:
        problems.append(
            f"'mode' must be one of {INFERENCE_VIEWS} (what inference writes of each volume), got {mode!r}."
        )
    try:
        check_output_units(output_units)
    except ValueError as exc:
        problems.append(str(exc))
    return problems


INFERENCE = SettingsChecks(
    "autoencoder inference",
    network_problems,
    split_problems,
    channel_problems,
    patch_problems,
    latent_channel_problems,
    output_problems,
    intensity_problems,
    spacing_problems,
    orientation_problems,
    window_problems,
    memory_format_problems,
    *CASE_RUN_CHECKS,
    switches("oom_backoff", "with_nonlocal_attn", "use_checkpoint"),
)
"""The checks of an autoencoder inference run (``inference.json``), before any case is read: the trained network's
levels (``channels``) and the sliding window (``patch_size``, which must be a multiple of its downsampling, or the
reconstruction comes out smaller than the input), what is written (``mode``, ``output_units``), the preprocessing
(``intensity``, ``spacing``, ``orientation``), the windows (:func:`common.networks.wrappers.window_problems`) and
their ``memory_format``, how the command runs (:data:`common.config_checks.CASE_RUN_CHECKS`) and the on/off
settings."""
