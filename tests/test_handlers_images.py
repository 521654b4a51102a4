# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the image-quality metric handlers and the orthogonal-slice TensorBoard handler."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from ignite.engine import Events
from monai.data import DataLoader
from monai.engines import SupervisedEvaluator
from monai.metrics import SSIMMetric
from monai.metrics.regression import compute_ms_ssim
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.handlers.images import OrthoSliceImageHandler, comparison_panel, orthogonal_slices, save_panel_png
from common.metrics.image import image_quality_handlers, ms_ssim_weights

SIDE = 16


def _volumes(n: int = 3, shape: tuple[int, int, int] = (SIDE, SIDE, SIDE)) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(n):
        label = torch.rand((1, *shape), generator=gen)
        image = (label + 0.1 * torch.randn((1, *shape), generator=gen)).clamp(0, 1)
        data.append({"image": image, "label": label})
    return data


def _evaluator(data: list[dict[str, torch.Tensor]], batch_size: int = 2, **kwargs) -> SupervisedEvaluator:
    return SupervisedEvaluator(
        device=torch.device("cpu"),
        val_data_loader=DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=0),
        network=torch.nn.Identity(),
        **kwargs,
    )


def _read_images(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    acc.Reload()
    return acc


# ---------------------------------------------------------------- metric handlers


@pytest.mark.parametrize("decollate", [True, False])
def test_image_quality_handlers_in_evaluator(decollate: bool) -> None:
    data = _volumes()
    handlers = image_quality_handlers(prefix="val_", save_details=True)
    assert list(handlers) == ["val_psnr", "val_ssim", "val_ms_ssim"]
    evaluator = _evaluator(
        data,
        key_val_metric={"val_psnr": handlers["val_psnr"]},
        additional_metrics={k: v for k, v in handlers.items() if k != "val_psnr"},
        decollate=decollate,
    )
    evaluator.run()
    metrics = evaluator.state.metrics

    # independent per-volume references, averaged over the three volumes
    psnr, ssim, ms_ssim = [], [], []
    ssim_ref = SSIMMetric(spatial_dims=3, data_range=1.0, win_size=7)
    for item in data:
        pred, label = item["image"][None], item["label"][None]
        mse = float(((pred.double() - label.double()) ** 2).mean())
        psnr.append(-10 * math.log10(mse))
        ssim.append(ssim_ref(pred, label).item())
        ms_ssim.append(compute_ms_ssim(pred, label, spatial_dims=3, kernel_size=3, weights=ms_ssim_weights(3)).item())
    assert metrics["val_psnr"] == pytest.approx(np.mean(psnr), rel=1e-5)
    assert metrics["val_ssim"] == pytest.approx(np.mean(ssim), rel=1e-5)
    assert metrics["val_ms_ssim"] == pytest.approx(np.mean(ms_ssim), rel=1e-5)
    assert 0.0 < metrics["val_ssim"] < 1.0 and 0.0 < metrics["val_ms_ssim"] < 1.0
    assert evaluator.state.key_metric_name == "val_psnr"
    assert evaluator.state.metric_details["val_psnr"].shape == (3, 1)


def test_image_quality_handlers_kwargs_and_identical_inputs() -> None:
    data = [{"image": d["label"], "label": d["label"]} for d in _volumes(2)]
    handlers = image_quality_handlers(prefix="test_", data_range=1.0, ssim_win_size=5, ms_ssim_max_scales=2)
    evaluator = _evaluator(data, key_val_metric=handlers)
    evaluator.run()
    metrics = evaluator.state.metrics
    assert math.isinf(metrics["test_psnr"])  # MONAI: PSNR of identical volumes is +inf
    assert metrics["test_ssim"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["test_ms_ssim"] == pytest.approx(1.0, abs=1e-5)
    assert handlers["test_ms_ssim"].metric_fn.max_scales == 2


# ---------------------------------------------------------------- slices and panels


def test_orthogonal_slices_shapes_and_values() -> None:
    vol = np.arange(1 * 4 * 5 * 6, dtype=np.float64).reshape(1, 4, 5, 6)
    sag, cor, axi = orthogonal_slices(vol)
    assert [s.shape for s in (sag, cor, axi)] == [(5, 6), (4, 6), (4, 5)]
    assert all(s.dtype == np.float32 for s in (sag, cor, axi))
    np.testing.assert_array_equal(sag, vol[0, 2])
    np.testing.assert_array_equal(cor, vol[0, :, 2])
    np.testing.assert_array_equal(axi, vol[0, :, :, 3])
    # (X, Y, Z) torch input, explicit index
    sag, cor, axi = orthogonal_slices(torch.as_tensor(vol[0]), index=(1, -1, 0))
    np.testing.assert_array_equal(sag, vol[0, 1])
    np.testing.assert_array_equal(cor, vol[0, :, 4])
    np.testing.assert_array_equal(axi, vol[0, :, :, 0])
    with pytest.raises(ValueError, match=r"\(4, 9, 0\)"):
        orthogonal_slices(vol, index=(4, 9, 0))
    with pytest.raises(ValueError, match=r"\(4, 5\)"):
        orthogonal_slices(np.zeros((4, 5)))


def test_comparison_panel_layout_and_error_column() -> None:
    gen = torch.Generator().manual_seed(1)
    shape = (1, 6, 8, 10)
    image = torch.rand(shape, generator=gen)
    recon = torch.rand(shape, generator=gen)
    panel = comparison_panel(image, recon)
    h, w = 10, 8  # slices are rotated for display: heights Z, Z, Y and widths Y, X, X
    assert panel.shape == (3 * h, 3 * w) and panel.dtype == np.float32
    assert panel.min() >= 0.0 and panel.max() <= 1.0
    img_s = [np.rot90(s) for s in orthogonal_slices(image)]
    rec_s = [np.rot90(s) for s in orthogonal_slices(recon)]
    for row, (img, rec) in enumerate(zip(img_s, rec_s)):
        sh, sw = img.shape
        cells = [panel[row * h : (row + 1) * h, col * w : (col + 1) * w] for col in range(3)]
        np.testing.assert_allclose(cells[0][:sh, :sw], img)
        np.testing.assert_allclose(cells[1][:sh, :sw], rec)
        np.testing.assert_allclose(cells[2][:sh, :sw], np.abs(img - rec), atol=1e-7)
        for cell in cells:  # zero padding outside the slice
            assert not cell[sh:, :].any() and not cell[:, sw:].any()
    # error scaling is clipped to [0, 1]; inputs outside [0, 1] are clipped too
    scaled = comparison_panel(image, recon, error_scale=4.0)
    np.testing.assert_allclose(scaled[:h, 2 * w :][:10, :8], np.clip(4 * np.abs(img_s[0] - rec_s[0]), 0, 1), atol=1e-6)
    assert comparison_panel(image * 3, recon, error_scale=0.0)[:, 2 * w :].max() == 0.0
    assert comparison_panel(image * 3, recon).max() <= 1.0
    with pytest.raises(ValueError, match=r"\(6, 8, 10\).*\(6, 8, 9\)"):
        comparison_panel(image, recon[..., :9])


def test_save_panel_png_roundtrip(tmp_path: Path) -> None:
    panel = np.linspace(0, 1, 12 * 9, dtype=np.float32).reshape(12, 9)
    path = save_panel_png(panel, tmp_path / "sub" / "panel.png")
    with Image.open(path) as img:
        assert img.mode == "L" and img.size == (9, 12)
        pixels = np.asarray(img)
    np.testing.assert_array_equal(pixels, np.round(panel * 255).astype(np.uint8))


# ---------------------------------------------------------------- TensorBoard handler


def test_ortho_slice_handler_writes_panels(tmp_path: Path) -> None:
    data = _volumes(3, shape=(SIDE, 12, 10))
    handler = OrthoSliceImageHandler(
        log_dir=str(tmp_path), tag="val_slices", max_images=2, global_step_transform=lambda engine: 42
    )
    evaluator = _evaluator(data, val_handlers=[handler])
    evaluator.run()
    handler.close()

    acc = _read_images(tmp_path)
    assert sorted(acc.Tags()["images"]) == ["val_slices/0", "val_slices/1"]
    h, w = 12, SIDE  # largest of the rotated slices (10, 12), (10, 16), (12, 16)
    for i in range(2):
        (event,) = acc.Images(f"val_slices/{i}")
        assert event.step == 42
        assert (event.height, event.width) == (3 * h, 3 * w)
        with Image.open(io.BytesIO(event.encoded_image_string)) as img:
            logged = np.asarray(img.convert("L")).astype(np.float32)
        expected = comparison_panel(data[i]["image"], data[i]["image"]) * 255  # identity network
        assert np.abs(logged - expected).max() <= 1.0
        assert not logged[:, 2 * w :].any()  # zero error column


def test_ortho_slice_handler_default_step_and_batched_output(tmp_path: Path) -> None:
    data = _volumes(3)
    handler = OrthoSliceImageHandler(log_dir=str(tmp_path), tag="slices", max_images=3)
    evaluator = _evaluator(data, val_handlers=[handler], decollate=False)
    for epoch in (1, 2):
        evaluator.run(global_epoch=epoch)
    handler.close()
    acc = _read_images(tmp_path)
    assert sorted(acc.Tags()["images"]) == ["slices/0", "slices/1", "slices/2"]
    assert [e.step for e in acc.Images("slices/2")] == [1, 2]  # default step: engine.state.epoch
    assert (acc.Images("slices/0")[0].height, acc.Images("slices/0")[0].width) == (3 * SIDE, 3 * SIDE)


def test_ortho_slice_handler_without_writer_or_log_dir_logs_nothing(tmp_path: Path, monkeypatch) -> None:
    """A run's writer is None on ranks other than 0: the handler given it attaches nothing and creates no writer."""
    monkeypatch.chdir(tmp_path)
    handler = OrthoSliceImageHandler(summary_writer=None, max_images=2)
    evaluator = _evaluator(_volumes(2), val_handlers=[handler])
    evaluator.run()
    assert handler._writer is None and handler._buffer == []
    assert not evaluator.has_event_handler(handler.iteration_completed, Events.ITERATION_COMPLETED)
    assert list(tmp_path.iterdir()) == []


def test_ortho_slice_handler_with_given_writer_and_errors(tmp_path: Path) -> None:
    class _Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def add_image(self, tag, img, step, dataformats):
            self.calls.append((tag, img.shape, step, dataformats))

        def flush(self) -> None:
            pass

    writer = _Recorder()
    handler = OrthoSliceImageHandler(summary_writer=writer, log_dir=str(tmp_path / "unused"), pred_key="pred")
    _evaluator(_volumes(3), val_handlers=[handler]).run()
    assert writer.calls == [("val_slices/0", (1, 3 * SIDE, 3 * SIDE), 1, "CHW")]
    assert not (tmp_path / "unused").exists()  # no default writer was created

    with pytest.raises(ValueError, match="0"):
        OrthoSliceImageHandler(summary_writer=writer, max_images=0)
    bad = OrthoSliceImageHandler(summary_writer=writer, pred_key="recon")
    with pytest.raises(KeyError, match="recon"):
        bad._samples([{"image": torch.zeros(1, 4, 4, 4), "pred": torch.zeros(1, 4, 4, 4)}])
    with pytest.raises(TypeError, match="Tensor"):
        bad._samples(torch.zeros(1, 1, 4, 4, 4))
