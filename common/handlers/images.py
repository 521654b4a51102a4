# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Orthogonal-slice comparison panels (input | reconstruction | error) for TensorBoard and PNG files."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from monai.engines.utils import IterationEvents
from monai.utils import IgniteInfo, min_version, optional_import

from common.data.formats import file_stem
from common.data.io import write_nifti
from common.data.pipeline import batch_case_ids, output_stem

Events, _ = optional_import("ignite.engine", IgniteInfo.OPT_IMPORT_VERSION, min_version, "Events")
Image, _ = optional_import("PIL", name="Image")

if TYPE_CHECKING:
    from ignite.engine import Engine
    from torch.utils.tensorboard import SummaryWriter
else:
    Engine, _ = optional_import(
        "ignite.engine", IgniteInfo.OPT_IMPORT_VERSION, min_version, "Engine", as_type="decorator"
    )
    SummaryWriter, _ = optional_import("torch.utils.tensorboard", name="SummaryWriter")

__all__ = [
    "OrthoSliceImageHandler",
    "XrayCTWriter",
    "comparison_panel",
    "orthogonal_slices",
    "projection_panel",
    "save_panel_png",
]

ORIENTATIONS: tuple[str, ...] = ("sagittal", "coronal", "axial")
"""Row order of the panels: slices normal to the first, second and third spatial axis."""


def _spatial_volume(volume: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """Channel 0 of a (C, X, Y, Z) volume, or the (X, Y, Z) volume itself (no copy).

    Args:
        volume: a (C, X, Y, Z) or (X, Y, Z) array or tensor.
    """
    if volume.ndim == 4:
        return volume[0]
    if volume.ndim == 3:
        return volume
    raise ValueError(f"expected a (C, X, Y, Z) or (X, Y, Z) volume, got shape {tuple(volume.shape)}.")


def _to_float_numpy(array: torch.Tensor | np.ndarray) -> np.ndarray:
    """A float32 numpy copy of a tensor (any device) or array.

    Args:
        array: the data to convert.
    """
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().float().numpy()
    return np.array(array, dtype=np.float32, copy=True)


def orthogonal_slices(volume: torch.Tensor | np.ndarray, index: Sequence[int] | None = None) -> list[np.ndarray]:
    """The three orthogonal 2D slices of channel 0 of a volume: sagittal, coronal, axial.

    The sagittal slice is ``v[x, :, :]`` (Y, Z), the coronal slice ``v[:, y, :]`` (X, Z) and the axial slice
    ``v[:, :, z]`` (X, Y); the arrays are not flipped or transposed.

    Args:
        volume: a (C, X, Y, Z) or (X, Y, Z) tensor or array.
        index: the (x, y, z) voxel the slices pass through; default: the centre ``size // 2`` of each axis.
            Negative indices count from the end.

    Raises:
        ValueError: when ``volume`` is not 3D/4D or ``index`` is not three in-range integers.
    """
    vol = _spatial_volume(volume)
    shape = tuple(int(s) for s in vol.shape)
    if index is None:
        index = tuple(s // 2 for s in shape)
    if len(index) != 3:
        raise ValueError(f"index must have 3 entries (x, y, z), got {index!r}.")
    for i, size in zip(index, shape):
        if not -size <= int(i) < size:
            raise ValueError(f"index {index!r} is out of range for spatial shape {shape}.")
    x, y, z = (int(i) for i in index)
    return [_to_float_numpy(vol[x, :, :]), _to_float_numpy(vol[:, y, :]), _to_float_numpy(vol[:, :, z])]


def _check_error_scale(error_scale: float) -> float:
    """Validate the error-column scale factor.

    Args:
        error_scale: multiplier of the absolute error, must be non-negative.
    """
    if not error_scale >= 0:
        raise ValueError(f"error_scale must be non-negative, got {error_scale!r}.")
    return float(error_scale)


def _display_slices(volume: torch.Tensor | np.ndarray) -> list[np.ndarray]:
    """The central orthogonal slices rotated 90 degrees counter-clockwise (superior/anterior up for RAS)."""
    return [np.ascontiguousarray(np.rot90(s)) for s in orthogonal_slices(volume)]


def _pad_to(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """Zero-pad a 2D array at the bottom and right to (height, width).

    Args:
        array: 2D array no larger than (height, width).
        height: target number of rows.
        width: target number of columns.
    """
    return np.pad(array, ((0, height - array.shape[0]), (0, width - array.shape[1])))


def _assemble_panel(
    image_slices: Sequence[np.ndarray], recon_slices: Sequence[np.ndarray], error_scale: float
) -> np.ndarray:
    """Arrange matching slices as rows of ``input | reconstruction | scaled absolute error``.

    Args:
        image_slices: 2D input slices, one per row.
        recon_slices: 2D reconstruction slices, same shapes as ``image_slices``.
        error_scale: multiplier of the absolute error before clipping to [0, 1].
    """
    for img, rec in zip(image_slices, recon_slices):
        if img.shape != rec.shape:
            raise ValueError(f"image and reconstruction slices differ in shape, got {img.shape} and {rec.shape}.")
    height = max(s.shape[0] for s in image_slices)
    width = max(s.shape[1] for s in image_slices)
    rows = []
    for img, rec in zip(image_slices, recon_slices):
        error = np.abs(img - rec) * error_scale
        cells = [np.clip(c, 0.0, 1.0) for c in (img, rec, error)]
        rows.append(np.concatenate([_pad_to(c, height, width) for c in cells], axis=1))
    return np.concatenate(rows, axis=0).astype(np.float32)


def comparison_panel(
    image: torch.Tensor | np.ndarray, recon: torch.Tensor | np.ndarray, error_scale: float = 1.0
) -> np.ndarray:
    """A 2D float32 panel in [0, 1] comparing a volume with its reconstruction on three orthogonal slices.

    The panel is a 3x3 grid: rows are the sagittal, coronal and axial central slices (see
    :func:`orthogonal_slices`), each rotated 90 degrees counter-clockwise so that for RAS volumes superior
    (sagittal, coronal) and anterior (axial) point up; columns are input | reconstruction | ``|input - reconstruction| * error_scale``.
    Every cell is clipped to [0, 1] and zero-padded (bottom/right) to the largest slice height and width,
    so the panel has shape ``(3 * max_height, 3 * max_width)``.

    Args:
        image: the input, (C, X, Y, Z) or (X, Y, Z), intensities expected in [0, 1].
        recon: the reconstruction, same spatial shape as ``image``.
        error_scale: multiplier of the absolute error, to make small errors visible.

    Raises:
        ValueError: when the spatial shapes differ or ``error_scale`` is negative.
    """
    scale = _check_error_scale(error_scale)
    image_shape, recon_shape = _spatial_volume(image).shape, _spatial_volume(recon).shape
    if tuple(image_shape) != tuple(recon_shape):
        raise ValueError(
            f"image and recon must have the same spatial shape, got {tuple(image_shape)} and {tuple(recon_shape)}."
        )
    return _assemble_panel(_display_slices(image), _display_slices(recon), scale)


def save_panel_png(panel: np.ndarray | torch.Tensor, path: str | Path) -> Path:
    """Write a 2D panel with values in [0, 1] as an 8-bit grayscale PNG (values are clipped and rounded).

    Args:
        panel: 2D (H, W) array, or (1, H, W).
        path: output file; missing parent folders are created.

    Returns:
        the path written.
    """
    array = _to_float_numpy(panel)
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 2:
        raise ValueError(f"panel must be a 2D (H, W) image, got shape {array.shape}.")
    pixels = np.round(np.clip(np.nan_to_num(array), 0.0, 1.0) * 255.0).astype(np.uint8)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(out, format="PNG")
    return out


class OrthoSliceImageHandler:
    """Log orthogonal-slice comparison panels of the first samples of each epoch to TensorBoard.

    On every ``ITERATION_COMPLETED`` the handler takes samples from ``output_transform(engine.state.output)``
    until it holds ``max_images`` of them (only their 2D slices are kept, on the CPU). On ``EPOCH_COMPLETED``
    it writes one :func:`comparison_panel` per sample as ``f"{tag}/{i}"`` and clears the buffer.

    ``output_transform(engine.state.output)`` may be a list of per-sample dicts (a MONAI evaluator with
    ``decollate=True``, tensors (C, X, Y, Z)) or one dict of batched tensors (B, C, X, Y, Z) (``decollate=False``).

    Typical use in a bundle config, on the evaluator::

        {"_target_": "common.handlers.images.OrthoSliceImageHandler", "summary_writer": "@summary_writer",
         "global_step_transform": "@validate#global_step"}

    Args:
        summary_writer: a TensorBoard ``SummaryWriter``; default: one created on ``log_dir`` on first use.
        log_dir: where the default writer writes. With neither ``summary_writer`` nor ``log_dir`` the handler logs
            nothing (a run's writer is ``None`` on ranks other than 0).
        tag: TensorBoard tag prefix.
        image_key: key of the input volume in each sample.
        pred_key: key of the reconstruction in each sample.
        max_images: number of samples logged per epoch.
        global_step_transform: maps the engine to the TensorBoard step; default ``engine.state.epoch``.
        output_transform: maps ``engine.state.output`` to the samples (see above); default identity.
        error_scale: multiplier of the absolute error column.
    """

    def __init__(
        self,
        summary_writer: SummaryWriter | None = None,
        log_dir: str | None = None,
        tag: str = "val_slices",
        image_key: str = "image",
        pred_key: str = "pred",
        max_images: int = 1,
        global_step_transform: Callable[[Engine], int] | None = None,
        output_transform: Callable[[Any], Any] = lambda x: x,
        error_scale: float = 1.0,
    ) -> None:
        if max_images < 1:
            raise ValueError(f"max_images must be at least 1, got {max_images!r}.")
        self._writer = summary_writer
        self.internal_writer = False
        self.log_dir = log_dir
        self.tag = tag
        self.image_key = image_key
        self.pred_key = pred_key
        self.max_images = int(max_images)
        self.global_step_transform = global_step_transform
        self.output_transform = output_transform
        self.error_scale = _check_error_scale(error_scale)
        self._buffer: list[tuple[list[np.ndarray], list[np.ndarray]]] = []

    @property
    def writer(self) -> SummaryWriter:
        """The summary writer, created on ``log_dir`` when none was given."""
        if self._writer is None:
            self._writer = SummaryWriter(log_dir=self.log_dir)
            self.internal_writer = True
        return self._writer

    def attach(self, engine: Engine) -> None:
        """Register the handler on ``engine``.

        Args:
            engine: an ignite engine, typically a MONAI evaluator.
        """
        if self._writer is None and self.log_dir is None:
            return
        events = (
            (Events.EPOCH_STARTED, self.epoch_started),
            (Events.ITERATION_COMPLETED, self.iteration_completed),
            (Events.EPOCH_COMPLETED, self.epoch_completed),
        )
        for event, handler in events:
            if not engine.has_event_handler(handler, event):
                engine.add_event_handler(event, handler)

    def epoch_started(self, engine: Engine) -> None:
        """Drop samples left from an interrupted epoch.

        Args:
            engine: the engine that fired the event.
        """
        self._buffer.clear()

    def iteration_completed(self, engine: Engine) -> None:
        """Keep the slices of samples of this iteration until ``max_images`` are held.

        Args:
            engine: the engine that fired the event.
        """
        if len(self._buffer) >= self.max_images:
            return
        for image, pred in self._samples(self.output_transform(engine.state.output)):
            self._buffer.append((_display_slices(image), _display_slices(pred)))
            if len(self._buffer) >= self.max_images:
                break

    def epoch_completed(self, engine: Engine) -> None:
        """Write the panels of the held samples and clear the buffer.

        Args:
            engine: the engine that fired the event.
        """
        if not self._buffer:
            return
        step = self._global_step(engine)
        for i, (image_slices, pred_slices) in enumerate(self._buffer):
            panel = _assemble_panel(image_slices, pred_slices, self.error_scale)
            self.writer.add_image(f"{self.tag}/{i}", panel[None], step, dataformats="CHW")
        self.writer.flush()
        self._buffer.clear()

    def close(self) -> None:
        """Close the summary writer if this handler created it."""
        if self.internal_writer and self._writer is not None:
            self._writer.close()

    def _global_step(self, engine: Engine) -> int:
        """The TensorBoard step for the current epoch.

        Args:
            engine: the engine that fired the event.
        """
        if self.global_step_transform is None:
            return int(engine.state.epoch)
        return int(self.global_step_transform(engine))

    def _samples(self, output: Any) -> list[tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]]:
        """Split an engine output into at most ``max_images`` (image, pred) pairs.

        Args:
            output: a list of per-sample dicts or a dict of batched tensors.
        """
        if isinstance(output, Mapping):
            images, preds = self._get(output, self.image_key), self._get(output, self.pred_key)
            count = min(len(images), len(preds), self.max_images)
            return [(images[b], preds[b]) for b in range(count)]
        if isinstance(output, (list, tuple)):
            samples = []
            for item in output[: self.max_images]:
                if not isinstance(item, Mapping):
                    raise TypeError(f"expected per-sample dicts in the engine output, got {type(item).__name__}.")
                samples.append((self._get(item, self.image_key), self._get(item, self.pred_key)))
            return samples
        raise TypeError(f"expected a dict or a list of dicts as engine output, got {type(output).__name__}.")

    @staticmethod
    def _get(data: Mapping, key: str) -> Any:
        """``data[key]`` with an error naming the missing key.

        Args:
            data: a sample or batch dict.
            key: the key to read.
        """
        if key not in data:
            raise KeyError(f"key {key!r} not in engine output, available keys: {sorted(map(str, data))}.")
        return data[key]


def projection_panel(xray: torch.Tensor | np.ndarray, predicted: torch.Tensor | np.ndarray) -> np.ndarray:
    """A 2D panel in ``[0, 1]``: one row per view of ``input | predicted projection | |difference|`` radiographs.

    Args:
        xray: input X-rays ``(V, H, W)`` as normalised line integrals (see :mod:`common.xray2ct.drr`).
        predicted: the projections of the predicted CT, same shape.

    Each radiograph is shown as the intensity ``1 - exp(-p)`` with its second axis (superior) pointing up.
    """
    xray, predicted = _to_float_numpy(xray), _to_float_numpy(predicted)
    if xray.shape != predicted.shape or xray.ndim != 3:
        raise ValueError(f"xray and predicted must both be (V, H, W), got {xray.shape} and {predicted.shape}.")

    def display(views: np.ndarray) -> list[np.ndarray]:
        return [(1.0 - np.exp(-v)).T[::-1] for v in views]

    return _assemble_panel(display(xray), display(predicted), 1.0)


class XrayCTWriter:
    """Writes, for every case an X-ray -> CT evaluator processes, ``<case>_views.png`` (see
    :func:`projection_panel`) and, with ``save_volume``, ``<case>_ct.nii.gz``: the predicted CT in Hounsfield units,
    and when the evaluator drew several samples per case, ``<case>_ct_std.nii.gz``: their per-voxel standard
    deviation in HU, same grid. The grid is the input CT's when the case has one (the batch's ``image`` with its
    affine after the pipeline's orientation, spacing, crop and resize: the prediction lies voxel for voxel on it);
    for X-ray files alone it is the projector's field of view (RAS, voxels of ``fov_mm / size``, origin at the
    corner).

    Args:
        output_dir: folder of the files (created when missing).
        projector: the :class:`common.xray2ct.drr.DRRProjector` of the data (HU window, field of view).
        save_volume: also write the CT volumes.
    """

    def __init__(self, output_dir: str | Path, projector: Any, save_volume: bool = True) -> None:
        self.output_dir = Path(output_dir)
        self.projector = projector
        self.save_volume = bool(save_volume)

    def attach(self, engine: Engine) -> None:
        # inside the iteration, as MONAI's postprocessing: an inference run's guard covers the writing
        engine.add_event_handler(IterationEvents.MODEL_COMPLETED, self)

    def __call__(self, engine: Engine) -> None:

        output = engine.state.output
        pred = _to_float_numpy(output["pred"])
        std = _to_float_numpy(output["pred_std"]) if output.get("pred_std") is not None else None
        names = batch_case_ids(engine.state.batch, pred.shape[0])
        by_case = engine.state.batch.get("case_id") is not None  # else the names are the input files
        image = engine.state.batch.get("image")
        for i, name in enumerate(names):
            stem = (output_stem(name) if by_case else file_stem(name)) or f"case{i}"
            save_panel_png(
                projection_panel(output["xray"][i], output["pred_xray"][i]), self.output_dir / f"{stem}_views.png"
            )
            if self.save_volume:
                width = self.projector.hu_max - self.projector.hu_min
                hu = self.projector.hu_min + pred[i, 0] * width
                affine = self.affine(image, i, hu.shape)
                write_nifti(self.output_dir / f"{stem}_ct.nii.gz", hu.astype(np.float32), affine)
                if std is not None:
                    std_hu = (std[i, 0] * width).astype(np.float32)
                    write_nifti(self.output_dir / f"{stem}_ct_std.nii.gz", std_hu, affine)

    def affine(self, image: Any, index: int, shape: Sequence[int]) -> np.ndarray:
        """The affine of case ``index``'s predicted volume of ``shape``: its input CT's grid (``image``, a batch
        with meta data, rescaled about the centre when its size differs) or, without one, the projector's."""
        from monai.data import MetaTensor
        from monai.transforms.utils import scale_affine

        if not isinstance(image, MetaTensor) or image.ndim != 5:
            return np.diag([*(f / s for f, s in zip(self.projector.fov_mm, shape)), 1.0])
        affine = image.affine
        affine = (affine[index] if affine.ndim == 3 else affine).double().cpu().numpy()
        size = [int(s) for s in image.shape[2:]]
        if size != [int(s) for s in shape]:
            affine = affine @ np.asarray(scale_affine(size, shape), dtype=np.float64)
        return affine
