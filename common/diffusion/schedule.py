# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Diffusion noise schedules and Fast-DDPM's time-step grids with an explicit-grid DDIM sampler.

Fast-DDPM (Jiang et al. 2024) trains and samples on the same short grid of time steps out of
``num_train_timesteps``. MONAI's ``DDIMScheduler`` cannot sample an arbitrary (non-uniform) grid, so sampling here
is an explicit loop over ``alphas_cumprod`` at the grid points: from ``t_i`` to the previous grid point ``t_{i-1}``
(and from the first grid point to "time -1", where ``alpha_cumprod = 1``), DDIM with ``eta`` (0: deterministic).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

__all__ = ["DiffusionSchedule", "antithetic_timesteps", "fast_ddpm_grid", "grid_ddim_sample", "grid_problems"]

GRIDS = ("uniform", "non_uniform")
PREDICTIONS = ("epsilon", "v_prediction")


def fast_ddpm_grid(kind: str = "uniform", num_grid_steps: int = 10, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The time-step grid of Fast-DDPM, ascending, as a ``long`` tensor.

    ``uniform``: ``skip = T // S``; the points ``-1, skip - 1, 2 skip - 1, ...`` below ``T`` with the first one
    replaced by 0 (``[0, 99, 199, ..., 999]``, 11 points, for T = 1000, S = 10; ``arange(T)`` when ``skip`` is 1). ``non_uniform``: 40% of the points evenly in
    ``[0, 699)`` and 60% evenly in ``[699, 999]`` (rounded up), with Fast-DDPM's fixed grid
    ``[0, 199, 399, 599, 699, 799, 849, 899, 949, 999]`` for S = 10 and T = 1000. As in Fast-DDPM, the uniform grid
    has one point more than S and rounding can make the non-uniform one shorter; the sampler evaluates the network
    once per grid point.

    Raises:
        ValueError: for an unknown ``kind``, ``num_grid_steps`` < 1 or > ``num_train_timesteps``, or a
            non-uniform grid that would repeat points.
    """
    problems = grid_problems(kind, num_grid_steps, num_train_timesteps)
    if problems:
        raise ValueError(" ".join(problems))
    steps, total = int(num_grid_steps), int(num_train_timesteps)
    if kind == "uniform":
        if total // steps == 1:  # the full grid (a standard DDPM); Fast-DDPM's formula would repeat 0
            return torch.arange(total)
        grid = torch.arange(-1, total, total // steps)
        grid[0] = 0
        return grid
    return _non_uniform_grid(steps, total)


def _non_uniform_grid(steps: int, total: int) -> torch.Tensor:
    """Fast-DDPM's non-uniform grid of ``steps`` points out of ``total`` (may be short or repeat points for small
    ``steps``: :func:`grid_problems` says when)."""
    if steps == 10 and total == 1000:
        return torch.tensor([0, 199, 399, 599, 699, 799, 849, 899, 949, 999])
    knee, last = round(0.7 * total) - 1, total - 1  # 699 and 999 for T = 1000
    n1, n2 = int(steps * 0.4), int(steps * 0.6)
    stage_1 = torch.ceil(torch.linspace(0, knee, n1 + 1)[:-1]).long()
    stage_2 = torch.ceil(torch.linspace(knee, last, n2)).long()
    return torch.cat([stage_1, stage_2])


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def grid_problems(grid: str, num_grid_steps: int, num_train_timesteps: int) -> list[str]:
    """The rules of a Fast-DDPM grid (:func:`fast_ddpm_grid`), one problem line per broken rule, naming the config
    ids: a known ``grid``, ``num_train_timesteps`` an integer >= 1, ``num_grid_steps`` an integer in
    [1, ``num_train_timesteps``], and a ``non_uniform`` grid with a point below the knee (``t = 0.7 T``), one more
    reaching the last step and no point repeated."""
    problems = [] if grid in GRIDS else [f"'grid' must be one of {GRIDS}, got {grid!r}."]
    if not (_is_int(num_train_timesteps) and num_train_timesteps >= 1):
        return [*problems, f"'num_train_timesteps' must be an integer >= 1, got {num_train_timesteps!r}."]
    total = int(num_train_timesteps)
    if not (_is_int(num_grid_steps) and 1 <= num_grid_steps <= total):
        return [*problems, f"'num_grid_steps' must be in [1, num_train_timesteps={total}], got {num_grid_steps!r}."]
    steps = int(num_grid_steps)
    if grid != "non_uniform":
        return problems
    if int(steps * 0.4) < 1 or int(steps * 0.6) < 2:  # no point below the knee, or none reaching the last step
        knee = round(0.7 * total) - 1
        return [
            *problems,
            f"'num_grid_steps': a non_uniform grid needs num_grid_steps >= 4 (40% below and 60% above t={knee}), got "
            f"{steps}.",
        ]
    points = _non_uniform_grid(steps, total)
    if len(torch.unique(points)) != len(points):
        problems.append(
            f"'num_grid_steps': a non_uniform grid of {steps} points out of {total} repeats points: {points.tolist()}."
        )
    return problems


def antithetic_timesteps(grid: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` training time steps drawn from ``grid`` in antithetic pairs: the first ``ceil(n / 2)`` indices ``i`` at
    random, then their mirrors ``len - 1 - i`` (every step is paired when ``n`` is even)."""
    first = torch.randint(0, len(grid), ((n + 1) // 2,), generator=generator)
    idx = torch.cat([first, len(grid) - first - 1])[:n]
    return grid[idx]


class DiffusionSchedule:
    """A discrete DDPM noise schedule: ``alphas_cumprod`` in float64 and the conversions between x0, noise and v.

    Args:
        num_train_timesteps: T.
        beta_schedule: ``linear`` (``beta_start``..``beta_end``, DDPM) or ``cosine`` (Nichol & Dhariwal 2021).
        beta_start: first beta of the linear schedule.
        beta_end: last beta of the linear schedule.
    """

    def __init__(
        self,
        num_train_timesteps: int = 1000,
        beta_schedule: str = "linear",
        beta_start: float = 1e-4,
        beta_end: float = 0.02,
    ) -> None:
        total = int(num_train_timesteps)
        if total < 1:
            raise ValueError(f"num_train_timesteps must be >= 1, got {num_train_timesteps!r}.")
        if beta_schedule == "linear":
            betas = torch.linspace(beta_start, beta_end, total, dtype=torch.float64)
        elif beta_schedule == "cosine":
            s = 0.008
            steps = torch.arange(total + 1, dtype=torch.float64) / total
            f = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
            betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
        else:
            raise ValueError(f"beta_schedule must be 'linear' or 'cosine', got {beta_schedule!r}.")
        self.num_train_timesteps = total
        self.betas = betas
        self.alphas_cumprod = torch.cumprod(1 - betas, dim=0)
        self._tables: dict[torch.device, torch.Tensor] = {}

    def _padded(self, device: torch.device) -> torch.Tensor:
        """``[1, *alphas_cumprod]`` on ``device``, copied there once (made afresh while tracing, so that every trace
        of a sampler records the same operations)."""
        if device in self._tables and not torch.jit.is_tracing():
            return self._tables[device]
        table = torch.cat([torch.ones(1, dtype=torch.float64), self.alphas_cumprod]).to(device)
        if not torch.jit.is_tracing():
            self._tables[device] = table
        return table

    def alpha_bar(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``alphas_cumprod[t]`` (1 for ``t = -1``) shaped to broadcast against ``like``. Looked up on the device of
        ``t`` (time steps on the GPU are not read back to the host)."""
        t = torch.as_tensor(t, dtype=torch.long).reshape(-1)
        values = self._padded(t.device)[t + 1]
        values = values.to(device=like.device, non_blocking=like.device.type != "cpu")
        return values.reshape(-1, *([1] * (like.ndim - 1)))

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``x_t = sqrt(a) x0 + sqrt(1 - a) noise``."""
        a = self.alpha_bar(t, x0)
        return (a.sqrt() * x0.double() + (1 - a).sqrt() * noise.double()).to(x0.dtype)

    def velocity(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The v-prediction target ``v = sqrt(a) noise - sqrt(1 - a) x0`` (Salimans & Ho 2022)."""
        a = self.alpha_bar(t, x0)
        return (a.sqrt() * noise.double() - (1 - a).sqrt() * x0.double()).to(x0.dtype)

    def split(
        self, x_t: torch.Tensor, output: torch.Tensor, t: torch.Tensor, prediction_type: str = "epsilon"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x0, noise)`` from ``x_t`` and a network output (epsilon or v), in float64."""
        if prediction_type not in PREDICTIONS:
            raise ValueError(f"prediction_type must be one of {PREDICTIONS}, got {prediction_type!r}.")
        a = self.alpha_bar(t, x_t)
        x, out = x_t.double(), output.double()
        if prediction_type == "epsilon":
            return (x - (1 - a).sqrt() * out) / a.sqrt(), out
        x0 = a.sqrt() * x - (1 - a).sqrt() * out
        return x0, (1 - a).sqrt() * x + a.sqrt() * out


@torch.no_grad()
def grid_ddim_sample(
    model_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x_t: torch.Tensor,
    grid: torch.Tensor,
    schedule: DiffusionSchedule,
    eta: float = 0.0,
    prediction_type: str = "epsilon",
    generator: torch.Generator | None = None,
    clip_sample: bool = False,
    x0_transform: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """DDIM sampling over exactly the points of ``grid``, from its last point down to "time -1".

    At grid point ``t`` with previous point ``s`` (``-1`` after the first point, where ``alpha_cumprod = 1``)::

        x0 = (x_t - sqrt(1 - a_t) eps) / sqrt(a_t)
        c1 = eta sqrt((1 - a_t / a_s) (1 - a_s) / (1 - a_t)),   c2 = sqrt(1 - a_s - c1^2)
        x_s = sqrt(a_s) x0 + c1 z + c2 eps

    so ``len(grid)`` network evaluations give a sample. With an oracle epsilon the result is x0 exactly, on any
    grid and for any ``eta`` (the last step has ``a_s = 1``).

    Args:
        model_fn: ``(x_t, t) -> epsilon or v`` with ``t`` a ``(B,)`` long tensor.
        x_t: the starting noise at the last grid point (``N(0, I)`` for generation).
        grid: ascending time steps (e.g. :func:`fast_ddpm_grid`).
        schedule: the noise schedule the network was trained with.
        eta: 0 for deterministic DDIM, 1 for DDPM-like ancestral noise.
        prediction_type: ``epsilon`` or ``v_prediction``.
        generator: RNG of the ancestral noise (``eta > 0``).
        clip_sample: clip each x0 estimate to ``[-1, 1]`` (data in that range) and take the noise consistent with
            the clipped x0, as DDPM/DDIM implementations do for images; off for latents.
        x0_transform: ``(x0, t) -> x0`` applied to each x0 estimate (float64) after clipping, e.g. a
            data-consistency correction; the noise is then taken consistent with the corrected x0, as for clipping.
            ``None``: the estimate is used as it is.
    """
    grid = torch.as_tensor(grid, dtype=torch.long).cpu()
    previous = torch.cat([torch.tensor([-1]), grid[:-1]])
    x = x_t
    batch = x_t.shape[0]
    for t, s in zip(reversed(grid.tolist()), reversed(previous.tolist())):
        t_batch = torch.full((batch,), t, dtype=torch.long, device=x.device)
        x0, eps = schedule.split(x, model_fn(x, t_batch), t_batch, prediction_type)
        a_t = schedule.alpha_bar(torch.tensor([t]), x)
        if clip_sample:
            x0 = x0.clamp(-1.0, 1.0)
        if x0_transform is not None:
            x0 = x0_transform(x0, t).double()
        if clip_sample or x0_transform is not None:
            eps = (x.double() - a_t.sqrt() * x0) / (1 - a_t).sqrt()
        a_s = schedule.alpha_bar(torch.tensor([s]), x)
        c1 = float(eta) * ((1 - a_t / a_s) * (1 - a_s) / (1 - a_t)).sqrt()
        c2 = (1 - a_s - c1**2).clamp_min(0).sqrt()
        noise = torch.randn(x.shape, generator=generator, dtype=torch.float64).to(x.device) if eta else 0.0
        x = (a_s.sqrt() * x0 + c1 * noise + c2 * eps).to(x_t.dtype)
    return x
