# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Generation metrics: sample diversity (mean pairwise MS-SSIM per input), per-volume output values, and the
handler set of a diffusion bundle's validation."""

from __future__ import annotations

from itertools import combinations

import pytest
import torch
import torch.nn.functional as F
from ignite.engine import Engine
from monai.metrics import PSNRMetric

from common.diffusion.metrics import (
    OutputValueMetric,
    SampleDiversityMetric,
    diffusion_metric_handlers,
    output_value_handler,
    sample_diversity_handler,
)
from common.metrics.image import VolumeMSSSIMMetric

torch.set_num_threads(1)


def _noise(n: int, seed: int, size: int = 16) -> torch.Tensor:
    return torch.rand(n, 1, size, size, size, generator=torch.Generator().manual_seed(seed))


def _smooth(n: int, seed: int, size: int = 16) -> torch.Tensor:
    """Smoothed noise in [0, 1]: pairs have a clearly positive, non-trivial MS-SSIM."""
    x = torch.rand(n, 1, size + 8, size + 8, size + 8, generator=torch.Generator().manual_seed(seed))
    return F.avg_pool3d(x, 3, 1, 1)[..., 4 : 4 + size, 4 : 4 + size, 4 : 4 + size]


def _ms_ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    metric = VolumeMSSSIMMetric(spatial_dims=3, data_range=1.0, kernel_size=3, max_scales=3)
    metric(y_pred=a[None], y=b[None])
    return metric.aggregate().item()


# ---------------------------------------------------------------------------------------------- sample diversity
def test_identical_samples_score_one():
    sample = _smooth(1, 0)
    metric = SampleDiversityMetric(num_samples=3)
    value = metric(sample.repeat(3, 1, 1, 1, 1))
    assert value.shape == (1, 1)
    assert value.item() == pytest.approx(1.0, abs=1e-5)


def test_independent_noise_scores_well_below_one():
    metric = SampleDiversityMetric(num_samples=2)
    assert metric(_noise(2, 1)).item() < 0.2


def test_one_value_per_input_with_consecutive_samples():
    same = _smooth(1, 2).repeat(2, 1, 1, 1, 1)
    different = _noise(2, 3)
    metric = SampleDiversityMetric(num_samples=2)
    values = metric(torch.cat([same, different]))
    assert values.shape == (2, 1)
    assert values[0].item() == pytest.approx(1.0, abs=1e-5)
    assert values[1].item() < 0.2
    # the other order gives the values in the other order (groups are consecutive samples, not interleaved)
    swapped = metric(torch.cat([different, same]))
    torch.testing.assert_close(swapped.flatten(), values.flatten().flip(0))
    assert metric.aggregate().item() == pytest.approx(values.mean().item(), abs=1e-6)


def test_value_is_the_mean_pairwise_volume_ms_ssim():
    samples = _smooth(3, 4)
    metric = SampleDiversityMetric(num_samples=3)
    value = metric(samples).item()
    pairs = [_ms_ssim(samples[i], samples[j]) for i, j in combinations(range(3), 2)]
    assert 0.05 < value < 0.95
    assert value == pytest.approx(sum(pairs) / 3, rel=1e-5)
    pair = SampleDiversityMetric(num_samples=2)(samples[:2]).item()
    assert pair == pytest.approx(pairs[0], rel=1e-5)


def test_y_is_ignored():
    samples = _smooth(2, 5)
    metric = SampleDiversityMetric(num_samples=2)
    torch.testing.assert_close(metric(samples, torch.zeros_like(samples)), metric(samples))


def test_batch_not_a_multiple_of_num_samples():
    with pytest.raises(ValueError, match="not a multiple of num_samples=2"):
        SampleDiversityMetric(num_samples=2)(_noise(3, 6))


@pytest.mark.parametrize("num_samples", [1, 0, True])
def test_needs_two_samples(num_samples):
    with pytest.raises(ValueError, match="at least 2 samples"):
        SampleDiversityMetric(num_samples=num_samples)


# ---------------------------------------------------------------------------------------------- output values
def test_output_value_metric_averages_per_volume_values():
    metric = OutputValueMetric()
    first = metric(torch.tensor([1.0, 2.0]))
    assert first.shape == (2, 1)
    metric(torch.tensor([[6.0]]))
    assert metric.aggregate().item() == pytest.approx(3.0)
    assert metric.aggregate("sum").item() == pytest.approx(9.0)
    metric.reset()
    metric(torch.tensor([5.0]))
    assert metric.aggregate().item() == pytest.approx(5.0)


# ---------------------------------------------------------------------------------------------- handler sets
def test_handler_keys_conditional():
    handlers = diffusion_metric_handlers(conditional=True, num_samples=1, denoise_loss=True)
    assert set(handlers) == {"val_psnr", "val_ssim", "val_ms_ssim", "val_denoise_loss"}
    assert next(iter(handlers)) == "val_psnr"  # the key metric of an evaluator


def test_handler_keys_conditional_with_samples_and_prefix():
    handlers = diffusion_metric_handlers(conditional=True, num_samples=2, denoise_loss=False, prefix="test_")
    assert set(handlers) == {"test_psnr", "test_ssim", "test_ms_ssim", "test_sample_ms_ssim"}
    assert handlers["test_sample_ms_ssim"].metric_fn.num_samples == 2


@pytest.mark.parametrize(
    "num_samples, denoise_loss, expected",
    [
        (1, True, {"val_denoise_loss"}),
        (3, False, {"val_sample_ms_ssim"}),
        (2, True, {"val_sample_ms_ssim", "val_denoise_loss"}),
    ],
)
def test_handler_keys_unconditional(num_samples, denoise_loss, expected):
    handlers = diffusion_metric_handlers(conditional=False, num_samples=num_samples, denoise_loss=denoise_loss)
    assert set(handlers) == expected


def test_nothing_to_measure():
    with pytest.raises(ValueError, match="no validation metric"):
        diffusion_metric_handlers(conditional=False, num_samples=1, denoise_loss=False)


def test_handlers_on_an_engine():
    pred = torch.cat([_smooth(1, 7).repeat(2, 1, 1, 1, 1), _smooth(2, 8)])  # 2 inputs x 2 samples
    label = (pred + 0.05 * _noise(4, 9)).clamp(0, 1)
    batches = [
        {"pred": pred[:2], "label": label[:2], "denoise_loss": torch.tensor([0.5])},
        {"pred": pred[2:], "label": label[2:], "denoise_loss": torch.tensor([1.5])},
    ]
    engine = Engine(lambda e, batch: batch)
    handlers = diffusion_metric_handlers(conditional=True, num_samples=2, denoise_loss=True)
    for name, handler in handlers.items():
        handler.attach(engine, name)
    engine.run(batches, max_epochs=1)
    metrics = engine.state.metrics
    assert metrics["val_denoise_loss"] == pytest.approx(1.0)
    diversity = SampleDiversityMetric(2)(pred[2:]).item()
    assert metrics["val_sample_ms_ssim"] == pytest.approx((1.0 + diversity) / 2, rel=1e-5)
    psnr = PSNRMetric(max_val=1.0)(pred, label).mean().item()
    assert metrics["val_psnr"] == pytest.approx(psnr, rel=1e-5)
    assert 0 < metrics["val_ms_ssim"] < 1


def test_single_handlers_with_details():
    engine = Engine(lambda e, batch: batch)
    sample_diversity_handler(2, save_details=True).attach(engine, "div")
    output_value_handler("loss", save_details=True).attach(engine, "loss")
    same = _smooth(1, 10).repeat(2, 1, 1, 1, 1)
    engine.run([{"pred": same, "loss": torch.tensor([2.0, 4.0])}], max_epochs=1)
    assert engine.state.metrics["div"] == pytest.approx(1.0, abs=1e-5)
    assert engine.state.metrics["loss"] == pytest.approx(3.0)
    assert engine.state.metric_details["loss"].flatten().tolist() == [2.0, 4.0]
