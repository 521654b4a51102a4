# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Transforms of the survival family: one whole volume per case at a fixed size, with its outcome as tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from monai.transforms import (
    Compose,
    CropForegroundd,
    EnsureTyped,
    RandAffined,
    RandGaussianNoised,
    ResizeWithPadOrCropd,
    SelectItemsd,
)
from monai.utils import CommonKeys as Keys

from common.data.pipeline import CaseMetad, intensity_transform, spatial_steps

__all__ = ["AboveThreshold", "survival_transforms"]


class AboveThreshold:
    """``x > threshold``: a picklable foreground selector for ``CropForegroundd`` (its ``select_fn``), declared in
    a config as ``{"_target_": "common.survival.transforms.AboveThreshold", "threshold": 0.05}``.

    Args:
        threshold: the value above which a voxel is foreground.
    """

    def __init__(self, threshold: float) -> None:
        self.threshold = float(threshold)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x > self.threshold


def survival_transforms(
    image_size: Sequence[int],
    intensity: Mapping[str, Any] | None = None,
    spacing: Sequence[float] | None = None,
    orientation: str | None = "RAS",
    crop_foreground: bool = True,
    foreground_threshold: float = 0.05,
    cache_device: torch.device | str | None = None,
    train: bool = True,
    augment: bool = True,
) -> Compose:
    """Transforms of a survival bundle: one whole volume per case at a fixed size, with its outcome as tensors.

    Keep ``image``, ``case_id``, ``time``, ``event``, ``covariates`` (other entry keys, e.g. the CSV row or split,
    are dropped) -> load -> channel first -> orientation -> spacing -> intensity to ``[0, 1]`` (see :func:`intensity_transform`;
    e.g. a CT window) -> [crop to the body: voxels above ``foreground_threshold``] -> centred zero-pad or crop to
    ``image_size`` -> ``time``/``event``/``covariates`` as float tensors -> ``cache_device`` -> [training with
    ``augment``: a random affine (rotation up to 0.1 rad, scaling 10%, translation 5% of the size) and Gaussian
    noise, on ``cache_device``, i.e. on the GPU when the cache is there]. The entry's ``case_id`` is kept in the
    metadata of ``image``. Everything before the augmentation is deterministic and cached.

    Args:
        image_size: the network input size (voxels).
        intensity: see :func:`intensity_transform` (default: MRI percentiles; CT uses a HU window).
        spacing: target voxel size in mm (``None`` keeps the native grid).
        orientation: axis codes (``None`` keeps the native orientation).
        crop_foreground: crop to the bounding box of the body before padding/cropping to ``image_size``.
        foreground_threshold: intensity (after normalisation) above which a voxel is body.
        cache_device: device of the cached volumes (``None``: CPU).
        train: training transforms (with augmentation when ``augment``).
        augment: random affine and noise in training.
    """
    image = Keys.IMAGE
    size = tuple(int(s) for s in image_size)
    keep = SelectItemsd([image, "case_id", "time", "event", "covariates"], allow_missing_keys=True)
    transforms = [keep, *spatial_steps([image], orientation, spacing), CaseMetad(image)]
    norm = intensity_transform([image], intensity or {"mode": "mri"})
    if norm is not None:
        transforms.append(norm)
    if crop_foreground:
        transforms.append(
            CropForegroundd(image, source_key=image, select_fn=AboveThreshold(foreground_threshold), allow_smaller=True)
        )
    transforms += [
        ResizeWithPadOrCropd(image, spatial_size=size),
        EnsureTyped(["time", "event", "covariates"], dtype=torch.float32, allow_missing_keys=True),
        EnsureTyped(image, dtype=torch.float32, device=cache_device, track_meta=not train),
    ]
    if train and augment:
        transforms += [
            RandAffined(
                image,
                prob=0.5,
                rotate_range=(0.1, 0.1, 0.1),
                scale_range=(0.1, 0.1, 0.1),
                translate_range=tuple(0.05 * s for s in size),
                padding_mode="zeros",
                device=None if cache_device is None else torch.device(cache_device),
            ),
            RandGaussianNoised(image, prob=0.2, std=0.01),
        ]
    return Compose(transforms)
