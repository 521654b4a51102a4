# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the per-iteration warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch

from common.engines.lr_schedule import WarmupCosine, warmup_cosine


def _optimizer(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(scheduler, optimizer, steps: int) -> list[float]:
    values = []
    for _ in range(steps):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


def test_warmup_cosine_key_points():
    f = WarmupCosine(warmup_iterations=10, total_iterations=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1)  # (0 + 1) / 10
    assert f(4) == pytest.approx(0.5)
    assert f(9) == pytest.approx(1.0)  # warm-up ends at full rate
    assert f(10) == pytest.approx(1.0)  # cosine starts at 1
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)  # midpoint of the cosine: halfway to min_ratio
    assert f(110) == pytest.approx(0.1)  # end == min_ratio
    assert f(500) == pytest.approx(0.1)  # stays at min_ratio afterwards


def test_warmup_cosine_closed_form_everywhere():
    warmup, total, floor = 3, 23, 0.05
    f = WarmupCosine(warmup, total, floor)
    for step in range(total + 5):
        if step < warmup:
            expected = (step + 1) / warmup
        else:
            progress = min((step - warmup) / (total - warmup), 1.0)
            expected = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        assert f(step) == pytest.approx(expected, abs=1e-12)


def test_warmup_cosine_is_monotone_after_warmup():
    f = WarmupCosine(5, 50, 0.0)
    values = [f(s) for s in range(5, 51)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[-1] == pytest.approx(0.0, abs=1e-12)


def test_no_warmup_starts_at_full_rate():
    f = WarmupCosine(0, 10)
    assert f(0) == 1.0
    assert f(5) == pytest.approx(0.5)


def test_warmup_as_long_as_training_does_not_divide_by_zero():
    f = WarmupCosine(10, 10, 0.2)
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(11) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 1.0)))


@pytest.mark.parametrize("total", [0, -5])
def test_bad_total_iterations(total):
    with pytest.raises(ValueError, match=f"total_iterations must be >= 1, got {total}"):
        WarmupCosine(0, total)
    with pytest.raises(ValueError, match="total_iterations"):
        warmup_cosine(_optimizer(), 0, total)


def test_bad_warmup_iterations():
    with pytest.raises(ValueError, match="warmup_iterations must be >= 0, got -1"):
        WarmupCosine(-1, 10)


def test_scheduler_sets_optimizer_lr_per_step():
    optimizer = _optimizer(lr=0.2)
    scheduler = warmup_cosine(optimizer, warmup_iterations=2, total_iterations=6, min_ratio=0.1)
    f = WarmupCosine(2, 6, 0.1)
    assert _lrs(scheduler, optimizer, 8) == pytest.approx([0.2 * f(s) for s in range(8)])


def test_disabled_schedule_is_constant():
    optimizer = _optimizer(lr=0.3)
    scheduler = warmup_cosine(optimizer, warmup_iterations=5, total_iterations=10, min_ratio=0.0, enabled=False)
    assert _lrs(scheduler, optimizer, 15) == pytest.approx([0.3] * 15)


def test_state_dict_round_trip_through_weights_only_load(tmp_path):
    optimizer = _optimizer(lr=1.0)
    scheduler = warmup_cosine(optimizer, warmup_iterations=3, total_iterations=20, min_ratio=0.2)
    _lrs(scheduler, optimizer, 7)
    torch.save({"scheduler": scheduler.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "s.pt")
    expected = _lrs(scheduler, optimizer, 20)

    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    # a scheduler built with other parameters takes the saved ones
    optimizer2 = _optimizer(lr=5.0)
    scheduler2 = warmup_cosine(optimizer2, warmup_iterations=1, total_iterations=2, min_ratio=0.9)
    optimizer2.load_state_dict(loaded["optimizer"])
    scheduler2.load_state_dict(loaded["scheduler"])
    fn = scheduler2.lr_lambdas[0]
    assert isinstance(fn, WarmupCosine)
    assert (fn.warmup_iterations, fn.total_iterations, fn.min_ratio) == (3, 20, 0.2)
    assert scheduler2.last_epoch == 7
    assert _lrs(scheduler2, optimizer2, 20) == pytest.approx(expected)
