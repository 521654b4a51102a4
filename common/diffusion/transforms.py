# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Transforms of the diffusion family: source/target volumes stacked as the channels of ``image`` in ``[-1, 1]``,
optionally encoded to latents, and the postprocessing that saves generated volumes on the input grid."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from monai.data import MetaTensor
from monai.transforms import Compose, Invertd, MapTransform
from monai.utils import CommonKeys as Keys

from common.data.datalist import inference_entries
from common.data.pipeline import (
    case_name_formatter,
    hu_window_steps,
    nifti_saver,
)
from common.utils import plain_tensor

__all__ = [
    "CopyChannelsd",
    "EncodeLatentd",
    "generation_items",
    "inference_inputs",
    "keeps_values",
    "sample_postprocessing",
]


class CopyChannelsd(MapTransform):
    """Copy some channels of ``keys`` to a new key (e.g. the target modality of a multi-modality image as the
    validation reference, before the image is encoded to latents).

    Args:
        keys: the source key (one).
        channels: channel indices to copy.
        name: the new key.
    """

    def __init__(self, keys: str | Sequence[str], channels: Sequence[int], name: str = "label") -> None:
        super().__init__(keys)
        self.channels = [int(c) for c in channels]
        self.name = name

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(data)
        for key in self.key_iterator(d):
            d[self.name] = d[key][self.channels].clone()
        return d


class EncodeLatentd(MapTransform):
    """Replace a ``[-1, 1]`` image by the raw latents of a :class:`common.diffusion.latent.LatentCodec`.

    The latent keeps the image's metadata and transform history (so a sample decoded from it is inverted to the
    input grid by ``Invertd``); its affine is the image grid's, not the latent grid's. The codec's autoencoder
    stays frozen in eval mode; the latent is returned on the image's device.

    Args:
        keys: image keys (channel first, one volume each).
        codec: the latent codec.
    """

    def __init__(self, keys: str | Sequence[str], codec: torch.nn.Module) -> None:
        super().__init__(keys)
        self.codec = codec

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(data)
        device = self.codec.scale.device
        for key in self.key_iterator(d):
            image = d[key]
            plain = plain_tensor(image)
            latent = self.codec.encode(plain[None].float().to(device))[0].to(plain.device)
            if isinstance(image, MetaTensor):
                latent = MetaTensor(latent, meta=dict(image.meta), applied_operations=list(image.applied_operations))
            d[key] = latent
        return d


def keeps_values(intensity: Mapping[str, Any] | None) -> bool:
    """Whether the ``intensity`` setting keeps the input values (mode ``none``: they should already be in
    ``[-1, 1]``), so that the mapping of ``[0, 1]`` to ``[-1, 1]`` is skipped; ``None`` means MRI percentiles."""
    return str((intensity or {}).get("mode", "mri")).lower() == "none"


def sample_postprocessing(
    preprocessing: Compose | None,
    output_dir: str,
    postfix: str,
    pred_key: str = "pred",
    intensity: Mapping[str, Any] | None = None,
) -> Compose:
    """Postprocessing of a diffusion bundle's inference: the ``[0, 1]`` sample is taken back to the input's grid
    (padding, spacing and orientation undone with ``Invertd`` on the ``image`` history; skipped when
    ``preprocessing`` is ``None``, e.g. unconditional generation), mapped back to Hounsfield units for a CT
    window, and saved as ``<case_id>_<postfix>.nii.gz`` with the input's affine.

    Intensity units: a synthesised target has no volume of its own at inference, so only a fixed normalisation
    can be undone. A CT window is (Hounsfield units, clipped to the window); per-volume percentile normalisation
    (MRI) is not: the sample stays in ``[0, 1]``, where 0 and 1 stand for the target's ``lower`` and ``upper``
    percentiles, whose values in scanner units are unknown (the sources' percentiles say nothing about them).

    Args:
        preprocessing: the inference transforms of ``image`` (``None``: no inversion).
        output_dir: folder of the NIfTI files.
        postfix: file name suffix (e.g. the generated modality, ``t2f``).
        pred_key: key of the sample.
        intensity: the intensity config (CT windows are mapped back to HU).
    """
    steps: list = []
    if preprocessing is not None:
        steps.append(
            Invertd(keys=pred_key, transform=preprocessing, orig_keys=Keys.IMAGE, nearest_interp=False, to_tensor=True)
        )
    return Compose(
        [
            *steps,
            *hu_window_steps(pred_key, intensity),
            nifti_saver(pred_key, output_dir, postfix, name_formatter=case_name_formatter),
        ]
    )


def generation_items(
    num_volumes: int,
    shape: Sequence[int],
    spacing: Sequence[float] | None = None,
    channels: int = 1,
    prefix: str = "sample",
) -> list[dict[str, Any]]:
    """Inputs of unconditional generation: ``num_volumes`` empty volumes of ``shape`` (their content is replaced
    by the start noise), with the affine ``diag(spacing)`` and case ids ``<prefix>_000, ...`` that seed the noise
    and name the saved samples.

    Raises:
        ValueError: for a non-positive count, or a shape/spacing that is not 3 positive values.
    """
    if isinstance(num_volumes, bool) or int(num_volumes) < 1:
        raise ValueError(f"'num_samples' must be a positive integer, got {num_volumes!r}.")
    if len(shape) != 3 or any(int(s) < 1 for s in shape):
        raise ValueError(f"'sample_shape' must be 3 positive integers, got {shape!r}.")
    spacing = [1.0, 1.0, 1.0] if spacing is None else [float(s) for s in spacing]
    if len(spacing) != 3 or any(s <= 0 for s in spacing):
        raise ValueError(f"'spacing' must be 3 positive numbers, got {spacing!r}.")
    affine = torch.diag(torch.tensor([*spacing, 1.0], dtype=torch.float64))
    items = []
    for i in range(int(num_volumes)):
        case = f"{prefix}_{i:03d}"
        meta = {"affine": affine.clone(), "case_id": case, "filename_or_obj": f"{case}.nii.gz"}
        image = MetaTensor(torch.zeros(int(channels), *[int(s) for s in shape]), meta=meta)
        items.append({Keys.IMAGE: image, "case_id": case})
    return items


def inference_inputs(
    task: str,
    dataset_dir: str,
    source_keys: Sequence[str],
    datalist: str | Mapping[str, Any] | None = None,
    section: str = "testing",
    pattern: str | None = None,
    num_samples: int = 1,
    sample_shape: Sequence[int] = (64, 64, 64),
    spacing: Sequence[float] | None = None,
) -> list[dict[str, Any]]:
    """The inputs of a diffusion bundle's inference run.

    ``unconditional``: ``num_samples`` empty volumes of ``sample_shape`` (:func:`generation_items`). Otherwise the
    cases of ``source_keys`` under ``dataset_dir`` (``datalist``'s ``section``, the volumes matching ``pattern`` or
    the BraTS layout, see :func:`common.data.datalist.inference_entries`); the inference run checks their headers
    before it processes them (:class:`common.engines.cases.CaseRun`).
    """

    if task == "unconditional":
        return generation_items(num_samples, sample_shape, spacing)
    return inference_entries(dataset_dir, source_keys, datalist=datalist, section=section, pattern=pattern)
