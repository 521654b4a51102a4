# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The checks of the diffusion family's settings, one per concern (see :mod:`common.config_checks`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common.config_checks import CASE_RUN_CHECKS, TRAINING_RUN_CHECKS, SettingsChecks, choice_problems, switches
from common.data.intensity import intensity_problems
from common.data.pipeline import cache_problems, orientation_problems, spacing_problems
from common.diffusion.engines import DIFFUSION_MODES, TASKS, volume_multiple
from common.diffusion.schedule import PREDICTIONS, grid_problems
from common.engines.trainer import accumulation_problems
from common.networks.wrappers import window_problems
from common.utils import is_positive_int

__all__ = [
    "INFERENCE",
    "TRAINING",
    "generation_problems",
    "latent_problems",
    "patch_problems",
    "schedule_problems",
    "task_problems",
    "training_problems",
    "unet_problems",
]


def task_problems(task: str, image_keys: Sequence[str], target_key: str) -> list[str]:
    """A known ``task`` whose ``image_keys`` are distinct datalist keys holding ``target_key``: the target alone for
    an unconditional model, with at least one source for synthesis and translation."""
    keys = list(image_keys) if isinstance(image_keys, (list, tuple)) else None
    problems = choice_problems(task=(task, TASKS))
    if not keys or not all(isinstance(k, str) and k for k in keys) or len(set(keys)) != len(keys):
        problems.append(f"'image_keys' must be a list of distinct datalist keys, got {image_keys!r}.")
    elif target_key not in keys:
        problems.append(f"'target_key' {target_key!r} must be one of 'image_keys' {keys}.")
    elif task == "unconditional" and len(keys) != 1:
        problems.append(
            f"task 'unconditional' generates 'target_key' alone: 'image_keys' must be [{target_key!r}], got {keys}."
        )
    elif task in ("synthesis", "translation") and len(keys) < 2:
        problems.append(f"task {task!r} needs at least one source besides the target in 'image_keys', got {keys}.")
    return problems


def schedule_problems(
    diffusion_mode: str, grid: str, num_grid_steps: int, num_train_timesteps: int, prediction_type: str, eta: float
) -> list[str]:
    """The noise schedule: known modes, a grid :func:`common.diffusion.schedule.fast_ddpm_grid` can build
    (:func:`common.diffusion.schedule.grid_problems`), and the DDIM ``eta`` in [0, 1]."""
    problems = choice_problems(diffusion_mode=(diffusion_mode, DIFFUSION_MODES))
    problems += grid_problems(grid, num_grid_steps, num_train_timesteps)
    problems += choice_problems(prediction_type=(prediction_type, PREDICTIONS))
    if not 0.0 <= float(eta) <= 1.0:
        problems.append(f"'eta' must be in [0, 1], got {eta!r}.")
    return problems


def training_problems(ema_decay: float, batch_size: int, val_num_samples: int, task: str) -> list[str]:
    """An EMA decay in (0, 1); counts >= 1; at least 2 validation samples of an unconditional model (their
    diversity is measured)."""
    problems = []
    if not 0.0 < float(ema_decay) < 1.0:
        problems.append(f"'ema_decay' must be in (0, 1), got {ema_decay!r}.")
    counts = {"batch_size": batch_size, "val_num_samples": val_num_samples}
    problems += [
        f"{name!r} must be >= 1, got {value!r}."
        for name, value in counts.items()
        if isinstance(value, bool) or int(value) < 1
    ]
    if task == "unconditional" and int(val_num_samples) < 2:
        problems.append(
            f"'val_num_samples' must be >= 2 for task 'unconditional' (diversity between samples), got {val_num_samples!r}."
        )
    return problems


def unet_problems(
    unet_channels: Sequence[int],
    norm_num_groups: int,
    attention_levels: Sequence[bool] | None,
    num_head_channels: int | None,
) -> list[str]:
    """``attention_levels`` must hold one boolean per entry of ``unet_channels`` (the command line reads ``true`` as
    a string: a string there would silently switch attention on at full resolution and exhaust the memory), and
    ``num_head_channels`` must divide the channels of those levels; ``norm_num_groups`` must divide every level's
    channels."""
    problems = []
    channels = [int(c) for c in unet_channels]
    if attention_levels is not None:
        levels = list(attention_levels) if isinstance(attention_levels, (list, tuple)) else None
        if levels is None or len(levels) != len(channels) or not all(isinstance(a, bool) for a in levels):
            problems.append(
                f"'attention_levels' must be a list of {len(channels)} booleans (one per 'unet_channels' entry; "
                f"write True/False on the command line), got {attention_levels!r}."
            )
        elif num_head_channels is not None and not isinstance(num_head_channels, bool) and int(num_head_channels) > 0:
            # the middle block always has attention, at the last level's channels
            bad_heads = [
                c
                for i, (c, a) in enumerate(zip(channels, levels))
                if (a or i == len(channels) - 1) and c % int(num_head_channels)
            ]
            if bad_heads:
                problems.append(
                    f"'num_head_channels' {num_head_channels} must divide the channels {bad_heads} of the levels with "
                    "attention (the last level always has it, in the middle block)."
                )
    if any(c % int(norm_num_groups) for c in channels):
        problems.append(
            f"every entry of 'unet_channels' {channels} must be divisible by 'norm_num_groups' {norm_num_groups}."
        )
    return problems


def patch_problems(
    patch_size: Sequence[int], unet_channels: Sequence[int], space_downsample: Sequence[int] | None
) -> list[str]:
    """The U-Net halves the patch ``len(unet_channels) - 1`` times, in the autoencoder's latent space when
    ``space_downsample`` (the autoencoder's downsampling; 1 on every axis, or ``None``: no autoencoder) says so."""
    factor = 2 ** (len(list(unet_channels)) - 1)
    if space_downsample is not None and all(int(d) == 1 for d in space_downsample):
        space_downsample = None
    latent = [int(d) for d in space_downsample] if space_downsample is not None else [1] * len(patch_size)
    if len(patch_size) != 3 or any(int(p) < 1 for p in patch_size):
        return [f"'patch_size' must be 3 positive integers, got {patch_size!r}."]
    if any(int(p) % (factor * d) for p, d in zip(patch_size, latent)):
        how = f"{factor} (the U-Net halves it {len(list(unet_channels)) - 1} times)"
        if space_downsample is not None:
            how += f" times the autoencoder's downsampling {latent}"
        return [f"'patch_size' {list(patch_size)} must be divisible by {how} on every axis."]
    return []


TRAINING = SettingsChecks(
    "diffusion",
    task_problems,
    schedule_problems,
    training_problems,
    accumulation_problems,
    switches(
        "latent",
        "clip_sample",
        "val_denoise_loss",
        "ema_warmup",
        "compile",
        "preflight",
        "allow_irregular_series",
        "oom_backoff",
    ),
    cache_problems,
    unet_problems,
    patch_problems,
    *TRAINING_RUN_CHECKS,
)
"""The checks of a diffusion training run (``train.json``, and evaluation on top of it): besides the checks above,
on/off settings that are not booleans (a string ``"false"`` is true) and the ``cache_rate``/``replace_rate`` of
:func:`common.data.pipeline.cache_problems`."""


def _sizes(value: Any) -> list[int] | None:
    """``value`` as 3 positive integers, or ``None`` when it is not."""
    ok = isinstance(value, (list, tuple)) and len(value) == 3 and all(is_positive_int(v) for v in value)
    return [int(v) for v in value] if ok else None


def generation_problems(
    task: str,
    num_samples: int,
    sample_shape: Sequence[int],
    unet_channels: Sequence[int],
    space_downsample: Sequence[int],
    seed: int,
) -> list[str]:
    """The sampling of an inference run: an integer ``seed`` >= 0 of its noise, and at least one generated volume
    (``num_samples``) of a ``sample_shape`` the U-Net can take whole: a multiple of
    :func:`common.diffusion.engines.volume_multiple` on every axis for an unconditional model (its volumes are not
    padded)."""
    problems = []
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        problems.append(f"'seed' must be an integer >= 0 (it seeds each case's sampling noise), got {seed!r}.")
    if not is_positive_int(num_samples):
        problems.append(f"'num_samples' must be an integer >= 1 (volumes generated), got {num_samples!r}.")
    shape = _sizes(sample_shape)
    if shape is None:
        problems.append(f"'sample_shape' must be 3 positive integers, got {sample_shape!r}.")
    elif task == "unconditional":
        multiple = volume_multiple(unet_channels, space_downsample)
        if any(s % m for s, m in zip(shape, multiple)):
            problems.append(
                f"'sample_shape' {shape} must be divisible by {multiple} on every axis (the U-Net halves it "
                f"{len(list(unet_channels)) - 1} times, times the autoencoder's downsampling {list(space_downsample)})."
            )
    return problems


def latent_problems(latent: bool, latent_downsample: Sequence[int], latent_sw_batch_size: int) -> list[str]:
    """In latent mode, the autoencoder's downsampling (3 positive integers) and its windows per forward pass."""
    if latent is not True:
        return []
    problems = []
    if _sizes(latent_downsample) is None:
        problems.append(f"'latent_downsample' must be 3 positive integers, got {latent_downsample!r}.")
    if not is_positive_int(latent_sw_batch_size):
        problems.append(f"'latent_sw_batch_size' must be an integer >= 1, got {latent_sw_batch_size!r}.")
    return problems


INFERENCE = SettingsChecks(
    "diffusion inference",
    task_problems,
    schedule_problems,
    unet_problems,
    patch_problems,
    generation_problems,
    latent_problems,
    intensity_problems,
    spacing_problems,
    orientation_problems,
    window_problems,
    *CASE_RUN_CHECKS,
    switches("oom_backoff", "latent", "clip_sample"),
)
"""The checks of a diffusion inference run (``inference.json``), before any case is read: the task and schedule of
the trained model, its U-Net, the sampling window (``patch_size``, a multiple of the U-Net's downsampling times the
autoencoder's in latent mode: :func:`patch_problems`), what is generated (:func:`generation_problems`), the latent
codec, the preprocessing (``intensity``, ``spacing``, ``orientation``), the windows
(:func:`common.networks.wrappers.window_problems`), how the command runs
(:data:`common.config_checks.CASE_RUN_CHECKS`) and the on/off settings."""
