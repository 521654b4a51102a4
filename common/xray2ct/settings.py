# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The checks of the xray2ct family's settings, run first in a bundle's ``initialize`` (through
:func:`common.bundle.check_settings`) before anything is built or written."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common.data.pipeline import cache_problems
from common.diffusion.schedule import GRIDS, PREDICTIONS, fast_ddpm_grid
from common.utils import flag_problems, is_positive_int
from common.xray2ct.drr import VIEW_AXES, view_plane
from common.xray2ct.engines import (
    DIRECT_LOSSES,
    LOSS_WEIGHTINGS,
)
from common.xray2ct.losses import PHYSICS_WEIGHTINGS
from common.xray2ct.networks import MODES, SAMPLER_MODES, stage_checkpoint

__all__ = ["check_xray2ct_settings"]


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _view_geometry_problems(
    views: Sequence[str],
    view_size: Sequence[int],
    source: Sequence[int] | None,
    stage_size: Sequence[int] | None,
    view_files: bool,
) -> list[str]:
    """The X-rays must not be interpolated up anywhere, or the ground truth would not satisfy the projection loss:
    made by the projector, they come from the CT at ``source_size`` (each view's plane at least ``view_size``); the
    loss compares them at the stage's plane (at most ``view_size``)."""
    problems = []
    view = tuple(int(v) for v in view_size)
    for name in views:
        if source is not None and not view_files and any(p < v for p, v in zip(view_plane(source, name), view)):
            problems.append(
                f"'view_size' {list(view)} is finer than the {name} projection {list(view_plane(source, name))} of the CT "
                f"the X-rays are made from ('source_size' {list(source)}): they would be interpolated and the ground "
                "truth would not satisfy the projection loss; raise source_size or lower view_size."
            )
        if stage_size is not None and any(p > v for p, v in zip(view_plane(stage_size, name), view)):
            problems.append(
                f"the stage's {name} projection {list(view_plane(stage_size, name))} is finer than 'view_size' {list(view)}: "
                "the projection loss would compare with interpolated X-rays; raise view_size."
            )
    return problems


def check_xray2ct_settings(
    stage: int,
    stage_sizes: Sequence[Sequence[int]],
    source_size: Sequence[int],
    view_size: Sequence[int],
    views: Sequence[str],
    mode: str,
    prediction_type: str,
    grid: str,
    num_grid_steps: int,
    num_train_timesteps: int,
    unet_channels: Sequence[int],
    attention_levels: Sequence[bool],
    norm_num_groups: int,
    num_head_channels: int,
    vit_patch_size: int,
    vit_hidden_size: int,
    vit_heads: int,
    physics_weight: float,
    physics_weighting: str,
    direct_loss: str,
    batch_size: int,
    accumulation_steps: int,
    ema_decay: float,
    flags: Mapping[str, Any] | None = None,
    training: bool = True,
    cache_rate: float = 1.0,
    replace_rate: float = 0.1,
    residual_scale: float = 0.1,
    regressor_dir: str | None = None,
    loss_weighting: str = "none",
    min_snr_gamma: float = 5.0,
    num_samples: int = 1,
    sample_chunk: int | None = None,
    guidance_scale: float = 0.0,
) -> None:
    """Check an X-ray -> CT bundle's settings before anything is built or written (``training``: for a training
    run, where ``mode`` must be trainable; evaluation also accepts the ``backprojection`` baseline). ``cache_rate``
    and ``replace_rate`` are those of the datasets (:func:`common.data.pipeline.cache_problems`).

    Raises:
        ValueError: listing every problem, each naming its config id and value.
    """
    problems: list[str] = []

    def triple(name: str, value: Any, dims: int = 3) -> list[int] | None:
        ok = isinstance(value, (list, tuple)) and len(value) == dims
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
        if not ok:
            problems.append(f"{name!r} must be {dims} positive integers, got {value!r}.")
            return None
        return [int(v) for v in value]

    sizes = stage_sizes if isinstance(stage_sizes, (list, tuple)) and stage_sizes else None
    if sizes is None:
        problems.append(f"'stage_sizes' must be a non-empty list of volume sizes, one per stage, got {stage_sizes!r}.")
    stage_ok = not (
        isinstance(stage, bool) or not isinstance(stage, int) or stage < 1 or (sizes and stage > len(sizes))
    )
    if not stage_ok:  # the stage sizes are still checked below, all but against source_size (which stages run?)
        problems.append(f"'stage' must be an integer in [1, {len(sizes) if sizes else '?'}], got {stage!r}.")
    source = triple("source_size", source_size)
    current = None
    if sizes:
        checked = [triple(f"stage_sizes[{i}]", s) for i, s in enumerate(sizes)]
        factor = 2 ** (len(list(unet_channels)) - 1)
        for i, size in enumerate(checked):
            if size is None:
                continue
            if any(s % factor for s in size):
                problems.append(
                    f"'stage_sizes[{i}]' {size} must be divisible by {factor} on every axis (the U-Net halves it "
                    f"{len(list(unet_channels)) - 1} times)."
                )
            if stage_ok and i == stage - 1:
                current = size
            if i and checked[i - 1] and any(a < b for a, b in zip(size, checked[i - 1])):
                problems.append(f"'stage_sizes' must not shrink from stage {i} to {i + 1}, got {sizes!r}.")
            if source and stage_ok and i < stage and any(s > m for s, m in zip(size, source)):
                problems.append(
                    f"stage {i + 1}'s size {size} is larger than 'source_size' {source}, the resolution the CT is "
                    "loaded at: raise source_size."
                )
    view = triple("view_size", view_size, dims=2)
    listed = list(views) if isinstance(views, (list, tuple)) else None
    if not listed or any(v not in VIEW_AXES for v in listed) or len(set(listed)) != len(listed):
        problems.append(f"'views' must be distinct names out of {sorted(VIEW_AXES)}, got {views!r}.")
    elif view:
        problems += _view_geometry_problems(listed, view, source, current, bool((flags or {}).get("view_files")))
    if view and isinstance(vit_patch_size, int) and vit_patch_size > 0 and any(v % vit_patch_size for v in view):
        problems.append(f"'vit_patch_size' {vit_patch_size} must divide 'view_size' {view}.")
    if isinstance(vit_heads, int) and vit_heads > 0 and int(vit_hidden_size) % vit_heads:
        problems.append(f"'vit_hidden_size' {vit_hidden_size} must be divisible by 'vit_heads' {vit_heads}.")
    modes = MODES if training else SAMPLER_MODES
    if mode not in modes:
        extra = (
            " ('backprojection' has nothing to train: evaluate it with evaluate.json)" if mode in SAMPLER_MODES else ""
        )
        problems.append(f"'mode' must be one of {modes}, got {mode!r}{extra}.")
    if prediction_type not in PREDICTIONS:
        problems.append(f"'prediction_type' must be one of {PREDICTIONS}, got {prediction_type!r}.")
    if grid not in GRIDS:
        problems.append(f"'grid' must be one of {GRIDS}, got {grid!r}.")
    else:
        try:
            fast_ddpm_grid(grid, int(num_grid_steps), int(num_train_timesteps))
        except (TypeError, ValueError) as exc:
            problems.append(f"'num_grid_steps'/'num_train_timesteps': {exc}")
    channels = [int(c) for c in unet_channels]
    for name, value in (("num_head_channels", num_head_channels), ("norm_num_groups", norm_num_groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name!r} must be an integer >= 1, got {value!r}.")
    heads = num_head_channels if isinstance(num_head_channels, int) and num_head_channels > 0 else 1
    groups = norm_num_groups if isinstance(norm_num_groups, int) and norm_num_groups > 0 else 1
    levels = list(attention_levels) if isinstance(attention_levels, (list, tuple)) else None
    if levels is None or len(levels) != len(channels) or not all(isinstance(a, bool) for a in levels):
        problems.append(
            f"'attention_levels' must be a list of {len(channels)} booleans (one per 'unet_channels' entry; write "
            f"True/False on the command line), got {attention_levels!r}."
        )
    else:
        bad = [c for i, (c, a) in enumerate(zip(channels, levels)) if (a or i == len(channels) - 1) and c % heads]
        if bad:
            problems.append(
                f"'num_head_channels' {num_head_channels} must divide the channels {bad} of the levels with attention."
            )
    if any(c % groups for c in channels):
        problems.append(
            f"every entry of 'unet_channels' {channels} must be divisible by 'norm_num_groups' {norm_num_groups}."
        )
    if not float(physics_weight) >= 0:
        problems.append(f"'physics_weight' must be >= 0, got {physics_weight!r}.")
    if physics_weighting not in PHYSICS_WEIGHTINGS:
        problems.append(f"'physics_weighting' must be one of {PHYSICS_WEIGHTINGS}, got {physics_weighting!r}.")
    if direct_loss not in DIRECT_LOSSES:
        problems.append(f"'direct_loss' must be one of {DIRECT_LOSSES}, got {direct_loss!r}.")
    for name, value in (("batch_size", batch_size), ("accumulation_steps", accumulation_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name!r} must be an integer >= 1, got {value!r}.")
    if not 0.0 < float(ema_decay) < 1.0:
        problems.append(f"'ema_decay' must be in (0, 1), got {ema_decay!r}.")
    problems += _sampling_problems(mode, residual_scale, regressor_dir, training, stage if stage_ok else None)
    if loss_weighting not in LOSS_WEIGHTINGS:
        problems.append(f"'loss_weighting' must be one of {LOSS_WEIGHTINGS}, got {loss_weighting!r}.")
    if not _positive(min_snr_gamma):
        problems.append(f"'min_snr_gamma' must be a positive number, got {min_snr_gamma!r}.")
    for name, value in (("num_samples", num_samples), ("sample_chunk", sample_chunk)):
        if (value is not None or name == "num_samples") and not is_positive_int(value):
            null = " or null" if name == "sample_chunk" else ""
            problems.append(f"{name!r} must be an integer >= 1{null}, got {value!r}.")
    if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)) or not guidance_scale >= 0:
        problems.append(f"'guidance_scale' must be a number >= 0 (0: no projection guidance), got {guidance_scale!r}.")
    problems += cache_problems(cache_rate, replace_rate)
    problems += flag_problems(flags)
    if problems:
        raise ValueError("invalid X-ray -> CT configuration:\n  " + "\n  ".join(problems))


def _sampling_problems(
    mode: str, residual_scale: Any, regressor_dir: Any, training: bool, stage: int | None
) -> list[str]:
    """The residual mode's settings: a positive ``residual_scale`` and, for training, the ``regressor_dir`` of a
    trained ``direct`` run with this stage's weights."""
    problems = []
    if not _positive(residual_scale):
        problems.append(f"'residual_scale' must be a positive number, got {residual_scale!r}.")
    if mode != "residual" or not training:
        return problems
    if not regressor_dir:
        problems.append(
            "'mode' residual refines a trained direct regressor: pass --regressor_dir, the output_dir of a "
            "'--mode direct' run of the same stages and network."
        )
    elif stage is not None:
        path = Path(stage_checkpoint(regressor_dir, stage))
        if not path.is_file():
            problems.append(
                f"'regressor_dir' {regressor_dir!r} has no trained stage {stage} regressor: {str(path)!r} does not "
                f"exist (train it first with --mode direct --output_dir {regressor_dir} --stage {stage})."
            )
    return problems
