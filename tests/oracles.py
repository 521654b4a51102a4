# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Independent oracles of the bundles' JSON pipelines: each builds in Python, step by step, the chain a bundle's
config declares, so a test can check that the config (the one owner of the pipeline, which users edit) still gives
the same tensors. None of this is part of the library or of a packaged bundle.

* :func:`volume_transforms`: ``train#preprocessing`` / ``validate#preprocessing`` of ``autoencoder_3d`` and
  ``vqgan_3d`` (load, orientation, spacing, intensity, padding, crops);
* :func:`diffusion_transforms`: those of ``fast_ddpm_3d`` (volumes stacked as channels in ``[-1, 1]``, latents);
* :func:`survival_transforms`: those of ``mace_survival`` (one whole volume per case with its outcome);
* :func:`xray2ct_transforms`: ``train#deterministic`` of ``xray2ct_cascade`` (the CT and its X-rays);
* :func:`make_dataset`: the datasets of the configs (a ``SmartCacheDataset`` of this rank's partition).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from monai.data import CacheDataset, SmartCacheDataset
from monai.transforms import (
    Compose,
    ConcatItemsd,
    CropForegroundd,
    DeleteItemsd,
    DivisiblePadd,
    EnsureChannelFirstd,
    EnsureTyped,
    Orientationd,
    RandAffined,
    RandGaussianNoised,
    RandSpatialCropSamplesd,
    Resized,
    ResizeWithPadOrCropd,
    ScaleIntensityRanged,
    SelectItemsd,
    Spacingd,
    SpatialPadd,
)
from monai.utils import CommonKeys as Keys

from common.data.dicom import LoadVolumed
from common.data.intensity import intensity_transform
from common.data.pipeline import CaseMetad, cache_problems, cache_size, partition_for_rank
from common.diffusion.transforms import CopyChannelsd, EncodeLatentd
from common.survival.transforms import AboveThreshold
from common.utils import get_rank
from common.xray2ct.data import DRRd, LoadViewsd, grid_spacing, view_keys
from common.xray2ct.drr import DRRProjector

__all__ = [
    "diffusion_transforms",
    "make_dataset",
    "pad_steps",
    "spatial_steps",
    "survival_transforms",
    "volume_transforms",
    "xray2ct_transforms",
]


def spatial_steps(
    keys: Sequence[str], orientation: str | None, spacing: Sequence[float] | None, stack_as: str | None = None
) -> list:
    """Load -> channel first (-> stack ``keys`` as the channels of ``stack_as``) -> orientation -> spacing."""
    keys = list(keys)
    steps: list = [LoadVolumed(keys, image_only=True), EnsureChannelFirstd(keys)]
    if stack_as is not None:
        steps.append(ConcatItemsd(keys, name=stack_as))
        others = [k for k in keys if k != stack_as]
        if others:
            steps.append(DeleteItemsd(others))
        keys = [stack_as]
    if orientation:
        steps.append(Orientationd(keys, axcodes=orientation, labels=(("L", "R"), ("P", "A"), ("I", "S"))))
    if spacing is not None:
        steps.append(Spacingd(keys, pixdim=tuple(float(s) for s in spacing), mode="bilinear"))
    return steps


def pad_steps(keys: Sequence[str], patch_size: Sequence[int] | None, divisible_by: Sequence[int] | int | None) -> list:
    """Zero-pad to at least ``patch_size`` and to a multiple of ``divisible_by`` (per axis)."""
    steps: list = []
    if patch_size is not None:
        steps.append(SpatialPadd(list(keys), spatial_size=tuple(int(p) for p in patch_size)))
    if divisible_by is not None:
        k = [int(divisible_by)] * 3 if isinstance(divisible_by, int) else [int(v) for v in divisible_by]
        steps.append(DivisiblePadd(list(keys), k=k))
    return steps


def volume_transforms(
    keys: Sequence[str] = ("image",),
    intensity: Mapping[str, Any] | None = None,
    spacing: Sequence[float] | None = None,
    orientation: str | None = "RAS",
    patch_size: Sequence[int] | None = None,
    num_samples: int = 1,
    cache_device: torch.device | str | None = None,
    train: bool = True,
    divisible_by: Sequence[int] | int | None = None,
    invertible_intensity: bool = True,
) -> Compose:
    """Load -> channel first -> orientation -> spacing -> intensity -> pad -> device -> random crops.

    Everything before the random crop is deterministic and is cached by the dataset; ``cache_device`` moves
    the volume there right after the deterministic part, so with ``cuda`` the cache lives in GPU memory and the
    random crops run on the GPU.

    Args:
        keys: image keys.
        intensity: see :func:`intensity_transform` (default MRI percentiles).
        spacing: target voxel size in mm (``None`` keeps the native grid).
        orientation: axis codes (``None`` keeps the native orientation).
        patch_size: training patch; volumes smaller than it are zero-padded.
        num_samples: random patches drawn per volume per visit (training only).
        cache_device: device of the cached volumes (``None``: CPU).
        train: add the random crop (validation/inference keep whole volumes).
        divisible_by: also pad every spatial size to a multiple of this (per axis), e.g. a network's total
            downsampling, so whole-volume latents have an integer size; the same padding in training,
            validation and inference keeps them consistent (inference undoes it with ``Invertd``).
        invertible_intensity: record the per-volume percentiles so that ``Invertd`` also returns a reconstruction
            to the input's intensity units (see :func:`intensity_transform`; the values are the same either way).
    """
    keys = list(keys)
    transforms = spatial_steps(keys, orientation, spacing)
    norm = intensity_transform(keys, intensity or {"mode": "mri"}, invertible=invertible_intensity)
    if norm is not None:
        transforms.append(norm)
    transforms += pad_steps(keys, patch_size, divisible_by)
    transforms.append(EnsureTyped(keys, dtype=torch.float32, device=cache_device, track_meta=not train))
    if train:
        if patch_size is None:
            raise ValueError("patch_size is required for training transforms.")
        transforms.append(
            RandSpatialCropSamplesd(
                keys, roi_size=tuple(int(p) for p in patch_size), num_samples=int(num_samples), random_size=False
            )
        )
    return Compose(transforms)


def make_dataset(
    data: Sequence[Mapping[str, Any]],
    transform: Compose,
    cache_rate: float = 1.0,
    replace_rate: float = 0.2,
    num_init_workers: int | None = None,
    num_replace_workers: int | None = None,
    partition: bool = True,
    shuffle: bool = True,
    seed: int = 0,
    even_divisible: bool = True,
    progress: bool = False,
) -> CacheDataset:
    """The training dataset of the configs' ``train#dataset``, for this rank's partition: a ``SmartCacheDataset``
    of ``cache_size(items, cache_rate)`` items swapping ``replace_rate`` of them each epoch; with everything cached
    (nothing to swap) the equivalent ``CacheDataset``. The rates follow the configs' one rule
    (:func:`common.data.pipeline.cache_problems`).

    Raises:
        ValueError: for rates the configs refuse.
    """
    problems = cache_problems(cache_rate, replace_rate)
    if problems:
        raise ValueError(problems[0])
    items = (
        partition_for_rank(data, shuffle=shuffle, seed=seed, even_divisible=even_divisible) if partition else list(data)
    )
    cache_num = cache_size(items, cache_rate)
    if cache_num < len(items):
        return SmartCacheDataset(
            items,
            transform=transform,
            replace_rate=float(replace_rate),
            cache_num=cache_num,
            num_init_workers=num_init_workers,
            num_replace_workers=num_replace_workers,
            progress=progress,
            shuffle=shuffle,
            seed=seed + get_rank(),
        )
    return CacheDataset(items, transform=transform, cache_rate=1.0, num_workers=num_init_workers, progress=progress)


def diffusion_transforms(
    keys: Sequence[str],
    intensity: Mapping[str, Any] | None = None,
    spacing: Sequence[float] | None = None,
    orientation: str | None = "RAS",
    patch_size: Sequence[int] | None = None,
    num_samples: int = 1,
    cache_device: torch.device | str | None = None,
    train: bool = True,
    divisible_by: Sequence[int] | int | None = None,
    label_channels: Sequence[int] | None = None,
    latent_codec: torch.nn.Module | None = None,
) -> Compose:
    """Transforms of a diffusion bundle: every volume of ``keys`` (e.g. the four BraTS modalities, or a source and
    a target image) stacked in that order as the channels of ``image``, in ``[-1, 1]``.

    Load -> channel first -> stack ``keys`` as ``image`` -> orientation -> spacing -> intensity per channel
    (``[0, 1]``, see :func:`intensity_transform`) -> zero-pad to ``patch_size`` and ``divisible_by`` -> map to
    ``[-1, 1]`` (padding becomes -1, the background) -> [``label``: the ``label_channels`` of ``image``] ->
    [latents of ``latent_codec``] -> ``cache_device`` -> [training: random crops of ``patch_size`` (divided by
    the codec's downsampling in latent mode)]. The entry's ``case_id`` is kept in the metadata of ``image``.

    Args:
        keys: datalist keys of the volumes, stacked as channels in this order (inference: the sources only).
        intensity: see :func:`intensity_transform`; with mode ``none`` the values are kept (they should already
            be in ``[-1, 1]``).
        spacing: target voxel size in mm (``None`` keeps the native grid).
        orientation: axis codes (``None`` keeps the native orientation).
        patch_size: training patch in image voxels; smaller volumes are padded.
        num_samples: random patches per volume per visit (training only).
        cache_device: device of the cached volumes (``None``: CPU).
        train: add the random crop.
        divisible_by: pad every spatial size to a multiple of this, e.g. the U-Net's (times the autoencoder's)
            downsampling, so whole volumes can be sampled.
        label_channels: channels of ``image`` copied to ``label`` (validation: the clean target, kept in image
            space in latent mode); ``None``: no label.
        latent_codec: a :class:`common.diffusion.latent.LatentCodec`: ``image`` becomes its raw latents.

    Raises:
        ValueError: without ``keys``, or without ``patch_size`` for training.
    """
    keys = list(keys)
    if not keys:
        raise ValueError("diffusion_transforms needs at least one image key.")
    if train and patch_size is None:
        raise ValueError("patch_size is required for training transforms.")
    image = Keys.IMAGE
    transforms = [*spatial_steps(keys, orientation, spacing, stack_as=image), CaseMetad(image)]
    intensity = intensity or {"mode": "mri"}
    # the sources' percentiles say nothing about a synthesised target: nothing to record for inverting it
    norm = intensity_transform([image], intensity, channel_wise=True, invertible=False)
    if norm is not None:
        transforms.append(norm)
    transforms += pad_steps([image], patch_size, divisible_by)
    if norm is not None:
        transforms.append(ScaleIntensityRanged(image, a_min=0.0, a_max=1.0, b_min=-1.0, b_max=1.0))
    out_keys = [image]
    if label_channels is not None:
        transforms.append(CopyChannelsd(image, label_channels, name=Keys.LABEL))
        out_keys.append(Keys.LABEL)
    if latent_codec is not None:
        transforms.append(EncodeLatentd(image, latent_codec))
    transforms.append(EnsureTyped(out_keys, dtype=torch.float32, device=cache_device, track_meta=not train))
    if train:
        factors = list(latent_codec.downsample) if latent_codec is not None else [1] * len(patch_size)
        crop = tuple(int(p) // int(f) for p, f in zip(patch_size, factors))
        transforms.append(
            RandSpatialCropSamplesd(image, roi_size=crop, num_samples=int(num_samples), random_size=False)
        )
    return Compose(transforms)


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


def xray2ct_transforms(
    projector: DRRProjector,
    volume_size: Sequence[int],
    source_size: Sequence[int] | None = None,
    with_image: bool = True,
    view_files: bool = False,
    orientation: str | None = "RAS",
    cache_device: torch.device | str | None = None,
) -> Compose:
    """Deterministic transforms of one stage (cache them): the CT as ``image`` and the X-rays as ``xray``.

    CT: load (NIfTI or a DICOM series folder) -> channel first -> ``orientation`` -> resample to the isotropic grid
    of ``source_size`` voxels over the projector's ``fov_mm`` -> HU window of the projector to ``[0, 1]`` -> centred
    pad (air) or crop to ``source_size`` -> ``[-1, 1]`` -> [``xray`` made by the projector at this resolution] ->
    area-average to the stage's ``volume_size``. X-rays from files (``view_files``) are read with
    :class:`LoadViewsd` instead. Making the X-rays at ``source_size`` for every stage gives each stage the same
    inputs (set it to the last stage's size); the projection loss compares at the stage's own resolution.

    Args:
        projector: the DRR projector (views, view size, FOV, HU window).
        volume_size: the stage's volume size.
        source_size: the grid the CT is loaded at and the X-rays are made from (default ``volume_size``).
        with_image: load the CT (``False`` for inference from X-ray files alone).
        view_files: read the X-rays from the ``xray_<view>`` files of each entry.
        orientation: axis codes of the CT (``RAS`` for the projector's view axes).
        cache_device: device of the cached tensors.

    Raises:
        ValueError: without the CT and without X-ray files.
    """
    if not with_image and not view_files:
        raise ValueError("xray2ct_transforms needs the CT (with_image) or X-ray files (view_files), got neither.")
    volume = [int(s) for s in volume_size]
    source = [int(s) for s in (source_size or volume)]
    image, keys = "image", []
    steps: list = []
    if with_image:
        spacing = grid_spacing(projector, source)
        steps += [*spatial_steps([image], orientation, spacing), CaseMetad(image)]
        steps += [
            ScaleIntensityRanged(
                image, a_min=projector.hu_min, a_max=projector.hu_max, b_min=0.0, b_max=1.0, clip=True
            ),
            ResizeWithPadOrCropd(image, spatial_size=source),  # zero padding: the bottom of the window (air)
            ScaleIntensityRanged(image, a_min=0.0, a_max=1.0, b_min=-1.0, b_max=1.0),
        ]
        if not view_files:
            steps.append(DRRd(image, projector))
        if volume != source:
            steps.append(Resized(image, spatial_size=volume, mode="area"))
        keys.append(image)
    if view_files:
        steps.append(LoadViewsd(view_keys(projector), projector.view_size))
    keys.append("xray")
    steps.append(EnsureTyped(keys, dtype=torch.float32, device=cache_device, track_meta=True))
    return Compose(steps)
