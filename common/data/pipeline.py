# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Volume transforms, cached datasets (SmartCache per rank, optional GPU cache) and loaders."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from monai.data import CacheDataset, MetaTensor, SmartCacheDataset, ThreadDataLoader, partition_dataset
from monai.transforms import (
    Compose,
    DivisiblePadd,
    EnsureChannelFirstd,
    EnsureTyped,
    Invertd,
    LoadImaged,
    MapTransform,
    Orientationd,
    RandSpatialCropSamplesd,
    SaveImaged,
    ScaleIntensityRanged,
    ScaleIntensityRangePercentilesd,
    Spacingd,
    SpatialPadd,
)

from common.utils import get_rank, get_world_size

__all__ = [
    "raise_no_inputs",
    "LatentAffined",
    "VQCodesd",
    "inference_postprocessing",
    "intensity_transform",
    "make_dataset",
    "make_loader",
    "partition_for_rank",
    "volume_transforms",
]

logger = logging.getLogger(__name__)


def intensity_transform(keys: Sequence[str], intensity: Mapping[str, Any]):
    """Intensity normalisation to [0, 1] from a config mapping.

    ``{"mode": "ct", "a_min": -1000, "a_max": 1000}`` clips a Hounsfield window; ``{"mode": "mri",
    "lower": 0.5, "upper": 99.5}`` rescales between per-volume percentiles (robust to scanner scaling);
    ``{"mode": "none"}`` keeps the values.

    Raises:
        ValueError: for an unknown mode or a window with ``a_min >= a_max``.
    """
    mode = str(intensity.get("mode", "mri")).lower()
    if mode == "ct":
        a_min, a_max = float(intensity.get("a_min", -1000)), float(intensity.get("a_max", 1000))
        if a_min >= a_max:
            raise ValueError(f"intensity: a_min must be < a_max, got {a_min} and {a_max}.")
        return ScaleIntensityRanged(keys, a_min=a_min, a_max=a_max, b_min=0.0, b_max=1.0, clip=True)
    if mode == "mri":
        lower, upper = float(intensity.get("lower", 0.5)), float(intensity.get("upper", 99.5))
        if not 0 <= lower < upper <= 100:
            raise ValueError(f"intensity: need 0 <= lower < upper <= 100, got {lower} and {upper}.")
        return ScaleIntensityRangePercentilesd(keys, lower=lower, upper=upper, b_min=0.0, b_max=1.0, clip=True)
    if mode == "none":
        return None
    raise ValueError(f"intensity mode must be 'ct', 'mri' or 'none', got {mode!r}.")


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
    """
    keys = list(keys)
    transforms: list = [LoadImaged(keys, image_only=True), EnsureChannelFirstd(keys)]
    if orientation:
        transforms.append(Orientationd(keys, axcodes=orientation, labels=(("L", "R"), ("P", "A"), ("I", "S"))))
    if spacing is not None:
        transforms.append(Spacingd(keys, pixdim=tuple(float(s) for s in spacing), mode="bilinear"))
    norm = intensity_transform(keys, intensity or {"mode": "mri"})
    if norm is not None:
        transforms.append(norm)
    if patch_size is not None:
        transforms.append(SpatialPadd(keys, spatial_size=tuple(int(p) for p in patch_size)))
    if divisible_by is not None:
        k = [int(divisible_by)] * 3 if isinstance(divisible_by, int) else [int(v) for v in divisible_by]
        transforms.append(DivisiblePadd(keys, k=k))
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


def partition_for_rank(data: Sequence[Any], shuffle: bool = True, seed: int = 0, even_divisible: bool = True) -> list:
    """This rank's share of ``data`` (all of it when not distributed).

    With ``even_divisible`` every rank gets the same number of items (a few repeated when needed), so all ranks
    take the same number of steps per epoch; validation uses ``even_divisible=False`` unless there are fewer
    items than ranks.
    """
    world = get_world_size()
    data = list(data)
    if world == 1:
        return data
    if not data:
        raise ValueError("cannot partition an empty datalist across ranks.")
    even = even_divisible or len(data) < world
    if len(data) < world:  # partition_dataset refuses fewer items than partitions: repeat them
        data = (data * (world // len(data) + 1))[:world]
    return list(
        partition_dataset(data, num_partitions=world, shuffle=shuffle, seed=seed, even_divisible=even)[get_rank()]
    )


def make_dataset(
    data: Sequence[Mapping[str, Any]],
    transform: Compose,
    cache_rate: float = 1.0,
    replace_rate: float = 0.0,
    num_init_workers: int | None = None,
    num_replace_workers: int | None = None,
    partition: bool = True,
    shuffle: bool = True,
    seed: int = 0,
    even_divisible: bool = True,
    progress: bool = False,
) -> CacheDataset:
    """A cached dataset of this rank's partition.

    ``replace_rate > 0`` with ``cache_rate < 1`` gives a ``SmartCacheDataset`` that swaps ``replace_rate`` of its
    cache in a background thread each epoch (attach ``monai.handlers.SmartCacheHandler``); otherwise a
    ``CacheDataset`` caches ``cache_rate`` of the partition once.
    """
    if not 0.0 <= float(cache_rate) <= 1.0:
        raise ValueError(f"cache_rate must be in [0, 1], got {cache_rate!r}.")
    if not 0.0 <= float(replace_rate) <= 1.0:
        raise ValueError(f"replace_rate must be in [0, 1], got {replace_rate!r}.")
    items = (
        partition_for_rank(data, shuffle=shuffle, seed=seed, even_divisible=even_divisible) if partition else list(data)
    )
    cache_num = max(1, int(len(items) * float(cache_rate))) if items else 0
    if float(replace_rate) > 0 and cache_num < len(items):
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
    return CacheDataset(
        items, transform=transform, cache_rate=float(cache_rate), num_workers=num_init_workers, progress=progress
    )


def make_loader(
    dataset: torch.utils.data.Dataset, batch_size: int = 1, shuffle: bool = True, num_workers: int = 0, **kwargs
) -> ThreadDataLoader:
    """A ``ThreadDataLoader``: batches are prepared in a background thread while the step runs.

    Keep ``num_workers=0`` when the cache lives on the GPU (forked workers cannot share CUDA tensors).
    """
    return ThreadDataLoader(
        dataset, batch_size=int(batch_size), shuffle=shuffle, num_workers=int(num_workers), **kwargs
    )


class LatentAffined(MapTransform):
    """Give a latent map the affine of its image grid: voxel size multiplied by the downsampling factor.

    Args:
        keys: latent keys (channel-first MetaTensors).
        ref_key: the image the latent was encoded from.
    """

    def __init__(self, keys: Sequence[str] | str, ref_key: str = "image") -> None:
        super().__init__(keys)
        self.ref_key = ref_key

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(data)
        ref = d[self.ref_key]
        for key in self.key_iterator(d):
            latent = d[key]
            factors = [r / s for r, s in zip(ref.shape[1:], latent.shape[1:])]
            ref_affine = torch.as_tensor(ref.affine, dtype=torch.float64)
            scale = torch.tensor(factors, dtype=torch.float64)
            affine = ref_affine.clone()
            affine[:3, :3] = ref_affine[:3, :3] @ torch.diag(scale)
            # a latent voxel covers `factor` image voxels: its centre sits (factor - 1) / 2 voxels further in
            affine[:3, 3] = ref_affine[:3, 3] + ref_affine[:3, :3] @ ((scale - 1) / 2)
            latent.affine = affine
        return d


class VQCodesd(MapTransform):
    """Quantize a stitched continuous latent with a vector quantizer and add its code indices.

    The latent under each key (channel first, one volume) is replaced by its quantized version and the indices
    are stored under ``codes_key`` (``(1, *spatial)``, int32), both keeping the latent's metadata (affine).
    Quantizing after stitching keeps every latent voxel a codebook vector, which blending quantized windows
    would not.

    Args:
        keys: continuous latent keys.
        quantizer: an ``EMAVectorQuantizer`` (or a module with a ``quantizer`` attribute); it is switched to eval
            mode while quantizing (the codebook never changes) and its mode is restored afterwards.
        codes_key: key of the code indices.
    """

    def __init__(self, keys: Sequence[str] | str, quantizer: torch.nn.Module, codes_key: str = "codes") -> None:
        super().__init__(keys)
        self.quantizer = getattr(quantizer, "quantizer", quantizer)
        self.codes_key = codes_key

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(data)
        device = self.quantizer.embeddings.device
        for key in self.key_iterator(d):
            latent = d[key]
            meta = dict(getattr(latent, "meta", {}))
            plain = latent.as_tensor() if isinstance(latent, MetaTensor) else torch.as_tensor(latent)
            training = self.quantizer.training
            self.quantizer.eval()  # quantizing must never update the codebook (MONAI's eval_mode restores train())
            try:
                with torch.no_grad():
                    out = self.quantizer(plain[None].to(device))
            finally:
                self.quantizer.train(training)
            # the codebook rows themselves: the straight-through output z + (e - z) differs from e in the last bits
            quantized = self.quantizer.embed(out["indices"])[0]
            d[key] = MetaTensor(quantized.to(plain.dtype).detach().cpu(), meta=meta)
            d[self.codes_key] = MetaTensor(out["indices"][:1].to(torch.int32).cpu(), meta=dict(meta))
        return d


def _save(key: str, output_dir: str, postfix: str, dtype: Any = np.float32) -> SaveImaged:
    return SaveImaged(
        keys=key,
        output_dir=output_dir,
        output_postfix=postfix,
        separate_folder=False,
        resample=False,
        print_log=False,
        output_dtype=dtype,
    )


def _to_hu(key: str, intensity: Mapping[str, Any] | None) -> list:
    """For a CT window, map [0, 1] back to Hounsfield units, clipped to the window (the network only ever saw
    windowed intensities); nothing for other intensity modes."""
    if not intensity or str(intensity.get("mode", "")).lower() != "ct":
        return []
    a_min, a_max = float(intensity.get("a_min", -1000)), float(intensity.get("a_max", 1000))
    return [ScaleIntensityRanged(key, a_min=0.0, a_max=1.0, b_min=a_min, b_max=a_max, clip=True)]


def inference_postprocessing(
    mode: str,
    preprocessing: Compose,
    output_dir: str,
    pred_key: str = "pred",
    quantizer: torch.nn.Module | None = None,
    intensity: Mapping[str, Any] | None = None,
) -> Compose:
    """Postprocessing for an autoencoder's inference.

    ``reconstruct``: undo padding/spacing/orientation so the reconstruction lies on the input's grid with the
    input's affine, then save ``<name>_recon.nii.gz``. ``encode``: save the latent map as ``<name>_latent.nii.gz``
    (channels last, the affine scaled by the downsampling factor) for latent diffusion models; with a
    ``quantizer`` the stitched latent is quantized first and the code indices are saved as
    ``<name>_codes.nii.gz`` (int32, same affine). ``decode``: the input is a latent (or code) map; save the
    decoded image as ``<name>_decoded.nii.gz`` with the affine scaled back to the image grid.
    With a CT ``intensity`` window, reconstructed and decoded images are mapped back to Hounsfield units (clipped
    to the window).

    Raises:
        ValueError: for another mode.
    """
    if mode == "reconstruct":
        return Compose(
            [
                Invertd(
                    keys=pred_key, transform=preprocessing, orig_keys="image", nearest_interp=False, to_tensor=True
                ),
                *_to_hu(pred_key, intensity),
                _save(pred_key, output_dir, "recon"),
            ]
        )
    if mode == "encode":
        steps: list = [LatentAffined(keys=pred_key, ref_key="image")]
        if quantizer is not None:
            steps += [VQCodesd(pred_key, quantizer), _save("codes", output_dir, "codes", np.int32)]
        return Compose([*steps, _save(pred_key, output_dir, "latent")])
    if mode == "decode":
        return Compose(
            [
                LatentAffined(keys=pred_key, ref_key="image"),
                *_to_hu(pred_key, intensity),
                _save(pred_key, output_dir, "decoded"),
            ]
        )
    raise ValueError(f"mode must be 'reconstruct', 'encode' or 'decode', got {mode!r}.")


def raise_no_inputs(dataset_dir: str, pattern: str) -> None:
    """Raise the error of an inference run that found no input volume."""
    raise FileNotFoundError(
        f"no input volumes match {pattern!r} under {dataset_dir!r} (set --dataset_dir/--input_pattern)."
    )
