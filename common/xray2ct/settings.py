# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The checks of the X-ray -> CT family's settings, one per concern (see :mod:`common.config_checks`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.config_checks import CASE_RUN_CHECKS, TRAINING_RUN_CHECKS, SettingsChecks, choice_problems, switches
from common.data.pipeline import cache_problems, orientation_problems
from common.diffusion.schedule import PREDICTIONS, grid_problems
from common.utils import is_positive_int
from common.xray2ct.data import condition_problems
from common.xray2ct.drr import GEOMETRIES, VIEW_AXES, consistency_bounds, view_plane
from common.xray2ct.engines import DIRECT_LOSSES, LOSS_WEIGHTINGS
from common.xray2ct.losses import PHYSICS_WEIGHTINGS
from common.xray2ct.networks import MODES, SAMPLER_MODES, sampling_problems, stage_checkpoint

__all__ = [
    "EVALUATION",
    "INFERENCE",
    "TRAINING",
    "evaluation_mode_problems",
    "loss_problems",
    "noise_problems",
    "optimisation_problems",
    "projection_problems",
    "regressor_problems",
    "residual_scale_problems",
    "schedule_problems",
    "stage_problems",
    "trained_mode_problems",
    "trained_network_problems",
    "training_mode_problems",
    "unet_problems",
    "view_problems",
    "vit_problems",
]


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _sizes(value: Any, dims: int = 3) -> list[int] | None:
    """``value`` as ``dims`` positive integers, or ``None`` when it is not."""
    ok = isinstance(value, (list, tuple)) and len(value) == dims
    if not ok or not all(is_positive_int(v) for v in value):
        return None
    return [int(v) for v in value]


def _size_problem(name: str, value: Any, dims: int = 3) -> list[str]:
    return [] if _sizes(value, dims) else [f"{name!r} must be {dims} positive integers, got {value!r}."]


def _stage_count(stage_sizes: Any) -> int:
    return len(stage_sizes) if isinstance(stage_sizes, (list, tuple)) else 0


def _stage_ok(stage: Any, stage_sizes: Any) -> bool:
    count = _stage_count(stage_sizes)
    return is_positive_int(stage) and not (count and stage > count)


def stage_problems(
    stage: int, stage_sizes: Sequence[Sequence[int]], source_size: Sequence[int], unet_channels: Sequence[int]
) -> list[str]:
    """``stage`` in [1, number of stages]; each stage's size divisible by the U-Net's downsampling, not smaller than
    the previous stage's, and, up to this stage, not larger than ``source_size`` (the resolution the CT is loaded
    at)."""
    problems = []
    count = _stage_count(stage_sizes)
    if not count:
        problems.append(f"'stage_sizes' must be a non-empty list of volume sizes, one per stage, got {stage_sizes!r}.")
    stage_ok = _stage_ok(stage, stage_sizes)
    if not stage_ok:  # the stage sizes are still checked below, all but against source_size (which stages run?)
        problems.append(f"'stage' must be an integer in [1, {count or '?'}], got {stage!r}.")
    problems += _size_problem("source_size", source_size)
    source = _sizes(source_size)
    if not count:
        return problems
    checked = [_sizes(s) for s in stage_sizes]
    levels = len(list(unet_channels)) - 1
    for i, size in enumerate(checked):
        if size is None:
            problems += _size_problem(f"stage_sizes[{i}]", stage_sizes[i])
            continue
        if any(s % 2**levels for s in size):
            problems.append(
                f"'stage_sizes[{i}]' {size} must be divisible by {2**levels} on every axis (the U-Net halves it "
                f"{levels} times)."
            )
        if i and checked[i - 1] and any(a < b for a, b in zip(size, checked[i - 1])):
            problems.append(f"'stage_sizes' must not shrink from stage {i} to {i + 1}, got {stage_sizes!r}.")
        if source and stage_ok and i < stage and any(s > m for s, m in zip(size, source)):
            problems.append(
                f"stage {i + 1}'s size {size} is larger than 'source_size' {source}, the resolution the CT is "
                "loaded at: raise source_size."
            )
    return problems


def view_problems(
    views: Sequence[str],
    view_size: Sequence[int],
    source_size: Sequence[int],
    stage: int,
    stage_sizes: Sequence[Sequence[int]],
    view_files: bool,
) -> list[str]:
    """Distinct known ``views`` of ``view_size`` pixels. The X-rays must not be interpolated up anywhere, or the ground
    truth would not satisfy the projection loss: made by the projector (not read from ``view_files``), they come from
    the CT at ``source_size`` (each view's plane at least ``view_size``); the loss compares them at the stage's plane
    (at most ``view_size``)."""
    problems = _size_problem("view_size", view_size, dims=2)
    view = _sizes(view_size, dims=2)
    listed = list(views) if isinstance(views, (list, tuple)) else None
    if not listed or any(v not in VIEW_AXES for v in listed) or len(set(listed)) != len(listed):
        return problems + [f"'views' must be distinct names out of {sorted(VIEW_AXES)}, got {views!r}."]
    if not view:
        return problems
    source = _sizes(source_size)
    current = _sizes(stage_sizes[stage - 1]) if _stage_ok(stage, stage_sizes) and _stage_count(stage_sizes) else None
    for name in listed:
        if source is not None and view_files is not True and any(p < v for p, v in zip(view_plane(source, name), view)):
            problems.append(
                f"'view_size' {view} is finer than the {name} projection {list(view_plane(source, name))} of the CT "
                f"the X-rays are made from ('source_size' {source}): they would be interpolated and the ground "
                "truth would not satisfy the projection loss; raise source_size or lower view_size."
            )
        if current is not None and any(p > v for p, v in zip(view_plane(current, name), view)):
            problems.append(
                f"the stage's {name} projection {list(view_plane(current, name))} is finer than 'view_size' {view}: "
                "the projection loss would compare with interpolated X-rays; raise view_size."
            )
    return problems


def vit_problems(view_size: Sequence[int], vit_patch_size: int, vit_hidden_size: int, vit_heads: int) -> list[str]:
    """The X-ray encoder's patches tile the views; its width splits into its heads."""
    problems = []
    view = _sizes(view_size, dims=2)
    if view and is_positive_int(vit_patch_size) and any(v % vit_patch_size for v in view):
        problems.append(f"'vit_patch_size' {vit_patch_size} must divide 'view_size' {view}.")
    if is_positive_int(vit_heads) and int(vit_hidden_size) % vit_heads:
        problems.append(f"'vit_hidden_size' {vit_hidden_size} must be divisible by 'vit_heads' {vit_heads}.")
    return problems


def training_mode_problems(mode: str) -> list[str]:
    """A trainable ``mode``."""
    if mode in MODES:
        return []
    extra = " ('backprojection' has nothing to train: evaluate it with evaluate.json)" if mode in SAMPLER_MODES else ""
    return [f"'mode' must be one of {MODES}, got {mode!r}{extra}."]


def evaluation_mode_problems(mode: str) -> list[str]:
    """A ``mode`` evaluation can run: a trained one, or the ``backprojection`` baseline."""
    return choice_problems(mode=(mode, SAMPLER_MODES))


def schedule_problems(prediction_type: str, grid: str, num_grid_steps: int, num_train_timesteps: int) -> list[str]:
    """A known prediction and a grid :func:`common.diffusion.schedule.fast_ddpm_grid` can build
    (:func:`common.diffusion.schedule.grid_problems`)."""
    problems = choice_problems(prediction_type=(prediction_type, PREDICTIONS))
    return problems + grid_problems(grid, num_grid_steps, num_train_timesteps)


def unet_problems(
    unet_channels: Sequence[int], attention_levels: Sequence[bool], norm_num_groups: int, num_head_channels: int
) -> list[str]:
    """One boolean of ``attention_levels`` per level; ``num_head_channels`` divides the channels of the levels with
    attention, ``norm_num_groups`` those of every level."""
    problems = [
        f"{name!r} must be an integer >= 1, got {value!r}."
        for name, value in (("num_head_channels", num_head_channels), ("norm_num_groups", norm_num_groups))
        if not is_positive_int(value)
    ]
    channels = [int(c) for c in unet_channels]
    heads = num_head_channels if is_positive_int(num_head_channels) else 1
    groups = norm_num_groups if is_positive_int(norm_num_groups) else 1
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
    return problems


def loss_problems(
    physics_weight: float, physics_weighting: str, direct_loss: str, loss_weighting: str, min_snr_gamma: float
) -> list[str]:
    """Known losses and weightings, a projection-loss weight >= 0 and a positive min-SNR gamma."""
    problems = [] if float(physics_weight) >= 0 else [f"'physics_weight' must be >= 0, got {physics_weight!r}."]
    problems += choice_problems(
        physics_weighting=(physics_weighting, PHYSICS_WEIGHTINGS),
        direct_loss=(direct_loss, DIRECT_LOSSES),
        loss_weighting=(loss_weighting, LOSS_WEIGHTINGS),
    )
    if not _positive(min_snr_gamma):
        problems.append(f"'min_snr_gamma' must be a positive number, got {min_snr_gamma!r}.")
    return problems


def optimisation_problems(batch_size: int, accumulation_steps: int, ema_decay: float) -> list[str]:
    """Counts >= 1 and an EMA decay in (0, 1)."""
    problems = [
        f"{name!r} must be an integer >= 1, got {value!r}."
        for name, value in (("batch_size", batch_size), ("accumulation_steps", accumulation_steps))
        if not is_positive_int(value)
    ]
    if not 0.0 < float(ema_decay) < 1.0:
        problems.append(f"'ema_decay' must be in (0, 1), got {ema_decay!r}.")
    return problems


def residual_scale_problems(residual_scale: float) -> list[str]:
    """The residual mode's scale of the refinement: a positive number."""
    return [] if _positive(residual_scale) else [f"'residual_scale' must be a positive number, got {residual_scale!r}."]


def regressor_problems(mode: str, regressor_dir: str | None, stage: int) -> list[str]:
    """Training the residual mode refines a trained ``direct`` regressor: ``regressor_dir`` is the run holding this
    stage's weights."""
    if mode != "residual":
        return []
    if not regressor_dir:
        return [
            "'mode' residual refines a trained direct regressor: pass --regressor_dir, the output_dir of a "
            "'--mode direct' run of the same stages and network."
        ]
    if not is_positive_int(stage):
        return []  # stage_problems names it
    path = Path(stage_checkpoint(regressor_dir, stage))
    if path.is_file():
        return []
    return [
        f"'regressor_dir' {regressor_dir!r} has no trained stage {stage} regressor: {str(path)!r} does not "
        f"exist (train it first with --mode direct --output_dir {regressor_dir} --stage {stage})."
    ]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def uncertainty_problems(uncertainty_scale: float, uncertainty_floor: float) -> list[str]:
    """The calibration of the samples' spread, ``uncertainty_scale * (std + uncertainty_floor)`` (fitted on
    validation cases; 1 and 0: the samples' own): a factor > 0 and a floor >= 0."""
    problems = []
    if not (_number(uncertainty_scale) and uncertainty_scale > 0):
        problems.append(
            f"'uncertainty_scale' must be a number > 0 (1: the samples' own spread), got {uncertainty_scale!r}."
        )
    if not (_number(uncertainty_floor) and uncertainty_floor >= 0):
        problems.append(f"'uncertainty_floor' must be a number >= 0 (0: none), got {uncertainty_floor!r}.")
    return problems


def consistency_problems(views: Sequence[str], consistency_reference: Any, mismatch_tolerance: float) -> list[str]:
    """The consistency check of the projection corrections: ``consistency_reference`` is null (off) or its bounds
    per statistic and view (:func:`common.xray2ct.drr.consistency_bounds`, fitted by ``evaluate.json --calibrate
    True``), and ``mismatch_tolerance`` a factor > 0."""
    problems = []
    try:
        consistency_bounds(consistency_reference, views)
    except ValueError as exc:
        problems.append(str(exc))
    if not (_number(mismatch_tolerance) and math.isfinite(mismatch_tolerance) and mismatch_tolerance > 0):
        problems.append(
            "'mismatch_tolerance' must be a number > 0 (a view whose first estimate leaves more than this many times "
            f"a bound of its consistency_reference gets no correction), got {mismatch_tolerance!r}."
        )
    return problems


def projection_problems(
    hu_window: Sequence[float],
    fov_mm: float | Sequence[float],
    mu_water: float,
    geometry: str,
    source_to_isocenter_mm: float,
    source_to_detector_mm: float,
) -> list[str]:
    """The X-ray projector (:class:`common.xray2ct.drr.DRRProjector`): a CT window ``(hu_min, hu_max)`` with
    ``-1000 <= hu_min < hu_max`` (air has no attenuation), a positive field of view (one number or one per axis, mm),
    a positive attenuation of water (1/cm) and a beam ``geometry``; a cone beam's source outside the volume and its
    detector behind the volume's centre."""
    problems = []
    window = list(hu_window) if isinstance(hu_window, (list, tuple)) else None
    if not window or len(window) != 2 or not all(_number(v) for v in window) or not -1000 <= window[0] < window[1]:
        problems.append(
            f"'hu_window' must be [hu_min, hu_max] with -1000 <= hu_min < hu_max (air, -1000 HU, has no "
            f"attenuation), got {hu_window!r}."
        )
    fov = list(fov_mm) if isinstance(fov_mm, (list, tuple)) else [fov_mm]
    fov_ok = len(fov) in (1, 3) and all(_number(v) and v > 0 for v in fov)
    if not fov_ok:
        problems.append(f"'fov_mm' must be a positive number or 3 positive numbers (mm), got {fov_mm!r}.")
    if not (_number(mu_water) and mu_water > 0):
        problems.append(f"'mu_water' must be a positive number (1/cm), got {mu_water!r}.")
    problems += choice_problems(geometry=(geometry, GEOMETRIES))
    if geometry != "cone":
        return problems
    distances = {"source_to_isocenter_mm": source_to_isocenter_mm, "source_to_detector_mm": source_to_detector_mm}
    bad = [
        f"{name!r} must be a number of mm, got {value!r}." for name, value in distances.items() if not _number(value)
    ]
    if bad or not fov_ok:
        return problems + bad
    reach = math.sqrt(sum((f / 2) ** 2 for f in (fov * 3 if len(fov) == 1 else fov)))
    if not source_to_isocenter_mm > reach:
        problems.append(
            f"'source_to_isocenter_mm' must put the cone beam's source outside the volume (> {reach:.1f} mm, half "
            f"the diagonal of fov_mm), got {source_to_isocenter_mm!r}."
        )
    elif not source_to_detector_mm >= source_to_isocenter_mm:
        problems.append(
            f"'source_to_detector_mm' must be at least source_to_isocenter_mm {source_to_isocenter_mm!r} (the "
            f"detector is behind the patient), got {source_to_detector_mm!r}."
        )
    return problems


SWITCHES = (
    "view_files",
    "init_from_previous",
    "gradient_checkpointing",
    "compile",
    "preflight",
    "allow_irregular_series",
    "ema_warmup",
    "oom_backoff",
)
_TRAINING_SWITCHES = switches(*SWITCHES)

TRAINING = SettingsChecks(
    "X-ray -> CT",
    stage_problems,
    view_problems,
    vit_problems,
    training_mode_problems,
    schedule_problems,
    unet_problems,
    loss_problems,
    optimisation_problems,
    residual_scale_problems,
    regressor_problems,
    sampling_problems,
    projection_problems,
    condition_problems,
    uncertainty_problems,
    consistency_problems,
    cache_problems,
    _TRAINING_SWITCHES,
    *TRAINING_RUN_CHECKS,
)
"""The checks of a training run (``train.json``): besides the checks above, the ``cache_rate``/``replace_rate`` of
:func:`common.data.pipeline.cache_problems` and on/off settings that are not booleans."""


def trained_network_problems(views: Sequence[str], view_size: Sequence[int], trained: dict) -> list[str]:
    """Inference runs the network of the run record (``trained``, the settings it was trained with): its X-ray
    encoder was built for its ``views`` and ``view_size`` (the patch grid and position embeddings of its ViT)."""
    problems = _size_problem("view_size", view_size, dims=2)
    view = _sizes(view_size, dims=2)
    built = _sizes(trained.get("view_size"), dims=2)
    if view and built and view != built:
        problems.append(
            f"'view_size' {view} is not the view size the trained network was built for, {built} ('view_size' of "
            "its run record, 'trained'): its X-ray encoder's patches and position embeddings fit that size only; "
            f"leave view_size out or pass {built}."
        )
    listed = list(views) if isinstance(views, (list, tuple)) else None
    if not listed or any(v not in VIEW_AXES for v in listed) or len(set(listed)) != len(listed):
        problems.append(f"'views' must be distinct names out of {sorted(VIEW_AXES)}, got {views!r}.")
    elif trained.get("views") is not None and listed != list(trained["views"]):
        problems.append(
            f"'views' {listed} are not the views the trained network was built for, {list(trained['views'])} "
            "('views' of its run record, 'trained'), in that order."
        )
    return problems


def trained_mode_problems(mode: str, trained: dict) -> list[str]:
    """Evaluation and inference run the weights of the run record (``trained``) in the ``mode`` they were trained in
    (another mode would read a regressor as a denoiser, or the reverse, and score what it wrote), or the network-free
    ``backprojection`` baseline; and ``mode`` is one of :data:`SAMPLER_MODES`."""
    problems = evaluation_mode_problems(mode)
    trained_mode = trained.get("mode")
    if mode in SAMPLER_MODES and trained_mode is not None and mode not in (trained_mode, "backprojection"):
        problems.append(
            f"'mode' {mode!r} is not the mode the trained network was trained in, {trained_mode!r} ('mode' of its "
            "run record, 'trained'): run it in that mode, or 'backprojection' (no network)."
        )
    return problems


EVALUATION = TRAINING.with_checks(
    trained_mode_problems,
    switches(*SWITCHES, "save_volumes", "calibrate", "record_calibration"),
    without=(training_mode_problems, regressor_problems, _TRAINING_SWITCHES),
)
"""The checks of an evaluation (``evaluate.json`` on ``train.json``): ``mode`` is the mode the run's weights were
trained in or the ``backprojection`` baseline (:func:`trained_mode_problems`), no regressor run is needed, and
``save_volumes``, ``calibrate`` and ``record_calibration`` are switches too."""


def noise_problems(eta: float, seed: int) -> list[str]:
    """The DDIM ``eta`` in [0, 1] and the integer ``seed`` >= 0 of each case's sampling noise."""
    problems = []
    if not (_number(eta) and 0 <= eta <= 1):
        problems.append(f"'eta' must be a number in [0, 1] (0: deterministic DDIM), got {eta!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        problems.append(f"'seed' must be an integer >= 0 (it seeds each case's sampling noise), got {seed!r}.")
    return problems


INFERENCE = SettingsChecks(
    "X-ray -> CT inference",
    stage_problems,
    trained_network_problems,
    trained_mode_problems,
    vit_problems,
    schedule_problems,
    unet_problems,
    sampling_problems,
    residual_scale_problems,
    noise_problems,
    projection_problems,
    condition_problems,
    uncertainty_problems,
    consistency_problems,
    orientation_problems,
    *CASE_RUN_CHECKS,
    switches("save_volumes"),
)
"""The checks of an inference run (``inference.json``), before any weights or case are read: the stages, the views
and ``view_size`` against the trained network's (:func:`trained_network_problems`) and its ViT's patches
(:func:`vit_problems`), the schedule, U-Net and sampling, the projector, the preprocessing's ``orientation``, how the
command runs (:data:`common.config_checks.CASE_RUN_CHECKS`) and the on/off settings."""
