# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Learning-rate schedules stepped once per iteration."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["WarmupCosine", "warmup_cosine"]


class WarmupCosine:
    """Multiplier of the base learning rate: linear warm-up, then cosine decay to ``min_ratio``.

    A class rather than a closure so ``LambdaLR.state_dict`` stores its parameters.
    """

    def __init__(self, warmup_iterations: int, total_iterations: int, min_ratio: float = 0.0) -> None:
        if total_iterations < 1:
            raise ValueError(f"total_iterations must be >= 1, got {total_iterations!r}.")
        if warmup_iterations < 0:
            raise ValueError(f"warmup_iterations must be >= 0, got {warmup_iterations!r}.")
        self.warmup_iterations = int(warmup_iterations)
        self.total_iterations = int(total_iterations)
        self.min_ratio = float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_iterations:
            return (step + 1) / self.warmup_iterations
        span = max(self.total_iterations - self.warmup_iterations, 1)
        progress = min((step - self.warmup_iterations) / span, 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: Optimizer, warmup_iterations: int, total_iterations: int, min_ratio: float = 0.0, enabled: bool = True
) -> LambdaLR:
    """``LambdaLR`` with :class:`WarmupCosine` (constant learning rate when ``enabled`` is false)."""
    if not enabled:
        return LambdaLR(optimizer, lr_lambda=WarmupCosine(0, 1, 1.0))
    return LambdaLR(optimizer, lr_lambda=WarmupCosine(warmup_iterations, total_iterations, min_ratio))
