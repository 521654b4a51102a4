# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Invertible intensity normalisation: per-volume percentile scaling that records the mapping it applied, so a
reconstruction can be returned to the input's intensity units (``monai.transforms.Invertd`` or :meth:`inverse`), and
the normalisation of a config's ``intensity`` setting as one transform of a JSON transform list."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from monai.config import DtypeLike, KeysCollection
from monai.data import get_track_meta
from monai.transforms import (
    InvertibleTransform,
    MapTransform,
    ScaleIntensityRange,
    ScaleIntensityRanged,
    ScaleIntensityRangePercentilesd,
)
from monai.transforms.utils_pytorch_numpy_unification import percentile
from monai.utils import TraceKeys, convert_to_dst_type, convert_to_tensor
from monai.utils.enums import TransformBackends

from common.utils import plain_tensor

__all__ = [
    "InvertibleScaleIntensityRangePercentilesd",
    "ScaleIntensityModed",
    "intensity_problems",
    "intensity_transform",
    "inverse_linear_scaling",
]


def inverse_linear_scaling(
    image: torch.Tensor, a_min: Sequence[float], a_max: Sequence[float], b_min: float, b_max: float, clip: bool
) -> torch.Tensor:
    """The inverse of ``ScaleIntensityRange(a_min, a_max, b_min, b_max, clip)`` for each channel of ``image``.

    Channel ``c`` is mapped from ``[b_min, b_max]`` back to ``[a_min[c], a_max[c]]``; a single pair applies to every
    channel. With ``clip`` the values are first clipped to ``[b_min, b_max]`` (the forward mapping never produced
    others), so the result stays within ``[a_min[c], a_max[c]]``. A channel whose range was empty
    (``a_min == a_max``, which MONAI shifts by ``b_min - a_min`` without scaling) is shifted back.

    Args:
        image: channel-first values in the normalised range.
        a_min: the input value mapped to ``b_min``, per channel (or one for all).
        a_max: the input value mapped to ``b_max``, per channel (or one for all).
        b_min: the normalised value of ``a_min``.
        b_max: the normalised value of ``a_max``.
        clip: whether the forward mapping clipped to ``[b_min, b_max]``.

    Returns:
        A tensor of ``image``'s dtype (and type) in the input's units.

    Raises:
        ValueError: when the number of ranges is neither 1 nor the number of channels of ``image``.
    """
    lows, highs = [float(v) for v in a_min], [float(v) for v in a_max]
    channels = int(image.shape[0])
    if len(lows) != len(highs) or len(lows) not in (1, channels):
        raise ValueError(
            f"cannot undo the intensity scaling of {len(lows)} channel(s) on an image with {channels} channel(s); "
            f"recorded ranges: a_min={lows}, a_max={highs}"
        )
    values = plain_tensor(image)
    values = values.to(torch.float64)
    out = torch.empty_like(values)
    for c in range(channels):
        low, high = (lows[0], highs[0]) if len(lows) == 1 else (lows[c], highs[c])
        x = values[c].clamp(min(b_min, b_max), max(b_min, b_max)) if clip else values[c]
        if high - low == 0.0:
            out[c] = x - b_min + low
        else:
            out[c] = (x - b_min) / (b_max - b_min) * (high - low) + low
    return convert_to_dst_type(out, dst=image, dtype=image.dtype)[0]


class InvertibleScaleIntensityRangePercentilesd(MapTransform, InvertibleTransform):
    """``ScaleIntensityRangePercentilesd`` (without ``relative``) that records the mapping it applied, so it can be
    undone.

    The forward values are those of ``monai.transforms.ScaleIntensityRangePercentilesd`` with the same arguments,
    bit for bit: the ``lower``/``upper`` percentiles of each volume (of each channel with ``channel_wise``) are
    mapped to ``b_min``/``b_max``. The percentile values of that volume are pushed onto the MetaTensor's
    ``applied_operations`` (``extra_info``: ``a_min``, ``a_max``, one per channel, or one for all channels), so
    ``monai.transforms.Invertd`` (or :meth:`inverse`) maps a prediction of the same number of channels back to the
    input's units (see :func:`inverse_linear_scaling`). Plain tensors (or ``track_meta`` off) are scaled without a
    record.

    Args:
        keys: keys of the images.
        lower: lower percentile in ``[0, 100]``.
        upper: upper percentile in ``[0, 100]``.
        b_min: normalised value of the lower percentile.
        b_max: normalised value of the upper percentile.
        clip: clip the normalised values to ``[b_min, b_max]``.
        channel_wise: percentiles of each channel separately.
        dtype: output dtype.
        allow_missing_keys: do not raise for absent keys.
    """

    backend = [TransformBackends.TORCH, TransformBackends.NUMPY]

    def __init__(
        self,
        keys: KeysCollection,
        lower: float,
        upper: float,
        b_min: float = 0.0,
        b_max: float = 1.0,
        clip: bool = False,
        channel_wise: bool = False,
        dtype: DtypeLike = np.float32,
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        if not (0.0 <= float(lower) <= 100.0 and 0.0 <= float(upper) <= 100.0):
            raise ValueError(f"percentiles must be in [0, 100], got lower={lower!r} and upper={upper!r}")
        self.lower, self.upper = float(lower), float(upper)
        self.b_min, self.b_max = float(b_min), float(b_max)
        self.clip = bool(clip)
        self.channel_wise = bool(channel_wise)
        self.dtype = dtype

    def _scale(self, img: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        """One channel (or the whole volume): its percentiles and its scaled values, as MONAI computes them."""
        a_min = percentile(img, self.lower)
        a_max = percentile(img, self.upper)
        scaler = ScaleIntensityRange(
            a_min=a_min, a_max=a_max, b_min=self.b_min, b_max=self.b_max, clip=self.clip, dtype=self.dtype
        )
        return convert_to_tensor(scaler(img), track_meta=False), float(a_min), float(a_max)

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        for key in self.key_iterator(d):
            img = convert_to_tensor(d[key], track_meta=get_track_meta())
            img_t = convert_to_tensor(img, track_meta=False)
            if self.channel_wise:
                scaled = [self._scale(channel) for channel in img_t]
                out = torch.stack([s[0] for s in scaled])
                lows, highs = [s[1] for s in scaled], [s[2] for s in scaled]
            else:
                out, low, high = self._scale(img_t)
                lows, highs = [low], [high]
            out = convert_to_dst_type(out, dst=img, dtype=self.dtype)[0]
            extra = {"a_min": lows, "a_max": highs, "b_min": self.b_min, "b_max": self.b_max, "clip": self.clip}
            d[key] = self.push_transform(out, extra_info=extra)
        return d

    def inverse(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        """Map each key back to the units of the volume the recorded percentiles came from."""
        d = dict(data)
        for key in self.key_iterator(d):
            info = self.pop_transform(d[key])[TraceKeys.EXTRA_INFO]
            d[key] = inverse_linear_scaling(
                d[key], info["a_min"], info["a_max"], float(info["b_min"]), float(info["b_max"]), bool(info["clip"])
            )
        return d


class ScaleIntensityModed(MapTransform, InvertibleTransform):
    """The intensity normalisation of a config's ``intensity`` setting, as one element of a transform list.

    ``intensity`` is the mapping of :func:`intensity_transform`: ``{"mode": "ct", "a_min",
    "a_max"}`` clips a Hounsfield window to [0, 1], ``{"mode": "mri", "lower", "upper"}`` rescales between
    per-volume percentiles, ``{"mode": "none"}`` keeps the values (``None``: MRI percentiles). The values are those
    of the transform that function builds; :meth:`inverse` undoes what that transform recorded (the per-volume
    percentiles with ``invertible``), so ``Invertd`` over a ``Compose`` holding this step returns a reconstruction to
    the input's units.

    Args:
        keys: keys of the images.
        intensity: the ``intensity`` setting.
        channel_wise: percentiles of each channel separately (MRI mode).
        invertible: record the per-volume percentiles (MRI mode) so that they can be undone.
        allow_missing_keys: do not raise for absent keys.

    Raises:
        ValueError: for an invalid ``intensity`` (see :func:`intensity_problems`).
    """

    def __init__(
        self,
        keys: KeysCollection,
        intensity: Mapping[str, Any] | None = None,
        channel_wise: bool = False,
        invertible: bool = True,
        allow_missing_keys: bool = False,
    ) -> None:
        super().__init__(keys, allow_missing_keys)
        #: the transform of the mode (``None`` for ``"none"``)
        self.transform = intensity_transform(
            list(self.keys), intensity or {"mode": "mri"}, channel_wise=channel_wise, invertible=invertible
        )
        if self.transform is not None:
            self.transform.allow_missing_keys = bool(allow_missing_keys)

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        return dict(data) if self.transform is None else self.transform(data)

    def inverse(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        """Undo what the mode's transform recorded (nothing for a CT window or ``"none"``)."""
        if isinstance(self.transform, InvertibleTransform):
            return self.transform.inverse(data)
        return dict(data)


def intensity_problems(intensity: Mapping[str, Any] | None) -> list[str]:
    """Why the config ``intensity`` (see :func:`intensity_transform`) is invalid, one line per problem naming the
    config id: an unknown mode, an inverted or empty CT window, MRI percentiles outside ``0 <= lower < upper <= 100``
    (empty: it is valid)."""
    intensity = intensity or {}
    mode = str(intensity.get("mode", "mri")).lower()
    if mode == "ct":
        a_min, a_max = float(intensity.get("a_min", -1000)), float(intensity.get("a_max", 1000))
        if a_min >= a_max:
            return [f"'intensity' HU window is inverted or empty: a_min={a_min} must be < a_max={a_max}."]
    elif mode == "mri":
        lower, upper = float(intensity.get("lower", 0.5)), float(intensity.get("upper", 99.5))
        if not 0 <= lower < upper <= 100:
            return [f"'intensity' percentiles: need 0 <= lower < upper <= 100, got {lower} and {upper}."]
        if not isinstance(intensity.get("clip", True), bool):
            return [f"'intensity' clip must be true or false, got {intensity['clip']!r}."]
    elif mode != "none":
        return [f"'intensity' mode must be 'ct', 'mri' or 'none', got {mode!r}."]
    return []


def intensity_transform(
    keys: Sequence[str], intensity: Mapping[str, Any], channel_wise: bool = False, invertible: bool = True
):
    """Intensity normalisation to [0, 1] from a config mapping.

    ``{"mode": "ct", "a_min": -1000, "a_max": 1000}`` clips a Hounsfield window (undone by :func:`common.data.pipeline.hu_window_steps`,
    within the window); ``{"mode": "mri", "lower": 0.5, "upper": 99.5}`` rescales between per-volume percentiles
    (robust to scanner scaling; clipped to [0, 1] unless ``"clip": false``, as the zoo's BraTS autoencoder), per channel with ``channel_wise`` (e.g. several MRI modalities stacked as
    channels); ``{"mode": "none"}`` keeps the values.

    With ``invertible`` the percentile scaling is
    :class:`InvertibleScaleIntensityRangePercentilesd`, which records each volume's
    percentiles so ``Invertd`` maps a reconstruction back to the input's units; its values are those of
    ``ScaleIntensityRangePercentilesd``, which is used otherwise (e.g. for inputs whose mapping must not be applied
    to an output of another modality).

    Raises:
        ValueError: for an unknown mode, a window with ``a_min >= a_max`` or bad percentiles
            (:func:`intensity_problems`).
    """
    problems = intensity_problems(intensity)
    if problems:
        raise ValueError(problems[0])
    mode = str(intensity.get("mode", "mri")).lower()
    if mode == "ct":
        a_min, a_max = float(intensity.get("a_min", -1000)), float(intensity.get("a_max", 1000))
        return ScaleIntensityRanged(keys, a_min=a_min, a_max=a_max, b_min=0.0, b_max=1.0, clip=True)
    if mode == "mri":
        lower, upper = float(intensity.get("lower", 0.5)), float(intensity.get("upper", 99.5))
        percentiles = InvertibleScaleIntensityRangePercentilesd if invertible else ScaleIntensityRangePercentilesd
        clip = bool(intensity.get("clip", True))
        return percentiles(keys, lower=lower, upper=upper, b_min=0.0, b_max=1.0, clip=clip, channel_wise=channel_wise)
    return None
