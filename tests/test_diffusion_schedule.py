# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Fast-DDPM grids, antithetic time steps, schedule conversions and the explicit-grid DDIM sampler (oracle)."""

from __future__ import annotations

import pytest
import torch

from common.diffusion.schedule import DiffusionSchedule, antithetic_timesteps, fast_ddpm_grid, grid_ddim_sample


def _fast_ddpm_reference(kind: str, steps: int, total: int = 1000) -> list[int]:
    """Fast-DDPM's own construction (runners/diffusion.py), written out independently."""
    if kind == "uniform":
        skip = total // steps
        return [0] + list(range(skip - 1, total, skip))[: len(range(-1, total, skip)) - 1]
    if steps == 10:
        return [0, 199, 399, 599, 699, 799, 849, 899, 949, 999]
    n1, n2 = int(steps * 0.4), int(steps * 0.6)
    import math

    stage_1 = [math.ceil(699 * i / n1) for i in range(n1)] if n1 else []
    stage_2 = [math.ceil(699 + 300 * i / (n2 - 1)) for i in range(n2)] if n2 > 1 else [699] * n2
    return stage_1 + stage_2


@pytest.mark.parametrize("kind", ["uniform", "non_uniform"])
@pytest.mark.parametrize("steps", [5, 10, 20, 50])
def test_grids_match_fast_ddpm(kind, steps):
    grid = fast_ddpm_grid(kind, steps, 1000)
    assert grid.tolist() == _fast_ddpm_reference(kind, steps)
    assert grid.dtype == torch.long and bool((grid[1:] > grid[:-1]).all())


def test_grid_values_and_errors():
    # as in Fast-DDPM: range(-1, 1000, 100) with -1 -> 0, so 11 points up to 999
    assert fast_ddpm_grid("uniform", 10).tolist() == [0, 99, 199, 299, 399, 499, 599, 699, 799, 899, 999]
    assert fast_ddpm_grid("non_uniform", 10).tolist() == [0, 199, 399, 599, 699, 799, 849, 899, 949, 999]
    assert (fast_ddpm_grid("non_uniform", 20) < 699).sum() == 8  # 40% below t=700
    assert fast_ddpm_grid("uniform", 1000).tolist() == list(range(1000))  # the baseline: every step
    assert fast_ddpm_grid("uniform", 7).tolist() == [0, *range(141, 1000, 142)]  # 8 points, as in Fast-DDPM
    for bad in (0, 1001):
        with pytest.raises(ValueError, match="num_grid_steps"):
            fast_ddpm_grid("uniform", bad)
    with pytest.raises(ValueError, match="'grid' must be one of"):
        fast_ddpm_grid("linear", 10)


def test_antithetic_pairs():
    grid = fast_ddpm_grid("uniform", 10)
    gen = torch.Generator().manual_seed(0)
    t = antithetic_timesteps(grid, 8, gen)
    assert t.shape == (8,) and set(t.tolist()) <= set(grid.tolist())
    idx = [grid.tolist().index(v) for v in t.tolist()]
    half = (len(idx) + 1) // 2  # every drawn index is followed by its mirror: 4 pairs in a batch of 8
    assert len(idx) - half == 4
    for i in range(len(idx) - half):
        assert idx[i] + idx[half + i] == len(grid) - 1
    pair = antithetic_timesteps(grid, 2, gen)  # even the smallest batch is one antithetic pair
    assert grid.tolist().index(pair[0]) + grid.tolist().index(pair[1]) == len(grid) - 1
    assert antithetic_timesteps(grid, 1, gen).shape == (1,)


@pytest.mark.parametrize("beta_schedule", ["linear", "cosine"])
def test_schedule_conversions_round_trip(beta_schedule):
    schedule = DiffusionSchedule(1000, beta_schedule)
    assert schedule.alphas_cumprod.dtype == torch.float64
    assert bool((schedule.alphas_cumprod[1:] < schedule.alphas_cumprod[:-1]).all())
    gen = torch.Generator().manual_seed(1)
    shape = (3, 1, 4, 4, 4)  # float64: at t = 999 of the cosine schedule 1 / sqrt(alpha_bar) amplifies rounding
    x0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    noise = torch.randn(shape, generator=gen, dtype=torch.float64)
    t = torch.tensor([0, 500, 999])
    x_t = schedule.add_noise(x0, noise, t)
    for prediction, output in (("epsilon", noise), ("v_prediction", schedule.velocity(x0, noise, t))):
        x0_hat, noise_hat = schedule.split(x_t, output, t, prediction)
        torch.testing.assert_close(x0_hat, x0, rtol=0, atol=1e-8)
        torch.testing.assert_close(noise_hat, noise, rtol=0, atol=1e-8)
    assert schedule.alpha_bar(torch.tensor([-1]), x0).item() == 1.0
    with pytest.raises(ValueError, match="prediction_type"):
        schedule.split(x_t, noise, t, "x0")
    with pytest.raises(ValueError, match="beta_schedule"):
        DiffusionSchedule(1000, "quadratic")


@pytest.mark.parametrize("kind", ["uniform", "non_uniform"])
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_oracle_recovers_x0_exactly(kind, prediction, eta):
    schedule = DiffusionSchedule(1000, "linear")
    grid = fast_ddpm_grid(kind, 10)
    gen = torch.Generator().manual_seed(2)
    x0 = torch.rand(2, 1, 6, 6, 6, generator=gen, dtype=torch.float64) * 2 - 1
    calls = []

    def oracle(x_t, t):
        calls.append(int(t[0]))
        a = schedule.alpha_bar(t, x_t)
        eps = (x_t - a.sqrt() * x0) / (1 - a).sqrt()
        return eps if prediction == "epsilon" else schedule.velocity(x0, eps, t)

    x_T = schedule.add_noise(x0, torch.randn(x0.shape, generator=gen, dtype=torch.float64), grid[-1:].repeat(2))
    out = grid_ddim_sample(oracle, x_T, grid, schedule, eta=eta, prediction_type=prediction, generator=gen)
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-9)
    assert calls == list(reversed(grid.tolist()))  # one network evaluation per grid point, top down


def test_ancestral_noise_is_drawn_from_the_generator_per_step():
    """With ``eta > 0`` each step adds ``c1 z`` with ``z`` a float64 standard normal draw from ``generator`` (one per
    grid point, top down): the sample equals the documented update recomputed with the same draws."""
    schedule = DiffusionSchedule(1000, "linear")
    grid = torch.tensor([0, 300, 700])
    x_T = torch.randn(2, 1, 4, 4, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def model(x_t, t):  # any deterministic epsilon
        return 0.5 * x_t + 0.001 * t.view(-1, 1, 1, 1, 1)

    eta = 0.7
    out = grid_ddim_sample(model, x_T, grid, schedule, eta=eta, generator=torch.Generator().manual_seed(9))
    gen = torch.Generator().manual_seed(9)
    alpha = torch.cat([torch.ones(1, dtype=torch.float64), schedule.alphas_cumprod])  # alpha[t + 1], alpha[0] = 1
    x = x_T
    for t, s in ((700, 300), (300, 0), (0, -1)):
        a_t, a_s = alpha[t + 1], alpha[s + 1]
        eps = model(x, torch.full((2,), t))
        x0 = (x - (1 - a_t).sqrt() * eps) / a_t.sqrt()
        c1 = eta * ((1 - a_t / a_s) * (1 - a_s) / (1 - a_t)).sqrt()
        c2 = (1 - a_s - c1**2).sqrt()
        z = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        assert (float(c1) > 0) == (s >= 0)  # noise enters every step but the last (a_s = 1 there)
        x = a_s.sqrt() * x0 + c1 * z + c2 * eps
    torch.testing.assert_close(out, x, rtol=1e-12, atol=1e-12)  # float64, the same few operations per step
